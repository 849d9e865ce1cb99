"""A client that benchmarks a live SGLang endpoint from outside (or this engine's server, which speaks
the same): each request's numbers from the native /generate (meta_info: completion tokens, latency,
spec_verify_ct, spec_accept_length) or from the OpenAI-compatible streaming endpoints (time to first
token, time per output token), and a sweep over endpoints and concurrency that appends one stamped
row per request to serving.csv.

    python -m kdtree_lib.serving.client --url http://127.0.0.1:30000 --concurrency 1 2 4 8 --budget-label 32
    python -m kdtree_lib.serving.client --url URL --prompts my_prompts.jsonl --endpoints generate completions chat

Budgets change across server restarts: run one sweep per budget and label it (--budget-label; by
default the label is read from the server's reported configuration). Every request has a timeout and
every failure (HTTP status, transport error, timeout) is a row of its own, so a sweep always ends.
An arm's rows are written when the arm ends, with no request in flight (writing a file inside the
event loop would add its time to every request measured meanwhile), and whatever stops a sweep
(an error, Ctrl-C) the rows it measured are written before it stops.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from statistics import median

import httpx

from .. import cli
from ..corpus import PROMPTS_PATH
from ..results import append_rows, check_writable

TOPIC = "serving"
ENDPOINTS = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}
STREAMED = ("completions", "chat")
SERVER_INFO_PATHS = ("/get_server_info", "/server_info")
CONFIG_KEYS = ("model_path", "served_model_name", "decode_method", "tp_size", "dp_size", "max_running_requests",
               "cuda_graph_max_bs", "context_length", "dtype", "version")
ERROR_CHARS = 300


# ----------------------------------------------------------------------------------------------
# prompts

def load_prompt_texts(path=None, *, count: int, max_chars: int) -> list[str]:
    """The first `count` prompts of a JSONL file (a "text" or "prompt" field per line; default: the
    committed held-out code prompts), each cut to its first `max_chars` characters."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count: expected a positive integer, got {count!r}")
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 1:
        raise ValueError(f"max_chars: expected a positive integer, got {max_chars!r}")
    path = Path(path or PROMPTS_PATH)
    texts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            record = json.loads(line)
            text = record.get("text", record.get("prompt")) if isinstance(record, dict) else None
            if not isinstance(text, str) or not text:
                raise ValueError(f"path: {path} line {number} has no \"text\" or \"prompt\" string")
            texts.append(text[:max_chars])
    if len(texts) < count:
        raise ValueError(f"count: {path} holds {len(texts)} prompts, asked for {count}")
    return texts[:count]


# ----------------------------------------------------------------------------------------------
# one request

def _failure(status, message: str) -> dict:
    return {"ok": False, "status": status, "error": message[:ERROR_CHARS]}


def _error_message(response: httpx.Response) -> str:
    """SGLang's error text: {"error": {"message"}} natively, {"message"} from the OpenAI endpoints."""
    try:
        body = response.json()
    except ValueError:
        return response.text or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        return str(error.get("message", error) if isinstance(error, dict) else error or body.get("message", body))
    return str(body)


