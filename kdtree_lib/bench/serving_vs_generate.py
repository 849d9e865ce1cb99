"""The server's engine against generate at concurrency 1, on the same requests (issue 30: the server
within 10% of generate's tokens/s).

Every prompt is decoded twice, one request at a time, with the same method, budget and max_new_tokens
(greedy, no stop token, so both make exactly max_new_tokens tokens): by `decode.generate` (batch 1)
and by `serving.engine.Engine` in this process (its scheduler on an asyncio event loop, its worker
thread, the Jobs' update queues: the whole server but HTTP and the tokenizer). Both take their
Decoder from `decode.cached_decoder`, so at batch 1 they run the same one, graph-captured where the
step can be (backend "cupy"). One warm-up request through each path first (kernels compiled, the
graph captured). A request's seconds are end to end: generate's call (prefill and rounds), the
engine's submit to its "done" update on the event loop (queue wait and `batch_wait_s` included, as
a client sees them). tokens/s = the prompts' new tokens over their seconds, the median of `repeats`
passes (each pass runs generate then the engine on every prompt); ratio = engine / generate.
generate's own decode-only tokens/s (prefill excluded) rides along for reference.

One row per (method, budget) goes to data/results/serving_vs_generate.csv; `same_tokens` says that
every request's tokens were equal through both paths; engine_equal_requests / engine_compared_requests
and engine_first_difference say how many and where the first split fell, beside the same columns for
generate against its own first pass (generate_again_*: does the same computation repeat exactly?).

    python -m kdtree_lib.bench.serving_vs_generate --device cuda                       # ddtree, budget 8
    python -m kdtree_lib.bench.serving_vs_generate --device cuda --methods ar,chain,ddtree --budgets 8,32 \
        --batch-wait-ms 5,0            # the server's default wait for batch partners, and none
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .. import cli, results
from . import command_parser
from ..contracts import MAX_BUDGET
from ..decode import METHODS, device_clock, generate, step_shape
from ..pairs import pair_with_prompts
from ..serving.engine import Engine, EngineSettings, Job, Sampling

TOPIC = "serving_vs_generate"
TARGET_RATIO = 0.9   # issue 30: the engine's tokens/s at concurrency 1 within 10% of generate's
UPDATE_WAIT_S = 600  # a hang guard on each engine update, far above any request's honest time


def through_generate(target, drafter, prompt, *, method: str, budget: int, new_tokens: int):
    """(tokens, end-to-end seconds, decode-only seconds) of one request through generate."""
    start = device_clock(target.device)
    result = generate(target, drafter, [prompt], method=method, budget=budget, max_new_tokens=new_tokens)
    return result.tokens[0].tolist(), device_clock(target.device) - start, result.decode_seconds


def through_engine(engine: Engine, prompts, *, new_tokens: int) -> list[tuple[list[int], float]]:
    """(tokens, end-to-end seconds) per prompt, each submitted once the previous one was answered
    (concurrency 1), on a fresh event loop running the engine's scheduler."""
    async def requests():
        scheduler = asyncio.create_task(engine.run())
        answered = []
        try:
            for index, prompt in enumerate(prompts):
                job = Job(f"bench-{index}", np.asarray(prompt, np.int64), Sampling(new_tokens, 0.0, ()))
                start = time.perf_counter()
                engine.submit(job)
                tokens = []
                while True:
                    kind, value = await asyncio.wait_for(job.updates.get(), UPDATE_WAIT_S)
                    if kind == "tokens":
                        tokens += value
                    elif kind == "done":
                        break
                    else:
                        raise RuntimeError(f"request {index}: the engine answered {kind}: {value}")
                answered.append((tokens, time.perf_counter() - start))  # its last read synchronised the device
        finally:
            scheduler.cancel()
        return answered

    return asyncio.run(requests())


