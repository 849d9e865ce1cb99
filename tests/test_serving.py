"""The serving client against this engine's server in a subprocess on 127.0.0.1 (a tiny random pair with a
64-symbol tokenizer, so that drafts are accepted and text round-trips), and against stand-in servers that
fail or stall. Every request loop is bounded in count and time."""
import asyncio
import http.server
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from tokenizers import Tokenizer, decoders, models

from kdtree_lib import decode
from kdtree_lib.decode import generate
from kdtree_lib.pairs import pair_with_prompts, random_pair
from kdtree_lib.results import read_rows
from kdtree_lib.serving import client
from kdtree_lib.serving.engine import Engine, EngineSettings, RequestError
from kdtree_lib.serving.server import Service, running_server
from test_decode import HostReads, assert_equal_or_near_tie, dense_pair

ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ01234567 :\n?"  # 64 ids; the last is the mask
SHARPNESS, BUDGET, MAX_BATCH = 0.3, 32, 4
CONTEXT = 2048  # room for a request that cannot finish before its client has left (a few seconds of rounds)
PROMPTS = ["def load fn", "import numpy as np", "class Tree:", "for x in range 7:", "return a b c d e"]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    """A character-level tokenizer of 64 symbols (the random pair's vocabulary)."""
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(ALPHABET)}, merges=[]))
    tokenizer.decoder = decoders.Fuse()
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def server(tokenizer_path):
    with running_server("--random-pair", "--tokenizer", str(tokenizer_path.parent), "--draft-sharpness", str(SHARPNESS),
                        "--budget", str(BUDGET), "--max-batch", str(MAX_BATCH), "--context-length", str(CONTEXT),
                        "--threads", "1",
                        startup_timeout_s=600) as local:
        yield local