async def request_generate(client: httpx.AsyncClient, url: str, prompt, *, max_new_tokens: int, temperature: float,
                           ignore_eos: bool) -> dict:
    """POST /generate (not streamed); the numbers of its meta_info."""
    body = {"text" if isinstance(prompt, str) else "input_ids": prompt,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": ignore_eos}}
    response = await client.post(url + ENDPOINTS["generate"], json=body)
    if response.status_code != 200:
        return _failure(response.status_code, _error_message(response))
    answer = response.json()
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    if not isinstance(meta, dict):
        return _failure(200, f"no meta_info in the answer: {response.text}")
    return {"ok": True, "status": 200, "prompt_tokens": meta.get("prompt_tokens"),
            "completion_tokens": meta.get("completion_tokens"), "server_latency_s": meta.get("e2e_latency"),
            "spec_verify_ct": meta.get("spec_verify_ct"), "spec_accept_length": meta.get("spec_accept_length")}


async def request_stream(client: httpx.AsyncClient, url: str, prompt, *, chat: bool, model: str, max_new_tokens: int,
                         temperature: float, ignore_eos: bool) -> dict:
    """A streamed OpenAI completion (chat: the prompt, a text, as one user message); TTFT is the first chunk
    with text, TPOT (end - first text) / (completion tokens - 1), the tokens from the usage chunk."""
    body = {"model": model, "max_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": ignore_eos,
            "stream": True, "stream_options": {"include_usage": True},
            **({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})}
    start = time.perf_counter()
    first = None
    usage = {}
    async with client.stream("POST", url + ENDPOINTS["chat" if chat else "completions"], json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return _failure(response.status_code, _error_message(response))
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if not isinstance(chunk, dict):
                return _failure(200, f"not an event object in the stream: {data}")
            if "error" in chunk or chunk.get("object") == "error":
                return _failure(200, f"error in the stream: {chunk.get('error', chunk.get('message'))}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                text = choice.get("delta", {}).get("content") if chat else choice.get("text")
                if text and first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    if first is None and not usage:
        return _failure(200, "the stream ended with neither text nor usage")
    tokens = usage.get("completion_tokens")
    return {"ok": True, "status": 200, "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": tokens,
            "ttft_s": first - start if first is not None else None,
            "tpot_s": (end - first) / (tokens - 1) if first is not None and tokens and tokens > 1 else None}


async def measure(client: httpx.AsyncClient, url: str, endpoint: str, prompt, *, model: str, max_new_tokens: int,
                  temperature: float, ignore_eos: bool, timeout_s: float) -> dict:
    """One request on `endpoint`, bounded by timeout_s as a whole; never raises for what the server or
    the network does: a timeout, transport error or HTTP error comes back as ok False with the reason."""
    start = time.perf_counter()
    settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, ignore_eos=ignore_eos)
    if endpoint == "generate":
        call = request_generate(client, url, prompt, **settings)
    else:
        call = request_stream(client, url, prompt, chat=endpoint == "chat", model=model, **settings)
    try:
        result = await asyncio.wait_for(call, timeout_s)
    except asyncio.TimeoutError:
        result = _failure("timeout", f"no complete answer within {timeout_s:g} s")
    except (httpx.HTTPError, ValueError) as err:  # ValueError: a body that is not JSON
        result = _failure("transport", f"{type(err).__name__}: {err}")
    latency = time.perf_counter() - start
    result["latency_s"] = latency
    tokens = result.get("completion_tokens")
    result["tokens_per_second"] = tokens / latency if result["ok"] and tokens else None
    return result


# ----------------------------------------------------------------------------------------------
# what the server says about itself

async def server_info(client: httpx.AsyncClient, url: str, timeout_s: float) -> dict:
    """/get_server_info (or /server_info on newer SGLang); {} where neither is offered or answers
    within timeout_s."""
    for path in SERVER_INFO_PATHS:
        try:
            response = await asyncio.wait_for(client.get(url + path), timeout_s)
            info = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, asyncio.TimeoutError, ValueError):
            return {}
        if info is not None:
            return info if isinstance(info, dict) else {}
    return {}


def reported_config(info: dict) -> dict:
    """The server configuration kept in each row: the speculative settings and a few serving ones."""
    keys = [k for k in info if k.startswith(("speculative_", "ddtree_"))] + [k for k in CONFIG_KEYS if k in info]
    return {key: info[key] for key in sorted(keys) if info[key] is not None}


def budget_label_of(info: dict) -> str:
    """A budget label from the reported configuration: a budget setting (this server's ddtree_budget, or
    a speculative_*budget* one), else SGLang's draft tokens per verify less the root, else the
    algorithm ("ar" when none)."""
    budgets = [key for key in sorted(info)
               if key == "ddtree_budget" or (key.startswith("speculative_") and "budget" in key)]
    if budgets and info[budgets[0]]:
        return str(info[budgets[0]])
    draft_tokens = info.get("speculative_num_draft_tokens")
    if draft_tokens:
        return str(int(draft_tokens) - 1)
    return str(info.get("speculative_algorithm") or info.get("decode_method") or "ar").lower()


async def flush_cache(client: httpx.AsyncClient, url: str, timeout_s: float) -> bool | None:
    """POST /flush_cache: True when the server flushed, False when it refused, None where not offered
    (or no answer within timeout_s)."""
    try:
        response = await asyncio.wait_for(client.post(url + "/flush_cache"), timeout_s)
    except (httpx.HTTPError, asyncio.TimeoutError):
        return None
    if response.status_code in (404, 405):
        return None
    return response.status_code == 200


# ----------------------------------------------------------------------------------------------
# the sweep

def _check_sweep(prompts, concurrencies, endpoints, max_new_tokens, timeout_s, warmup_requests) -> None:
    if not prompts or not all(isinstance(p, str) or (isinstance(p, list) and p) for p in prompts):
        raise ValueError("prompts: expected a non-empty list of texts or of token-id lists")
    if not concurrencies or not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in concurrencies):
        raise ValueError(f"concurrencies: expected positive integers, got {concurrencies!r}")
    unknown = [e for e in endpoints if e not in ENDPOINTS]
    if not endpoints or unknown:
        raise ValueError(f"endpoints: expected some of {tuple(ENDPOINTS)}, got {endpoints!r}")
    if "chat" in endpoints and not all(isinstance(p, str) for p in prompts):
        raise ValueError("endpoints: 'chat' needs text prompts")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected a positive integer, got {max_new_tokens!r}")
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
    if isinstance(warmup_requests, bool) or not isinstance(warmup_requests, int) or warmup_requests < 0:
        raise ValueError(f"warmup_requests: expected an integer >= 0, got {warmup_requests!r}")