def first_difference(a: list[int], b: list[int]) -> int:
    """The first index where two token lists differ (a length difference counts at the shorter's end);
    -1 when they are equal."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return -1 if len(a) == len(b) else min(len(a), len(b))


def agreement(name: str, differences: list[int]) -> dict:
    """Columns saying how often `name`'s tokens equalled generate's (per request and pass) and where the
    earliest difference fell: in bf16 two runs of different shapes or kernels may round a near tie
    apart, and generate_again (generate's later passes against its first) is the baseline that says
    whether the same computation repeats exactly."""
    differing = [d for d in differences if d >= 0]
    return {f"{name}_equal_requests": len(differences) - len(differing), f"{name}_compared_requests": len(differences),
            f"{name}_first_difference": min(differing) if differing else ""}


def measure(target, drafter, prompts, *, method: str, budget: int, new_tokens: int, repeats: int,
            batch_wait_s: float, progress: bool = True) -> dict:
    """One (method, budget): the columns of its row (see the module docstring)."""
    engine = Engine(target, drafter if method != "ar" else None,
                    EngineSettings(method=method, budget=budget, batch_wait_s=batch_wait_s))
    options = dict(method=method, budget=budget, new_tokens=new_tokens)
    try:
        through_generate(target, drafter, prompts[0], **options)  # warm-up: compilation, the graph's capture
        through_engine(engine, prompts[:1], new_tokens=new_tokens)
        generate_rates, decode_rates, engine_rates = [], [], []
        first_pass = None  # generate's tokens in the first pass: its own repeatability is the baseline
        compared = {"engine": [], "generate_again": []}  # per request and pass: the first differing index, or -1
        for _ in tqdm(range(repeats), desc=f"{method} budget {budget}", disable=not progress):
            alone = [through_generate(target, drafter, prompt, **options) for prompt in prompts]
            served = through_engine(engine, prompts, new_tokens=new_tokens)
            count = sum(len(tokens) for tokens, _, _ in alone)
            generate_rates.append(count / sum(seconds for _, seconds, _ in alone))
            decode_rates.append(count / sum(seconds for _, _, seconds in alone))
            engine_rates.append(sum(len(tokens) for tokens, _ in served) / sum(seconds for _, seconds in served))
            if first_pass is None:
                first_pass = [tokens for tokens, _, _ in alone]
            else:
                compared["generate_again"] += [first_difference(a, tokens) for a, (tokens, _, _) in zip(first_pass, alone)]
            compared["engine"] += [first_difference(tokens, served_tokens)
                                   for (tokens, _, _), (served_tokens, _) in zip(alone, served)]
    finally:
        engine.stop()
    generate_rate, engine_rate = statistics.median(generate_rates), statistics.median(engine_rates)
    return {"method": method, "budget": engine.step_budget, "cuda_graph": engine.cuda_graph, "backend": engine.backend,
            "concurrency": 1, "requests": len(prompts), "new_tokens": new_tokens, "repeats": repeats,
            "batch_wait_s": batch_wait_s, "generate_tokens_per_second": generate_rate,
            "engine_tokens_per_second": engine_rate, "ratio": engine_rate / generate_rate,
            "target_ratio": TARGET_RATIO, "meets_target": engine_rate / generate_rate >= TARGET_RATIO,
            "generate_decode_tokens_per_second": statistics.median(decode_rates),
            "same_tokens": all(d < 0 for d in compared["engine"]), **agreement("engine", compared["engine"]),
            **agreement("generate_again", compared["generate_again"]),
            "engine_accept_length": engine.tokens_served / engine.rounds_served if engine.rounds_served else ""}


def run(*, methods=("ddtree",), budgets=(8,), device: str = "cuda", new_tokens: int = 128, prompt_tokens: int = 128,
        prompts_per_package: int = 4, repeats: int = 3, block_size: int = 8, batch_waits_s=None,
        models_dir=None, results_dir=None, progress: bool = True, log=print) -> list[dict]:
    """Every (method, budget, batch wait) of the grid (AR once, whatever the budgets; batch_waits_s None:
    the server's default wait); appends the rows and returns them."""
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    chosen = pair_with_prompts(block_size, prompts_per_package=prompts_per_package, prompt_tokens=prompt_tokens,
                               models_dir=models_dir, device=device, dtype=dtype)
    log(f"pair: {chosen.description}")
    waits = [EngineSettings().batch_wait_s] if batch_waits_s is None else list(batch_waits_s)
    depth = chosen.drafter.config.draft_depth
    # one row per distinct step: AR has no budget, the chain drafts at most the drafter's depth
    grid = list(dict.fromkeys((method, step_shape(method, budget, depth)[0]) for method in methods for budget in budgets))
    rows, run_id = [], results.new_run_id()  # one run: its rows are appended one by one
    for (method, budget), wait in ((step, wait) for step in grid for wait in waits):
        row = measure(chosen.target, chosen.drafter, chosen.prompts, method=method, budget=budget,
                      new_tokens=new_tokens, repeats=repeats, batch_wait_s=wait, progress=progress)
        row = {**row, "run": run_id, "pair": chosen.name, "dtype": str(dtype).removeprefix("torch."),
               "prompt_tokens": prompt_tokens, "block_size": block_size}
        results.append_rows(TOPIC, [row], results_dir=results_dir)  # each as it is measured: a cut run keeps it
        rows.append(row)
        log(f"{method} budget {row['budget']}, batch wait {1e3 * wait:g} ms: generate {row['generate_tokens_per_second']:.1f} tok/s, engine "
            f"{row['engine_tokens_per_second']:.1f} tok/s, ratio {row['ratio']:.3f} (target >= {TARGET_RATIO}); requests "
            f"equal to generate's: {row['engine_equal_requests']} of {row['engine_compared_requests']}, generate's own "
            f"repeats: {row['generate_again_equal_requests']} of {row['generate_again_compared_requests']}")
    return rows


def _choices(kind, allowed=None):
    """An argparse type: a comma-separated list of `kind` (cli's number types, or choices)."""
    def parse(text: str) -> list:
        items = [item.strip() for item in text.split(",")]
        if allowed is not None:
            bad = [item for item in items if item not in allowed]
            if bad:
                raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(allowed)}, "
                                                     f"got {text!r}")
            return items
        return [kind(item) for item in items]
    return parse


