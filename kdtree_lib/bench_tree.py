"""Benchmarks of issue 3's kernels: the tree build three ways, the fused draft top-k, accept + compaction.

Rows go to data/results/tree_build.csv (column `stage`: "build" or "draft_topk") and
data/results/tree_accept.csv, one row per (configuration, method), stamped with date, commit and
device by results.append_rows. Times are per decode step, in microseconds:

- "serving_cpu" (build, baseline a): what the serving worker does today: copy the draft top-k to
  the host, run the Python heap per request, build each request's parents, tokens and boolean
  ancestor mask on the host and send them back to the GPU. Host wall time, synchronized.
- "numpy" (build, baseline b): the reference build_tree on host arrays. Host wall time.
- "kernel": GPU time of the launches alone (preallocated outputs), from a CUDA graph of 20 calls
  replayed and timed with CUDA events: what a graph-captured decode step pays. One row per kernel
  version (column `version`: build_tree_v1, build_tree_v2 in kernels/tree_build.cu).
- "kernel_call": the public entry point from Python (checks, allocation, launch), host wall time
  per call over back-to-back calls; `version` is the kernel it dispatched to.
- "torch" (draft_topk): torch.log_softmax + torch.topk, timed like "kernel".

Run on a GPU:  python -m kdtree_lib.bench_tree [--quick] [--only build] [--build-batches 64 --build-depths 15
               --build-budgets 8,64] [--results-dir DIR]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from . import results
from .tree_accept import _empty_accept_result, _launch_accept, _launch_compact, accept, compact_cache
from .contracts import DraftTopK
from .tree_build import (BUILD_VERSIONS, _best_first_pops, _build_version, _draft_topk_cupy, _empty_tree, _launch_build_tree, build_tree)

BUILD_BATCHES = (1, 8, 64, 256)
BUILD_DEPTHS = (7, 15)
BUILD_BUDGETS = (8, 16, 32, 64, 128, 256, 512, 1024)
TOPK_BATCHES = (1, 8, 64)
TOPK_KS = (64, 1024)
K26_VOCAB = 163_840
ACCEPT_BATCHES = (1, 64, 256)
ACCEPT_BUDGETS = (64, 256)
K26_LAYERS = 61
MLA_WIDTH = 576          # c_kv 512 + k_rope 64, bf16
COMMITTED_MAX = 1024     # committed tokens per request before the step (uniform in [0, this))
FOLLOW_PROBABILITY = 0.8  # the target agrees with the drafter's best child this often (mean accept ~5)


# ----------------------------------------------------------------------------------------------
# the serving worker's CPU build (baseline a)

def serving_worker_build(logp, ids, budget: int, root):
    """Baseline (a): host copy of the top-k, a Python heap per request, tree tensors back to the GPU.

    logp/ids/root are torch CUDA tensors; returns (tokens, parents, mask) on the GPU, with mask the
    boolean [B, N, N] ancestor matrix the worker hands to attention.
    """
    import torch
    device = logp.device
    logp_host, ids_host, root_host = logp.cpu().numpy(), ids.cpu().numpy(), root.cpu().numpy()
    batch, capacity = logp_host.shape[0], budget + 1
    tokens = np.zeros((batch, capacity), np.int64)
    parents = np.full((batch, capacity), -1, np.int64)
    mask = np.zeros((batch, capacity, capacity), bool)
    for b in range(batch):
        tokens[b, 0] = root_host[b]
        mask[b, 0, 0] = True
        for node, (parent, depth, rank, _) in enumerate(_best_first_pops(logp_host[b], budget), start=1):
            tokens[b, node] = ids_host[b, depth - 1, rank]
            parents[b, node] = parent
            mask[b, node] = mask[b, parent]
            mask[b, node, node] = True
    return (torch.from_numpy(tokens).to(device), torch.from_numpy(parents).to(device),
            torch.from_numpy(mask).to(device))


# ----------------------------------------------------------------------------------------------
# timing

def wall_us(fn, *, min_seconds: float = 0.1, max_reps: int = 20) -> float:
    """Median host wall time of fn() (which returns with its work finished). A first call slower
    than min_seconds is the only measurement; faster ones repeat for about min_seconds."""
    times = []
    started = time.perf_counter()
    while len(times) < max_reps:
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
        if time.perf_counter() - started >= min_seconds:
            break
    return statistics.median(times) * 1e6


def call_us(fn, *, reps: int = 50) -> float:
    """Host wall time per call of fn() over back-to-back calls, synchronized once at the end."""
    import torch
    fn()
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - begin) / reps * 1e6


def gpu_us(launch, *, repeats: int = 20, trials: int = 5) -> tuple[float, str]:
    """GPU time per call of launch(): a CUDA graph of `repeats` calls, replayed `trials` times and
    timed with CUDA events (median). Falls back to back-to-back stream launches if capture fails."""
    import torch
    launch()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(repeats):
                launch()
        replay, method = graph.replay, "cuda_graph"
    except Exception:  # capture is an optimisation of the measurement, never a reason to skip it
        torch.cuda.synchronize()
        replay, method = (lambda: [launch() for _ in range(repeats)]), "stream"
    replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(trials):
        start.record()
        replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / repeats)
    return statistics.median(samples), method


# ----------------------------------------------------------------------------------------------
# inputs

def random_draft(batch: int, depth: int, k: int, *, seed: int = 0):
    """A DraftTopK on the GPU (torch): top-k of log-softmax(5 N(0, 1)) over 4k + 4096 tokens (a
    mean top-1 probability near 0.5, so trees are about 5 deep at budget 64, like a real drafter's)."""
    import torch
    generator = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(batch, depth, 4 * k + 4096, device="cuda", generator=generator) * 5.0
    logp, ids = torch.topk(torch.log_softmax(logits, dim=-1), k, dim=-1)
    root = torch.randint(0, 1000, (batch,), device="cuda", dtype=torch.int32, generator=generator)
    return logp.contiguous(), ids.to(torch.int32).contiguous(), root


def follow_posterior(tree, rng, probability: float = FOLLOW_PROBABILITY) -> np.ndarray:
    """Posterior tokens [B, N] (host tree): the first child's token with `probability`, else a token
    no node carries, so acceptance lengths are geometric like a real drafter's."""
    first_child = tree.first_child
    rows = np.arange(tree.batch)[:, None]
    child_token = tree.tokens[rows, np.maximum(first_child, 0)]
    agree = (first_child >= 0) & (rng.random(first_child.shape) < probability)
    return np.where(agree, child_token, int(tree.tokens.max()) + 1).astype(np.int32)


# ----------------------------------------------------------------------------------------------
# benchmarks

def bench_build(batches=BUILD_BATCHES, depths=BUILD_DEPTHS, budgets=BUILD_BUDGETS, versions=BUILD_VERSIONS) -> list[dict]:
    """Tree build three ways at K = budget (the kernel in every version), plus the kernel's public
    call; one row per method and version."""
    import torch
    rows = []
    for depth in depths:
        for batch in batches:
            for budget in budgets:
                logp, ids, root = random_draft(batch, depth, budget, seed=batch * 1000 + budget)
                host = DraftTopK(logp.cpu().numpy(), ids.cpu().numpy())
                host_root = root.cpu().numpy()
                built = []
                reference = wall_us(lambda: built.append(build_tree(host, budget, root=host_root, backend="numpy")))
                want = built[-1]
                serving = wall_us(lambda: (serving_worker_build(logp, ids, budget, root), torch.cuda.synchronize()))
                call = call_us(lambda: build_tree(DraftTopK(logp, ids), budget, root=root, backend="cupy"))
                config = dict(stage="build", batch=batch, depth=depth, topk=budget, budget=budget,
                              mean_nodes=float(want.n_nodes.mean()))
                measured = [("serving_cpu", "", serving, "wall", ""), ("numpy", "", reference, "wall", "")]
                for version in versions:
                    out = _empty_tree(logp, batch, budget + 1, depth)
                    kernel, method = gpu_us(lambda: _launch_build_tree(logp, ids, budget, root, "tree", out,
                                                                       version=version))
                    matches = all(np.array_equal(getattr(out, name).cpu().numpy(), getattr(want, name))
                                  for name in ("parents", "tokens", "log_weights"))
                    measured.append(("kernel", version, kernel, method, matches))
                dispatched = _build_version(budget)
                measured.append(("kernel_call", dispatched, call, "wall",
                                 next(m for name, v, _, _, m in measured if name == "kernel" and v == dispatched)))
                for name, version, value, timing, matches in measured:
                    rows.append({**config, "method": name, "version": version,
                                 "backend": "cupy" if "kernel" in name else "numpy", "time_us": round(value, 3),
                                 "timing": timing, "speedup_vs_serving": round(serving / value, 2),
                                 "matches_reference": matches})
                kernels = "  ".join(f"v{v} {t:8.2f} us match={m}" for name, v, t, _, m in measured if name == "kernel")
                print(f"build D={depth:2d} B={batch:3d} budget={budget:4d}: serving {serving:10.1f} us  "
                      f"numpy {reference:10.1f} us  {kernels}  call {call:7.1f} us", flush=True)
    return rows


def bench_draft_topk(batches=TOPK_BATCHES, ks=TOPK_KS, depth: int = 15, vocab: int = K26_VOCAB) -> list[dict]:
    """Fused log-softmax + top-k over K2.6's vocabulary vs torch.log_softmax + torch.topk."""
    import torch
    rows = []
    for batch in batches:
        logits = torch.randn(batch, depth, vocab, device="cuda") * 3
        for k in ks:
            kernel, method = gpu_us(lambda: _draft_topk_cupy(logits, k))
            baseline, baseline_method = gpu_us(lambda: torch.topk(torch.log_softmax(logits, dim=-1), k, dim=-1))
            got = _draft_topk_cupy(logits, k)
            want_values, _ = torch.topk(torch.log_softmax(logits, dim=-1), k, dim=-1)
            error = float((got.logp - want_values).abs().max())
            gbytes = logits.numel() * 4 / 1e9
            config = dict(stage="draft_topk", batch=batch, depth=depth, vocab=vocab, topk=k,
                          logits_gb=round(gbytes, 4), max_abs_diff_vs_torch=error)
            for name, value, timing in (("kernel", kernel, method), ("torch", baseline, baseline_method)):
                rows.append({**config, "method": name, "backend": "cupy" if name == "kernel" else "torch",
                             "time_us": round(value, 3), "timing": timing,
                             "read_gb_per_s": round(gbytes / (value * 1e-6), 1)})
            print(f"draft_topk B={batch:3d} D={depth} V={vocab} k={k:4d}: kernel {kernel:9.1f} us  "
                  f"torch {baseline:9.1f} us  max|diff| {error:.2e}", flush=True)
    return rows


def bench_accept(batches=ACCEPT_BATCHES, budgets=ACCEPT_BUDGETS, depth: int = 15, layers: int = K26_LAYERS) -> list[dict]:
    """accept_kernel + compaction of `layers` MLA caches [B, L_max, 576] bf16, apart and together."""
    import torch
    rows = []
    rng = np.random.default_rng(0)
    for budget in budgets:
        for batch in batches:
            logp, ids, root = random_draft(batch, depth, budget, seed=budget + batch)
            tree = build_tree(DraftTopK(logp, ids), budget, root=root, backend="cupy")
            host_tree = build_tree(DraftTopK(logp.cpu().numpy(), ids.cpu().numpy()), budget,
                                   root=root.cpu().numpy(), backend="numpy")
            posterior_host = follow_posterior(host_tree, rng)
            posterior = torch.as_tensor(posterior_host, device="cuda")
            lengths_host = rng.integers(0, COMMITTED_MAX, size=batch).astype(np.int32)
            lengths = torch.as_tensor(lengths_host, device="cuda")
            slots = COMMITTED_MAX + budget + 1
            caches = [torch.empty(batch, slots, MLA_WIDTH, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
            out = _empty_accept_result(tree.tokens, batch, depth + 1)
            new_lengths = torch.empty_like(lengths)
            walk, walk_method = gpu_us(lambda: _launch_accept(tree, posterior, out))
            move, move_method = gpu_us(lambda: _launch_compact(caches, lengths, out, new_lengths))
            total, total_method = gpu_us(lambda: (_launch_accept(tree, posterior, out),
                                                  _launch_compact(caches, lengths, out, new_lengths)))
            call = call_us(lambda: compact_cache(caches, lengths, accept(tree, posterior)), reps=20)
            want = accept(host_tree, posterior_host, backend="numpy")
            matches = all(np.array_equal(getattr(out, name).cpu().numpy(), getattr(want, name))
                          for name in ("path", "n_accepted", "bonus"))
            moved_rows = int(sum(((want.path[b, 1:] >= 0) & (want.path[b, 1:] != np.arange(1, depth + 1))).sum()
                                 for b in range(batch)))
            moved_bytes = 2 * moved_rows * MLA_WIDTH * 2 * layers  # read + write
            config = dict(batch=batch, depth=depth, budget=budget, layers=layers, width=MLA_WIDTH,
                          mean_accepted=float(want.n_accepted.mean()), moved_bytes=moved_bytes,
                          matches_reference=matches)
            for name, value, timing in (("accept_kernel", walk, walk_method), ("compact_kernel", move, move_method),
                                        ("accept_compact_kernel", total, total_method),
                                        ("accept_compact_call", call, "wall")):
                rows.append({**config, "method": name, "backend": "cupy", "time_us": round(value, 3),
                             "timing": timing})
            print(f"accept B={batch:3d} budget={budget:4d} layers={layers}: accept {walk:6.2f} us  compact "
                  f"{move:7.2f} us  both {total:7.2f} us  call {call:7.1f} us  mean accepted "
                  f"{want.n_accepted.mean():.2f}  moved {moved_bytes / 1e6:.1f} MB  match={matches}", flush=True)
            caches = None  # frees the layers before the next configuration
            torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------
# reading the rows back (notebooks 04 and 06)

SERIES = {  # method -> (label, style) in the plots
    "serving_cpu": ("(a) serving worker: host copy + Python heap", "o-"),
    "numpy": ("(b) NumPy reference", "s-"),
    "kernel": ("(c) kernel {version} (CUDA graph)", "^-"),
    "kernel_call": ("(c) kernel via Python entry point", "^:"),
}


def latest_rows(topic: str, *, stage: str | None = None) -> list[dict]:
    """The newest measurement of every configuration in data/results/<topic>.csv (rows of the most
    recent commit of the newest device that measured it), numbers parsed."""
    rows = [r for r in results.read_rows(topic) if stage is None or r.get("stage") == stage]
    if not rows:
        return []
    newest = max(rows, key=lambda r: r["date"])
    kept = [r for r in rows if r["commit"] == newest["commit"] and r["device"] == newest["device"]]
    return [{key: results.parse_number(value) for key, value in row.items()} for row in kept]


def select(rows: list[dict], **where) -> list[dict]:
    return [r for r in rows if all(r.get(key) == value for key, value in where.items())]


def kernel_versions(rows: list[dict]) -> list:
    """The kernel versions measured in `rows`, oldest first ([None] for rows from before the column)."""
    return sorted({r.get("version") for r in select(rows, method="kernel")}, key=lambda v: (v is not None, v or 0))


def build_summary(rows: list[dict]) -> dict:
    """The issue's build targets read from the rows, for the newest kernel version: speed-up (a)/(c)
    and kernel time at B=64, budget 64; the growth of kernel time from budget 64 to 1024 against
    budget * log2(budget); and every version's time at the target point."""
    summary = {}
    newest = kernel_versions(rows)[-1]
    for depth in sorted({r["depth"] for r in rows}):
        kernel = {(r["batch"], r["budget"]): r["time_us"] for r in select(rows, method="kernel", depth=depth, version=newest)}
        serving = {(r["batch"], r["budget"]): r["time_us"] for r in select(rows, method="serving_cpu", depth=depth)}
        if (64, 64) in kernel:
            summary[f"D={depth} B=64 budget=64 kernel_us"] = kernel[64, 64]
            summary[f"D={depth} B=64 budget=64 speedup_a_over_c"] = round(serving[64, 64] / kernel[64, 64], 1)
            for version in kernel_versions(rows) if newest is not None else []:
                for r in select(rows, method="kernel", depth=depth, batch=64, budget=64, version=version):
                    summary[f"D={depth} B=64 budget=64 kernel v{version} us"] = r["time_us"]
        if (64, 64) in kernel and (64, 1024) in kernel:
            summary[f"D={depth} B=64 kernel growth 64->1024"] = round(kernel[64, 1024] / kernel[64, 64], 1)
            summary[f"D={depth} budget*log2(budget) growth 64->1024"] = round(1024 * 10 / (64 * 6), 1)
        summary[f"D={depth} all kernel rows match the reference"] = all(
            r["matches_reference"] for r in select(rows, method="kernel", depth=depth))
    return summary


def plot_build_times(ax, rows: list[dict], *, batch: int, depth: int) -> None:
    """Time per step vs budget (log-log) for the three builds (the kernel in every version), with a
    budget * log(budget) guide through the newest kernel's first point."""
    for method, (label, style) in SERIES.items():
        for version in (kernel_versions(rows) if method == "kernel" else [None]):
            where = dict(method=method, batch=batch, depth=depth, **({"version": version} if method == "kernel" else {}))
            points = sorted((r["budget"], r["time_us"]) for r in select(rows, **where))
            if points:
                ax.plot(*zip(*points), style, label=label.format(version=f"v{version}" if version else ""))
    kernel = sorted((r["budget"], r["time_us"]) for r in select(rows, method="kernel", batch=batch, depth=depth,
                                                                version=kernel_versions(rows)[-1]))
    if kernel:
        budgets = np.array([b for b, _ in kernel], float)
        guide = kernel[0][1] * budgets * np.log2(budgets) / (budgets[0] * np.log2(budgets[0]))
        ax.plot(budgets, guide, color="gray", lw=0.8, ls="--", label="∝ budget·log(budget)")
    ax.set(xscale="log", yscale="log", xlabel="budget (nodes)", ylabel="time per step (µs)",
           title=f"tree build, B={batch}, D={depth}")
    ax.set_xscale("log", base=2)
    ax.grid(True, which="both", alpha=0.3)


def plot_build_speedup(ax, rows: list[dict], *, depth: int, target: float = 1000.0) -> None:
    """(a)/(c): the serving worker's CPU build over the newest kernel, per batch size."""
    newest = kernel_versions(rows)[-1]
    for batch in sorted({r["batch"] for r in rows if r["depth"] == depth}):
        points = sorted((r["budget"], r["speedup_vs_serving"])
                        for r in select(rows, method="kernel", batch=batch, depth=depth, version=newest))
        ax.plot(*zip(*points), "o-", label=f"B={batch}")
    ax.axhline(target, color="gray", ls="--", lw=0.8, label=f"target {target:g}×")
    ax.set(yscale="log", xlabel="budget (nodes)", ylabel="speed-up (a)/(c)",
           title=f"kernel {f'v{newest} ' if newest else ''}vs serving worker, D={depth}")
    ax.set_xscale("log", base=2)
    ax.grid(True, which="both", alpha=0.3)


def plot_accept_times(ax, rows: list[dict], *, budget: int, target_us: float = 15.0) -> None:
    """Walk, compaction of every layer, and both (CUDA graph), vs batch size."""
    for method, label in (("accept_kernel", "accept (walk)"), ("compact_kernel", "compaction, all layers"),
                          ("accept_compact_kernel", "accept + compaction")):
        points = sorted((r["batch"], r["time_us"]) for r in select(rows, method=method, budget=budget))
        if points:
            ax.plot(*zip(*points), "o-", label=label)
    ax.axhline(target_us, color="gray", ls="--", lw=0.8, label=f"target {target_us:g} µs")
    ax.set(xscale="log", yscale="log", xlabel="batch B", ylabel="GPU time per step (µs)",
           title=f"tree accept + KV compaction, budget {budget}")
    ax.grid(True, which="both", alpha=0.3)


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def _join(values) -> str:
    return ",".join(str(v) for v in values)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few small configurations (a smoke test)")
    parser.add_argument("--results-dir", type=Path, default=None, help="default: data/results/")
    parser.add_argument("--only", default="build,topk,accept", help="comma-separated subset of build,topk,accept")
    for axis, default in (("batches", BUILD_BATCHES), ("depths", BUILD_DEPTHS), ("budgets", BUILD_BUDGETS)):
        parser.add_argument(f"--build-{axis}", type=_int_list, default=None,
                            help=f"comma-separated build {axis}, in the order measured (default: {_join(default)})")
    args = parser.parse_args(argv)
    parts = set(args.only.split(","))
    if args.quick:
        build = dict(batches=(1, 64), depths=(15,), budgets=(8, 64))
        topk = dict(batches=(1,), ks=(64,))
        accepting = dict(batches=(1, 64), budgets=(64,))
    else:
        build, topk, accepting = {}, {}, {}
    build.update({axis: getattr(args, f"build_{axis}") for axis in ("batches", "depths", "budgets")
                  if getattr(args, f"build_{axis}") is not None})
    if "build" in parts:  # rows appended per (depth, batch), so a run cut short keeps what it measured
        for depth in build.get("depths", BUILD_DEPTHS):
            for batch in build.get("batches", BUILD_BATCHES):
                rows = bench_build(**{**build, "depths": (depth,), "batches": (batch,)})
                results.append_rows("tree_build", rows, results_dir=args.results_dir)
    if "topk" in parts:
        results.append_rows("tree_build", bench_draft_topk(**topk), results_dir=args.results_dir)
    if "accept" in parts:
        results.append_rows("tree_accept", bench_accept(**accepting), results_dir=args.results_dir)


if __name__ == "__main__":
    main()