async def sweep(url: str, prompts: list, *, concurrencies=(1, 2, 4, 8), endpoints=("generate",),
                max_new_tokens: int = 64, temperature: float = 0.0, ignore_eos: bool = True,
                budget_label: str | None = None, prompt_set: str = "heldout", warmup_requests: int = 1,
                flush: bool = True, timeout_s: float = 120.0, store=None, progress: bool = True) -> list[dict]:
    """Every prompt on every endpoint at every concurrency (an *arm* each); returns the rows.

    Before the first arm, `warmup_requests` unrecorded requests; before each arm, /flush_cache where
    offered (a flushed cache per arm: no arm reads another's prefixes). Each arm's rows are handed
    to `store` as one list when the arm has ended (default: append_rows to data/results/serving.csv,
    checked writable before the first request), never while a request is timed; if the sweep stops
    mid-arm, the rows of the requests that finished are stored before it stops. ignore_eos=True (the
    default) makes every request generate max_new_tokens tokens.
    """
    _check_sweep(prompts, concurrencies, endpoints, max_new_tokens, timeout_s, warmup_requests)
    from tqdm.auto import tqdm

    if store is None:
        check_writable(topics=(TOPIC,))
        store = partial(append_rows, TOPIC)
    url = url.rstrip("/")
    limits = httpx.Limits(max_connections=max(concurrencies), max_keepalive_connections=max(concurrencies))
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        info = await server_info(client, url, timeout_s)
        config = reported_config(info)
        fixed = {"run": uuid.uuid4().hex[:12], "server_url": url, "server_config": json.dumps(config, sort_keys=True),
                 "budget_label": budget_label or budget_label_of(info), "prompt_set": prompt_set,
                 "max_new_tokens": max_new_tokens, "temperature": temperature}
        request = dict(model=str(info.get("served_model_name") or info.get("model_path") or "default"),
                       max_new_tokens=max_new_tokens, temperature=temperature, ignore_eos=ignore_eos,
                       timeout_s=timeout_s)
        for prompt in prompts[:warmup_requests]:
            await measure(client, url, endpoints[0], prompt, **request)
        rows, unstored = [], []
        arms = [(endpoint, concurrency) for endpoint in endpoints for concurrency in concurrencies]
        try:
            # disabled only when asked: an explicit disable=False would override the headless TQDM_DISABLE (notebooks.py)
            with tqdm(total=len(arms) * len(prompts), unit="request", **({} if progress else {"disable": True})) as bar:
                for endpoint, concurrency in arms:
                    flushed = await flush_cache(client, url, timeout_s) if flush else None
                    slots = asyncio.Semaphore(concurrency)
                    arm_start = time.perf_counter()

                    async def one(index: int, prompt) -> None:
                        async with slots:
                            started = time.perf_counter() - arm_start
                            result = await measure(client, url, endpoint, prompt, **request)
                        row = {**fixed, "endpoint": endpoint, "concurrency": concurrency, "cache_flushed": flushed,
                               "prompt_index": index, "started_s": started,
                               "finished_s": started + result["latency_s"], **result}
                        rows.append(row)
                        unstored.append(row)
                        bar.update()

                    await asyncio.gather(*(one(index, prompt) for index, prompt in enumerate(prompts)))
                    _store(store, unstored)  # the arm has ended: no request is in flight
        finally:
            if unstored:  # stopped mid-arm: keep the requests that finished
                _store(store, unstored)
    return rows