@cli.command
def main(argv=None) -> int:
    parser = command_parser(__spec__.name, __doc__)
    parser.add_argument("--methods", type=_choices(str, METHODS), default=["ddtree"],
                        help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--budgets", type=_choices(cli.integer_in(1, MAX_BUDGET)), default=[8],
                        help=f"comma-separated draft budgets, at most {MAX_BUDGET} (chain: at most the drafter's depth; AR: none)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--new-tokens", type=cli.positive_int, default=128)
    parser.add_argument("--prompt-tokens", type=cli.positive_int, default=128)
    parser.add_argument("--prompts-per-package", type=cli.positive_int, default=4,
                        help="held-out prompts of each package (the requests)")
    parser.add_argument("--repeats", type=cli.positive_int, default=3)
    parser.add_argument("--block-size", type=int, choices=(8, 16), default=8)
    parser.add_argument("--batch-wait-ms", type=_choices(cli.nonnegative_float), default=None,
                        help="comma-separated waits of the engine's scheduler for requests to share a batch, a row "
                             "each (default: the server's)")
    parser.add_argument("--models-dir", type=Path, default=None,
                        help="where the stand-in pair's folders are (default data/models; without them: a tiny "
                             "random pair)")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        cli.require_cuda(kernels=True)
    results.check_writable(args.results_dir, topics=(TOPIC,))
    run(methods=args.methods, budgets=args.budgets, device=args.device, new_tokens=args.new_tokens,
        prompt_tokens=args.prompt_tokens, prompts_per_package=args.prompts_per_package, repeats=args.repeats,
        block_size=args.block_size,
        batch_waits_s=None if args.batch_wait_ms is None else [ms / 1e3 for ms in args.batch_wait_ms],
        models_dir=args.models_dir, results_dir=args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