@pytest.fixture
def one_thread():
    """Tiny models run on one torch thread, as the server runs them (spinning threads crawl on a busy CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def states(url) -> dict:
    return httpx.get(url + "/get_server_info", timeout=5).json()["internal_states"][0]


def wait_idle(url, timeout_s=20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = states(url)
        if now["waiting"] == 0 and now["running"] == 0:
            return now
        time.sleep(0.05)
    raise AssertionError(f"the server did not go idle within {timeout_s} s: {now}")


def rss_bytes(pid) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# ----------------------------------------------------------------------------------------------
# against this engine's server

def test_sweep_rows_and_acceptance_equal_generate(server, tokenizer_path, tmp_path, one_thread):
    new_tokens = 6
    rows = client.run_sweep(server.url, PROMPTS[:4], concurrencies=(1, 4), max_new_tokens=new_tokens, timeout_s=30,
                            budget_label=None, progress=False,
                            store=lambda batch: client.append_rows(client.TOPIC, batch, results_dir=tmp_path))
    on_disk = read_rows(client.TOPIC, results_dir=tmp_path)
    assert len(rows) == len(on_disk) == 8
    assert all(row["ok"] for row in rows), [row.get("error") for row in rows]
    assert {row["date"] and row["commit"] and row["device"] for row in on_disk} != {""}
    assert sorted(int(r["concurrency"]) for r in on_disk) == [1] * 4 + [4] * 4
    assert {r["budget_label"] for r in on_disk} == {str(BUDGET)} and {r["server_url"] for r in on_disk} == {server.url}
    assert json.loads(on_disk[0]["server_config"])["ddtree_budget"] == BUDGET
    assert {r["cache_flushed"] for r in on_disk} == {"True"} and {r["endpoint"] for r in on_disk} == {"generate"}

    target, drafter = random_pair(vocab=len(ALPHABET), draft_sharpness=SHARPNESS)
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    expected = {}
    for index, text in enumerate(PROMPTS[:4]):
        alone = generate(target, drafter, [tokenizer.encode(text).ids], budget=BUDGET, max_new_tokens=new_tokens)
        expected[index] = (len(alone.tokens[0]), len(alone.acceptance[0]))
    for row in rows:
        tokens, rounds = expected[row["prompt_index"]]
        assert (row["completion_tokens"], row["spec_verify_ct"]) == (tokens, rounds), row
        assert row["spec_accept_length"] == pytest.approx(tokens / rounds)
    assert max(row["spec_accept_length"] for row in rows) > 1, "the drafts must be accepted for this to test anything"
    assert len({row["spec_accept_length"] for row in rows}) > 1, "per-request acceptance, not one batch mean"


def test_concurrent_requests_share_decode_batches_up_to_the_limit(server):
    async def burst():
        async with httpx.AsyncClient(timeout=30) as http:
            bodies = [{"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
                      for text in PROMPTS + PROMPTS[:1]]
            return await asyncio.gather(*(http.post(server.url + "/generate", json=body) for body in bodies))

    answers = [response.json() for response in asyncio.run(burst())]
    sizes = [answer["meta_info"]["batch_size"] for answer in answers]
    assert max(sizes) > 1 and max(sizes) <= MAX_BATCH, sizes
    assert answers[0]["output_ids"] == answers[-1]["output_ids"], "a prompt decodes the same in any batch"
    assert all(answer["text"] for answer in answers)


def test_streaming_endpoints_give_ttft_and_tpot(server, tmp_path):
    rows = client.run_sweep(server.url, PROMPTS[:2], concurrencies=(2,), endpoints=("completions", "chat"),
                            max_new_tokens=6, timeout_s=30, warmup_requests=0, progress=False,
                            store=lambda batch: client.append_rows(client.TOPIC, batch, results_dir=tmp_path))
    assert len(rows) == 4 and all(row["ok"] for row in rows), [row.get("error") for row in rows]
    for row in rows:
        assert row["completion_tokens"] == 6
        assert 0 < row["ttft_s"] < row["latency_s"] and row["tpot_s"] > 0, row
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    assert httpx.get(server.url + "/v1/models", timeout=5).json()["data"][0]["id"] == "random-pair"
    wrong_method = httpx.get(server.url + "/generate", timeout=5)
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


def test_bad_input_gets_a_4xx_with_a_message_and_the_server_keeps_serving(server):
    url = server.url
    cases = [("/generate", b"{not json", "malformed JSON"),
             ("/generate", json.dumps({"input_ids": [1] * (CONTEXT + 10)}).encode(), "max_prompt_tokens (2047"),
             ("/generate", json.dumps({"input_ids": [1] * 40, "sampling_params": {"max_new_tokens": CONTEXT - 39}}
                                      ).encode(), "context length (2048"),
             ("/generate", json.dumps({"text": "ab", "top_p": 0.5}).encode(), "unknown parameter(s) top_p"),
             ("/generate", json.dumps({"text": "ab", "sampling_params": {"top_k": 3}}).encode(),
              "unknown parameter(s) top_k"),
             ("/generate", json.dumps({"input_ids": [1, len(ALPHABET)]}).encode(), "token ids must lie in"),
             ("/v1/completions", json.dumps({"prompt": "ab", "max_tokens": 0}).encode(), "max_new_tokens"),
             ("/v1/chat/completions", json.dumps({"messages": "hi"}).encode(), "messages")]
    for path, body, message in cases:
        response = httpx.post(url + path, content=body, timeout=10)
        text = client._error_message(response)
        assert 400 <= response.status_code < 500 and message in text, (path, response.status_code, text)
    good = httpx.post(url + "/generate", json={"text": "ab", "sampling_params": {"max_new_tokens": 2}}, timeout=30)
    assert good.status_code == 200 and good.json()["meta_info"]["completion_tokens"] >= 1


def test_a_client_that_disconnects_mid_stream_is_cancelled(server):
    before = states(server.url)["cancelled"]
    body = {"prompt": "a", "max_tokens": CONTEXT - 2, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        first = next(line for line in response.iter_lines() if line.startswith("data:"))
        assert json.loads(first[len("data:"):])["choices"][0]["text"]
    after = wait_idle(server.url)
    assert after["cancelled"] == before + 1, after
    good = httpx.post(server.url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}},
                      timeout=30)
    assert good.status_code == 200


def test_under_load_every_request_is_answered_and_memory_returns(server, tmp_path):
    prompts = [[(7 * i + j) % 60 for j in range(3 + i % 5)] for i in range(64)]
    settings = dict(concurrencies=(16,), max_new_tokens=3, timeout_s=600, warmup_requests=0, progress=False,
                    store=lambda batch: client.append_rows(client.TOPIC, batch, results_dir=tmp_path))
    client.run_sweep(server.url, prompts[:16], **settings)  # the allocator's high-water mark for this load
    wait_idle(server.url)
    baseline = rss_bytes(server.process.pid)
    rows = client.run_sweep(server.url, prompts, **settings)
    assert len(rows) == 64
    assert all(row["ok"] or row["error"] for row in rows)
    assert sum(row["ok"] for row in rows) == 64, [row.get("error") for row in rows if not row["ok"]][:3]
    idle = wait_idle(server.url)
    assert idle["waiting"] == idle["running"] == 0
    growth = rss_bytes(server.process.pid) - baseline
    assert growth < 32 * 2**20, f"the server kept {growth / 2**20:.1f} MiB after the load"


def engine_answers(service: Service, batches, *, max_new_tokens: int, submitted=None) -> list[list[tuple]]:
    """Each batch of prompts submitted at once (up to max_batch of them one decode batch, the rest
    joining its rows as they free up), after the previous one was answered: per batch, per request
    (the final update's kind, the streamed ids, its value). `submitted` (a list) receives the Jobs."""
    engine = service.engine

    async def answers():
        scheduler = asyncio.create_task(engine.run())
        answered = []
        for prompts in batches:
            jobs = [service.job(p, max_new_tokens=max_new_tokens, temperature=0, ignore_eos=False, stop_token_ids=None)
                    for p in prompts]
            for job in jobs:
                engine.submit(job)
            if submitted is not None:
                submitted.extend(jobs)
            results = []
            for job in jobs:
                ids, (kind, value) = [], await asyncio.wait_for(job.updates.get(), 60)
                while kind == "tokens":
                    ids += value
                    kind, value = await asyncio.wait_for(job.updates.get(), 60)
                results.append((kind, ids, value))
            answered.append(results)
        engine.stop()
        scheduler.cancel()
        return answered

    return asyncio.run(answers())


@pytest.mark.parametrize("method", ["ar", "chain"])
def test_the_engine_decodes_as_generate_stop_tokens_included(method, one_thread):
    target, drafter = random_pair(vocab=len(ALPHABET), draft_sharpness=SHARPNESS)
    prompts = [[3, 4, 11, 60, 5, 13], [8, 12, 15, 14]]
    free = generate(target, drafter, prompts, method=method, budget=BUDGET, max_new_tokens=8)
    stop = int(free.tokens[0][3])  # a token the first request makes: it stops there
    expected = generate(target, drafter, prompts, method=method, budget=BUDGET, max_new_tokens=8, stop_tokens=(stop,))
    engine = Engine(target, drafter, EngineSettings(method=method, budget=BUDGET, max_batch=2))
    service = Service(engine, model_name="random", context_length=CONTEXT, stop_tokens=(stop,))
    [results] = engine_answers(service, [prompts], max_new_tokens=8)
    for (kind, ids, meta), tokens, rounds in zip(results, expected.tokens, expected.acceptance):
        assert kind == "done" and ids == tokens.tolist() and meta["completion_tokens"] == len(tokens), (ids, meta)
        if method == "ar":
            assert "spec_verify_ct" not in meta, "SGLang reports no spec fields without a speculative algorithm"
        else:
            assert meta["spec_verify_ct"] == len(rounds)
            assert meta["spec_draft_token_num"] == len(rounds) * min(BUDGET, drafter.config.draft_depth)
    assert results[0][2]["finish_reason"] == {"type": "stop", "matched": stop}
    assert max(meta["batch_size"] for _, _, meta in results) == 2


def test_a_full_queue_answers_503():
    target, drafter = random_pair()
    engine = Engine(target, drafter, EngineSettings(max_queue=1))
    service = Service(engine, model_name="random", context_length=64)
    settings = dict(max_new_tokens=2, temperature=0, ignore_eos=True, stop_token_ids=None)
    engine.submit(service.job([1, 2], **settings))
    with pytest.raises(RequestError, match="busy") as refused:
        engine.submit(service.job([3, 4], **settings))
    assert refused.value.status == 503 and engine.states()["waiting"] == 1


# ----------------------------------------------------------------------------------------------
# against servers that fail, stall or are not there

class FailingHandler(http.server.BaseHTTPRequestHandler):
    """/generate answers 500, chat answers something that is no event stream, completions stall until the
    test ends (past any client timeout, however slow the machine), GETs answer a page that is not JSON,
    nothing else exists."""
    released = threading.Event()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/generate":
            self._reply(500, {"error": {"message": "the worker crashed"}})
        elif self.path == "/v1/chat/completions":
            self._reply(200, ["not", "events"])
        elif self.path.startswith("/v1/"):
            self.released.wait()
            self._reply(200, {})
        else:
            self._reply(404, {"detail": "Not Found"})

    def do_GET(self):  # /get_server_info and the rest: a page that is not JSON
        self._reply(200, b"<html>not the server's info</html>")

    def _reply(self, status, body):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def failing_server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FailingHandler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    FailingHandler.released.clear()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    FailingHandler.released.set()
    httpd.shutdown()
    httpd.server_close()


def test_server_errors_and_timeouts_are_rows_and_the_sweep_ends(failing_server, tmp_path):
    """The completions stall for good: the sweep ending at all is what shows that a stalled server cannot
    stall it (no bound on how long it took; a busy machine may be slow). The client timeout is long enough
    for the immediate answers on a loaded machine."""
    timeout_s = 5.0
    rows = client.run_sweep(failing_server, ["ab", "cd"], concurrencies=(1, 2),
                            endpoints=("generate", "completions", "chat"), max_new_tokens=4, timeout_s=timeout_s,
                            warmup_requests=1, progress=False,
                            store=lambda batch: client.append_rows(client.TOPIC, batch, results_dir=tmp_path))
    assert len(rows) == len(read_rows(client.TOPIC, results_dir=tmp_path)) == 12
    generated, streamed, chatted = ([row for row in rows if row["endpoint"] == endpoint]
                                    for endpoint in ("generate", "completions", "chat"))
    assert all(not r["ok"] and "neither text nor usage" in r["error"] for r in chatted), chatted
    assert all(not r["ok"] and r["status"] == 500 and "worker crashed" in r["error"] for r in generated), \
        [(r["status"], r["error"]) for r in generated]
    assert all(not r["ok"] and r["status"] == "timeout" and r["latency_s"] >= timeout_s for r in streamed), \
        [(r["status"], r["error"], r["latency_s"]) for r in streamed]
    assert {row["cache_flushed"] for row in rows} == {None} and {row["budget_label"] for row in rows} == {"ar"}


def test_a_server_that_is_not_there_gives_transport_errors():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    rows = client.run_sweep(f"http://127.0.0.1:{port}", ["ab"], concurrencies=(1,), timeout_s=2, progress=False,
                            store=lambda batch: None)
    assert len(rows) == 1 and rows[0]["status"] == "transport" and "ConnectError" in rows[0]["error"]


def test_rows_measured_before_a_failure_are_on_disk(failing_server, tmp_path, monkeypatch):
    class Stopped(Exception):
        pass

    measured = client.measure
    calls = []

    async def stopping_at_the_fourth(*args, **kwargs):  # the sweep is stopped mid-arm, as a crash or an operator would
        calls.append(None)
        if len(calls) == 4:
            raise Stopped
        return await measured(*args, **kwargs)

    monkeypatch.setattr(client, "measure", stopping_at_the_fourth)
    with pytest.raises(Stopped):
        client.run_sweep(failing_server, ["ab"] * 6, concurrencies=(1,), max_new_tokens=2, timeout_s=30,
                         warmup_requests=0, progress=False,
                         store=lambda batch: client.append_rows(client.TOPIC, batch, results_dir=tmp_path))
    assert [r["prompt_index"] for r in read_rows(client.TOPIC, results_dir=tmp_path)] == ["0", "1", "2"]


def test_rows_are_written_between_arms_never_while_a_request_is_timed(failing_server, monkeypatch):
    """The order of events, not their times: every store comes after all the requests of an arm have
    ended and before the next arm's first starts, one store per arm."""
    events = []
    measured = client.measure

    async def bracketed(*args, **kwargs):
        events.append("start")
        try:
            return await measured(*args, **kwargs)
        finally:
            events.append("end")

    monkeypatch.setattr(client, "measure", bracketed)
    rows = client.run_sweep(failing_server, ["ab", "cd", "ef", "gh"], concurrencies=(1, 3), max_new_tokens=2,
                            timeout_s=30, warmup_requests=0, progress=False,
                            store=lambda batch: events.append(("store", len(batch))))
    in_flight, most, stores = 0, 0, []
    for at, event in enumerate(events):
        if event == "start":
            in_flight += 1
            most = max(most, in_flight)
        elif event == "end":
            in_flight -= 1
        else:
            assert in_flight == 0, f"rows written while {in_flight} requests were timed: {events}"
            stores.append((at, event[1]))
    assert most == 3, "the concurrent arm overlapped its requests (else this test shows nothing)"
    assert [(sum(e == "end" for e in events[:at]), size) for at, size in stores] == [(4, 4), (8, 4)], events
    assert len(rows) == 8


def test_the_command_line_checks_the_results_folder_before_any_request(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code = client.main(["--url", "http://127.0.0.1:9", "--results-dir", str(blocker / "rows"), "--count", "1"])
    error = capsys.readouterr().err
    assert code == 2 and error.startswith(f"error: results_dir: cannot write rows to {blocker}") \
        and error.count("\n") == 1


# ----------------------------------------------------------------------------------------------
# the client's pieces

def test_reported_config_and_budget_labels():
    sglang = {"model_path": "/models/kimi", "speculative_algorithm": "DFLASH", "speculative_num_draft_tokens": 9,
              "tp_size": 8, "mem_fraction_static": 0.85, "internal_states": [{}]}
    assert client.reported_config(sglang) == {"model_path": "/models/kimi", "speculative_algorithm": "DFLASH",
                                              "speculative_num_draft_tokens": 9, "tp_size": 8}
    assert client.budget_label_of(sglang) == "8"
    assert client.budget_label_of({"ddtree_budget": 32, "speculative_num_draft_tokens": 33}) == "32"
    assert client.budget_label_of({**sglang, "speculative_ddtree_budget": 16}) == "16"
    assert client.budget_label_of({}) == "ar"


def test_prompt_sets_and_sweep_arguments(tmp_path):
    committed = client.load_prompt_texts(count=2, max_chars=50)
    assert len(committed) == 2 and all(0 < len(text) <= 50 for text in committed)
    own = tmp_path / "mine.jsonl"
    own.write_text('{"prompt": "hello"}\n\n{"text": "world"}\n')
    assert client.load_prompt_texts(own, count=2, max_chars=3) == ["hel", "wor"]
    with pytest.raises(ValueError, match="count"):
        client.load_prompt_texts(own, count=3, max_chars=3)
    own.write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="path"):
        client.load_prompt_texts(own, count=1, max_chars=3)
    for bad, name in [(dict(concurrencies=(0,)), "concurrencies"), (dict(endpoints=("nope",)), "endpoints"),
                      (dict(max_new_tokens=0), "max_new_tokens"), (dict(timeout_s=0), "timeout_s"),
                      (dict(warmup_requests=-1), "warmup_requests")]:
        with pytest.raises(ValueError, match=name):
            client.run_sweep("http://127.0.0.1:9", ["ab"], progress=False, **bad)
    with pytest.raises(ValueError, match="chat"):
        client.run_sweep("http://127.0.0.1:9", [[1, 2]], endpoints=("chat",), progress=False)


def test_arm_summaries_read_csv_text():
    rows = [{"run": "r", "budget_label": "8", "endpoint": "generate", "concurrency": "2", "ok": "True",
             "started_s": str(s), "finished_s": str(s + 1), "completion_tokens": "10", "tokens_per_second": "10",
             "spec_accept_length": str(a), "ttft_s": "", "tpot_s": ""} for s, a in ((0, 2.0), (0.5, 3.0))]
    rows.append({**rows[0], "ok": "False", "completion_tokens": "", "tokens_per_second": "", "spec_accept_length": ""})
    (summary,) = client.arm_summaries(rows)
    assert summary["requests"] == 3 and summary["failed"] == 1 and summary["accept_length"] == 2.5
    assert summary["aggregate_tokens_per_second"] == pytest.approx(20 / 1.5) and summary["ttft_s"] is None


def test_summary_table_and_an_operators_endpoint():
    """The table has a line per arm with unmeasured values as "-"; an operator's URL is swept as given."""
    from kdtree_lib.serving.server import endpoint
    summary = {"budget_label": "8", "endpoint": "generate", "concurrency": 2, "requests": 3, "failed": 1,
               "accept_length": 2.5, "request_tokens_per_second": 10.0, "aggregate_tokens_per_second": None,
               "ttft_s": None, "tpot_s": 0.0125}
    header, line = client.summary_table([summary]).splitlines()
    assert header.split()[:2] == ["budget", "endpoint"]
    assert line.split() == ["8", "generate", "2", "3", "1", "2.50", "10.0", "-", "-", "12.5"]
    with endpoint("http://127.0.0.1:1") as url:
        assert url == "http://127.0.0.1:1"


def test_the_engine_keeps_one_decoder_per_shape_across_batches(monkeypatch, one_thread):
    """Two batches of one shape (batch size, step budget, rounded capacity) run on one Decoder, reset
    between them, and each request still decodes as generate decodes it alone at T = 0."""
    target, drafter = random_pair(vocab=len(ALPHABET), draft_sharpness=SHARPNESS)
    batches = [[[3, 4, 11, 60, 5, 13], [8, 12, 15, 14]], [[9, 2, 2, 40, 7], [1, 33, 20, 19, 6, 6, 5]]]
    expected = [generate(target, drafter, prompts, budget=BUDGET, max_new_tokens=8) for prompts in batches]
    built = []

    class CountedDecoder(decode.Decoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    decode.clear_decoders()  # generate's decoder for this shape would otherwise serve the engine
    monkeypatch.setattr(decode, "Decoder", CountedDecoder)
    engine = Engine(target, drafter, EngineSettings(method="ddtree", budget=BUDGET, max_batch=2))
    service = Service(engine, model_name="random", context_length=CONTEXT, stop_tokens=())
    answered = engine_answers(service, batches, max_new_tokens=8)
    # the second batch either starts anew (reset) or joins the first's rows as they free up (admit)
    assert engine.batches + engine.admitted // 2 == 2 and len(built) == 1, f"{len(built)} Decoders built for one shape"
    for results, reference in zip(answered, expected):
        for (kind, ids, meta), tokens, rounds in zip(results, reference.tokens, reference.acceptance):
            assert kind == "done" and ids == tokens.tolist() and meta["batch_size"] == 2, (kind, ids, meta)
            assert meta["spec_verify_ct"] == len(rounds)
    assert sum(len(ids) for results in answered for _, ids, _ in results) == 32
    decode.clear_decoders()


# ----------------------------------------------------------------------------------------------
# continuous batching: rows refilled between rounds, the Decoder kept

@pytest.fixture(scope="module")
def stand_in():
    """The trained stand-in pair in fp32 on the CPU (its drafts are accepted as a real pair's are)."""
    chosen = pair_with_prompts(8, prompts_per_package=3, prompt_tokens=24)
    if not chosen.stand_in:
        pytest.skip("the stand-in pair's checkpoints are not in data/models")
    return chosen


def test_requests_join_a_running_batch_and_decode_as_generate_alone(stand_in, monkeypatch, one_thread):
    """Five requests at once, two rows: two start the batch (reset), three join it as rows free up
    (Decoder.admit) while the other row decodes on; one Decoder, reset once, nothing rebuilt or
    reallocated (every buffer a prepared step or a graph reads keeps its address); every request's
    tokens and rounds equal generate's for its prompt alone, whatever row it got."""
    target, drafter, prompts = stand_in.target, stand_in.drafter, [p.tolist() for p in stand_in.prompts[:5]]
    built, resets, admits, addresses = [], [], [], []

    def buffers(d):
        tensors = [d.cache.lengths, *d.cache.kv, d.draft_cache.lengths, *d.draft_cache.keys, *d.draft_cache.values,
                   d.root, d.features, d.n_features, d.active, d.out, d.out_len, d.max_new, d.accepted, d.round,
                   d.read_len, d.posterior]
        return [t.data_ptr() for t in tensors]

    class CountedDecoder(decode.Decoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

        def reset(self, *args, **kwargs):
            resets.append(1)
            super().reset(*args, **kwargs)
            addresses.append(buffers(self))

        def admit(self, row, prompt, **kwargs):
            admits.append((row, bool(self.active.any())))  # another row decoding as it joins (a test's read)
            super().admit(row, prompt, **kwargs)
            addresses.append(buffers(self))

    decode.clear_decoders()
    monkeypatch.setattr(decode, "Decoder", CountedDecoder)
    engine = Engine(target, drafter, EngineSettings(method="ddtree", budget=8, max_batch=2))
    service = Service(engine, model_name="stand-in", context_length=4096, stop_tokens=())
    [results] = engine_answers(service, [prompts], max_new_tokens=16)
    assert len(built) == 1 and len(resets) == 1 and engine.batches == 1, "one Decoder, one reset, for five requests"
    assert engine.admitted == len(admits) == 3 and any(mid_flight for _, mid_flight in admits), admits
    assert len(addresses) == 4 and all(each == addresses[0] for each in addresses)
    for prompt, (kind, ids, meta) in zip(prompts, results):
        alone = generate(target, drafter, [prompt], budget=8, max_new_tokens=16)
        assert kind == "done" and ids == alone.tokens[0].tolist(), (kind, ids, meta)
        assert meta["spec_verify_ct"] == len(alone.acceptance[0]) and meta["batch_size"] == 2
    assert max(meta["spec_accept_length"] for _, _, meta in results) > 2, "the stand-in's drafts are accepted"
    decode.clear_decoders()


@pytest.mark.gpu
def test_gpu_engine_refills_rows_of_a_captured_step_and_decodes_as_generate():
    """On a GPU with the kernels: the engine's step is a CUDA graph, five requests go through two rows
    (three admitted into the graph's rows), and each request's tokens equal generate's for its prompt
    alone up to bf16 near ties (stand-in pair)."""
    chosen = pair_with_prompts(8, prompts_per_package=3, prompt_tokens=32, device="cuda", dtype=torch.bfloat16)
    if not chosen.stand_in:
        pytest.skip("the stand-in pair's checkpoints are not in data/models")
    target, drafter, prompts = chosen.target, chosen.drafter, [p.tolist() for p in chosen.prompts[:5]]
    decode.clear_decoders()
    # first, so that the kernels are compiled before the engine's updates are waited for
    alone = [generate(target, drafter, [p], budget=8, max_new_tokens=32).tokens[0].tolist() for p in prompts]
    engine = Engine(target, drafter, EngineSettings(method="ddtree", budget=8, max_batch=2))
    assert engine.cuda_graph and engine.backend == "cupy"
    service = Service(engine, model_name="stand-in", context_length=4096, stop_tokens=())
    [results] = engine_answers(service, [prompts], max_new_tokens=32)
    assert all(kind == "done" for kind, _, _ in results) and engine.admitted == 3
    assert_equal_or_near_tie(target, prompts, alone, [ids for _, ids, _ in results])
    decode.clear_decoders()


def test_a_cancelled_requests_row_is_refilled(monkeypatch, one_thread):
    """A client that leaves after its request's first round frees the row at once: the waiting request
    takes it (admitted mid-flight) and decodes as generate alone, as does the request beside it."""
    target, drafter = random_pair(vocab=len(ALPHABET), draft_sharpness=SHARPNESS)
    prompts = [[3, 4, 11, 60, 5, 13], [8, 12, 15, 14], [9, 2, 2, 40, 7]]
    jobs, rounds = [], decode.Decoder.rounds

    def rounds_then_leave(self, **kwargs):
        for count, update in enumerate(rounds(self, **kwargs)):
            if count == 0:
                jobs[0].cancelled = True  # as the server marks a request whose connection closed
            yield update

    monkeypatch.setattr(decode.Decoder, "rounds", rounds_then_leave)
    decode.clear_decoders()
    engine = Engine(target, drafter, EngineSettings(method="ddtree", budget=BUDGET, max_batch=2))
    service = Service(engine, model_name="random", context_length=CONTEXT, stop_tokens=())
    [results] = engine_answers(service, [prompts], max_new_tokens=16, submitted=jobs)
    assert results[0][0] == "cancelled" and engine.states()["cancelled"] == 1 and engine.admitted == 1
    for prompt, (kind, ids, meta) in zip(prompts[1:], results[1:]):
        alone = generate(target, drafter, [prompt], budget=BUDGET, max_new_tokens=16)
        assert kind == "done" and ids == alone.tokens[0].tolist() and meta["spec_verify_ct"] == len(alone.acceptance[0])
    decode.clear_decoders()


def test_an_engine_round_reads_the_host_once(monkeypatch, one_thread):
    """Per round the engine makes one read, Decoder.rounds' (_pack/_unpack); the rest of its round (posting
    tokens, stop checks, choosing requests to admit) works on that copy. Reset and admission (their
    prefills) lie outside the rounds; an AR target with dense layers reads nothing in its steps."""
    target, _ = dense_pair(vocab=len(ALPHABET))
    marks, spans, reads_seen = {}, [], []
    engine = Engine(target, None, EngineSettings(method="ar", max_batch=2))
    serve = engine._serve

    def counted_serve(rows, loop):
        with HostReads() as reads:
            marks["reads"] = reads
            serve(rows, loop)

    class Spans(decode.Decoder):
        def reset(self, *args, **kwargs):
            super().reset(*args, **kwargs)
            marks["after_reset"] = len(marks["reads"].calls)

        def admit(self, *args, **kwargs):
            start = len(marks["reads"].calls)
            super().admit(*args, **kwargs)
            spans.append((start, len(marks["reads"].calls)))

        def _unpack(self, *args, **kwargs):
            reads_seen.append(1)
            return super()._unpack(*args, **kwargs)

    decode.clear_decoders()
    monkeypatch.setattr(decode, "Decoder", Spans)
    monkeypatch.setattr(engine, "_serve", counted_serve)
    service = Service(engine, model_name="dense", context_length=CONTEXT, stop_tokens=())
    prompts = [[3, 4, 11, 60], [8, 12], [9, 2, 2, 40, 7]]
    [results] = engine_answers(service, [prompts], max_new_tokens=6)
    assert all(kind == "done" and len(ids) == 6 for kind, ids, _ in results) and engine.admitted == 1
    calls = marks["reads"].calls
    inside_admit = {i for start, end in spans for i in range(start, end)}
    in_rounds = [name for i, name in enumerate(calls) if i >= marks["after_reset"] and i not in inside_admit]
    assert in_rounds == ["tolist"] * len(reads_seen) and len(reads_seen) >= 6, (in_rounds, len(reads_seen))
    decode.clear_decoders()


# ----------------------------------------------------------------------------------------------
# the server against generate, measured (python -m kdtree_lib.bench.serving_vs_generate)

def test_serving_vs_generate_writes_a_stamped_row_per_step(tmp_path, one_thread):
    """On the CPU with the tiny random pair (no checkpoints in --models-dir): one row per distinct step
    (chain's budgets 8 and 32 are one step of the drafter's depth) and batch wait, stamped, tokens
    equal through both paths; the ratio is the engine's tokens/s over generate's."""
    from kdtree_lib.bench import serving_vs_generate
    code = serving_vs_generate.main(["--device", "cpu", "--models-dir", str(tmp_path / "none"), "--methods", "ar,chain",
                                     "--budgets", "8,32", "--new-tokens", "8", "--prompt-tokens", "6",
                                     "--prompts-per-package", "1", "--repeats", "2", "--batch-wait-ms", "5,0",
                                     "--results-dir", str(tmp_path)])
    rows = read_rows(serving_vs_generate.TOPIC, results_dir=tmp_path)
    assert code == 0 and [(row["method"], row["budget"], row["batch_wait_s"]) for row in rows] == [
        ("ar", "1", "0.005"), ("ar", "1", "0.0"), ("chain", "7", "0.005"), ("chain", "7", "0.0")]
    assert len({row["run"] for row in rows}) == 1  # appended one by one, one run
    for row in rows:
        assert row["date"] and row["commit"] and row["device"] and row["same_tokens"] == "True", row
        assert row["requests"] == "2" and row["concurrency"] == "1" and row["pair"].startswith("random")
        assert (row["engine_equal_requests"], row["engine_compared_requests"]) == ("4", "4")  # 2 prompts x 2 passes
        assert (row["generate_again_equal_requests"], row["generate_again_compared_requests"]) == ("2", "2")
        speeds = [float(row[key]) for key in ("generate_tokens_per_second", "engine_tokens_per_second", "ratio")]
        assert all(speed > 0 for speed in speeds) and speeds[2] == pytest.approx(speeds[1] / speeds[0])


@pytest.mark.parametrize("arguments, message", [
    (["--methods", "ddtree,beam"], "argument --methods: expected a comma-separated list of ar, chain, ddtree"),
    (["--budgets", "8,0"], "argument --budgets: expected an integer in 1.."),
    (["--device", "tpu"], "argument --device: invalid choice"),
    (["--batch-wait-ms", "5,-1"], "argument --batch-wait-ms: expected a finite number >= 0, got '-1'"),
])
def test_serving_vs_generate_refuses_a_bad_argument_in_one_line(arguments, message, tmp_path, capsys):
    from kdtree_lib.bench import serving_vs_generate
    code = serving_vs_generate.main([*arguments, "--results-dir", str(tmp_path)])
    error = capsys.readouterr().err
    assert code == 2 and message in error and error.count("\n") == 1, error
    assert not list(tmp_path.iterdir()), "nothing measured, nothing written"


def test_serving_vs_generate_says_where_two_token_lists_split():
    from kdtree_lib.bench.serving_vs_generate import agreement, first_difference
    assert first_difference([1, 2, 3], [1, 2, 3]) == -1
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2          # a shorter list differs at its end
    assert agreement("engine", [-1, 4, -1, 2]) == {"engine_equal_requests": 2, "engine_compared_requests": 4,
                                                   "engine_first_difference": 2}
    assert agreement("generate_again", [])["generate_again_first_difference"] == ""