def _store(store, pending: list[dict]) -> None:
    """Hand the pending rows to `store` once (emptied first, so a store that fails is not retried)."""
    batch = pending[:]
    pending.clear()
    store(batch)


def run_sweep(url: str, prompts: list, **settings) -> list[dict]:
    """`sweep` to its end from synchronous code; inside a running event loop (a notebook cell) it runs
    on its own loop in a worker thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(sweep(url, prompts, **settings))
    with ThreadPoolExecutor(1) as worker:
        return worker.submit(asyncio.run, sweep(url, prompts, **settings)).result()


# ----------------------------------------------------------------------------------------------
# reading rows

def arm_summaries(rows: list[dict]) -> list[dict]:
    """One line per arm (run, budget label, endpoint, concurrency): requests, failures, mean
    acceptance length, median tok/s per request, aggregate tok/s (all completion tokens over the arm's
    wall clock), median TTFT and TPOT. Rows may be parsed numbers or CSV text."""
    arms: dict[tuple, list[dict]] = {}
    for row in rows:
        key = (row["run"], row["budget_label"], row["endpoint"], int(float(row["concurrency"])))
        arms.setdefault(key, []).append(row)
    summaries = []
    for (run, label, endpoint, concurrency), arm in arms.items():
        good = [r for r in arm if str(r["ok"]) == "True"]
        span = (max(_number(r["finished_s"]) for r in arm) - min(_number(r["started_s"]) for r in arm)) if arm else 0
        summaries.append({
            "run": run, "budget_label": label, "endpoint": endpoint, "concurrency": concurrency,
            "requests": len(arm), "failed": len(arm) - len(good),
            "accept_length": _mean([_number(r.get("spec_accept_length")) for r in good]),
            "request_tokens_per_second": _median([_number(r.get("tokens_per_second")) for r in good]),
            "aggregate_tokens_per_second": (sum(_number(r.get("completion_tokens")) or 0 for r in good) / span
                                            if good and span > 0 else None),
            "ttft_s": _median([_number(r.get("ttft_s")) for r in good]),
            "tpot_s": _median([_number(r.get("tpot_s")) for r in good])})
    return summaries


def batching_verdict(rows: list[dict], *, budget_label, endpoint: str) -> dict | None:
    """Whether more requests in flight raised the aggregate tokens/s of one budget and endpoint, judged against the
    run's own noise: the relative spread (max - min over the median) of per-request tokens/s at the lowest
    concurrency, where requests run alone. "pays" only when the highest concurrency's aggregate beats the lowest's by
    more than that spread, "costs" when it falls short by more, else "within noise" (also with fewer than 2 requests
    to measure the spread). None without two measured concurrencies."""
    arms = sorted((s for s in arm_summaries(rows) if s["budget_label"] == budget_label and s["endpoint"] == endpoint
                   and s["aggregate_tokens_per_second"]), key=lambda s: s["concurrency"])
    if len(arms) < 2:
        return None
    low, high = arms[0], arms[-1]
    alone = [_number(r.get("tokens_per_second")) for r in rows if r["budget_label"] == budget_label
             and r["endpoint"] == endpoint and int(float(r["concurrency"])) == low["concurrency"]
             and str(r["ok"]) == "True" and _number(r.get("tokens_per_second"))]
    spread = (max(alone) - min(alone)) / _median(alone) if len(alone) >= 2 else None
    ratio = high["aggregate_tokens_per_second"] / low["aggregate_tokens_per_second"]
    verdict = ("within noise" if spread is None or abs(ratio - 1) <= spread else "pays" if ratio > 1 else "costs")
    return {"budget_label": budget_label, "endpoint": endpoint, "concurrencies": [low["concurrency"], high["concurrency"]],
            "aggregate_tokens_per_second": [low["aggregate_tokens_per_second"], high["aggregate_tokens_per_second"]],
            "ratio": ratio, "requests_alone": len(alone), "spread_alone": spread, "verdict": verdict}


def format_batching_verdict(v: dict) -> str:
    """One sentence for batching_verdict's result."""
    (low, high), (low_rate, high_rate) = v["concurrencies"], v["aggregate_tokens_per_second"]
    noise = (f"per-request tok/s alone spread {v['spread_alone']:.0%} over {v['requests_alone']} requests"
             if v["spread_alone"] is not None else f"{v['requests_alone']} request(s) alone: no spread to judge by")
    meaning = {"pays": "batching pays here", "costs": "batching costs here",
               "within noise": "no conclusion: the difference is within this run's noise"}[v["verdict"]]
    return (f"budget {v['budget_label']}, {v['endpoint']}: aggregate {low_rate:.1f} tok/s at concurrency {low}, "
            f"{high_rate:.1f} at {high} (x{v['ratio']:.2f}); {noise}: {meaning}")


SUMMARY_COLUMNS = (  # heading, width, summary key, scale, digits
    ("budget", 6, "budget_label", None, None), ("endpoint", 11, "endpoint", None, None),
    ("conc", 4, "concurrency", None, None), ("requests", 8, "requests", None, None), ("failed", 6, "failed", None, None),
    ("accept", 6, "accept_length", 1.0, 2), ("tok/s req", 9, "request_tokens_per_second", 1.0, 1),
    ("tok/s all", 9, "aggregate_tokens_per_second", 1.0, 1), ("TTFT ms", 8, "ttft_s", 1e3, 0),
    ("TPOT ms", 8, "tpot_s", 1e3, 1))


def format_value(value, scale: float = 1.0, digits: int = 2) -> str:
    """A measured number for a table or a sentence, "-" where it was not measured."""
    return "-" if value is None else f"{scale * value:.{digits}f}"


def summary_table(summaries: list[dict]) -> str:
    """arm_summaries as a fixed-width text table ("-" where a value was not measured)."""
    def cell(summary, key, scale, digits):
        return str(summary[key]) if scale is None else format_value(summary[key], scale, digits)
    lines = [" ".join(f"{heading:>{width}s}" for heading, width, *_ in SUMMARY_COLUMNS)]
    lines += [" ".join(f"{cell(s, key, scale, digits):>{width}s}" for _, width, key, scale, digits in SUMMARY_COLUMNS)
              for s in summaries]
    return "\n".join(lines)


def _number(value):
    return None if value in (None, "") else float(value)


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _median(values):
    values = [v for v in values if v is not None]
    return median(values) if values else None


@cli.command
def main(argv=None) -> int:
    parser = cli.ArgumentParser(prog="python -m kdtree_lib.serving.client", description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:30000")
    parser.add_argument("--prompts", type=Path, default=None, help="JSONL with a text or prompt field per line "
                                                                   "(default: the committed held-out prompts)")
    parser.add_argument("--count", type=cli.positive_int, default=16, help="prompts per arm")
    parser.add_argument("--max-chars", type=cli.positive_int, default=2000, help="characters kept of each prompt")
    parser.add_argument("--concurrency", type=cli.positive_int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--endpoints", nargs="+", choices=tuple(ENDPOINTS), default=["generate", "completions"])
    parser.add_argument("--max-new-tokens", type=cli.positive_int, default=256)
    parser.add_argument("--temperature", type=cli.nonnegative_float, default=0.0)
    parser.add_argument("--budget-label", default=None, help="default: read from the server's reported configuration")
    parser.add_argument("--warmup", type=cli.nonnegative_int, default=2, help="unrecorded requests before the first arm")
    parser.add_argument("--no-flush", action="store_true", help="do not call /flush_cache before each arm")
    parser.add_argument("--timeout", type=cli.positive_float, default=300.0, help="seconds per request")
    parser.add_argument("--results-dir", type=Path, default=None, help="default: data/results/")
    args = parser.parse_args(argv)
    try:
        check_writable(args.results_dir, topics=(TOPIC,))
        prompts = load_prompt_texts(args.prompts, count=args.count, max_chars=args.max_chars)
        rows = run_sweep(args.url, prompts, concurrencies=args.concurrency, endpoints=args.endpoints,
                         max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                         budget_label=args.budget_label, prompt_set=args.prompts.stem if args.prompts else "heldout",
                         warmup_requests=args.warmup, flush=not args.no_flush, timeout_s=args.timeout,
                         store=lambda batch: append_rows(TOPIC, batch, results_dir=args.results_dir))
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for line in arm_summaries(rows):
        print(json.dumps(line))
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
