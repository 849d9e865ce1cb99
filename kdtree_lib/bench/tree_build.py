"""Benchmark of the tree stage's first half: the drafter's top-k from logits, then the tree build.

Rows go to data/results/tree_build.csv (column `stage`), one per (configuration, method), stamped with
date, commit and device by results.append_rows. Times are per decode step, in microseconds.

stage "build" (K = budget, peaked drafts from bench.inputs):
- "serving_cpu": what the serving worker does today: copy the draft top-k to the host, run the Python
  heap per request, build each request's parents, tokens and boolean ancestor mask on the host and
  send them back to the GPU. Host wall time, synchronised.
- "numpy": the reference build_tree on host arrays. Host wall time.
- "kernel": GPU time of the prepared launch alone, from a CUDA graph of 20 calls (timing.graph_seconds):
  what a graph-captured decode step pays. `version`: the kernel's (build_tree_v2).
- "kernel_call": the eager entry point build_tree (checks, allocation, launch), host time per call.
- "prepared_call": a prepared launch's call (validated once), host time per call.

stage "draft_topk" (K2.6's vocabulary, normal logits):
- "kernel" / "torch": the fused kernels (prepare_draft_topk backend "cupy") and the exact path
  (torch's topk - logsumexp, what "auto" runs on a GPU), each in a CUDA graph; "kernel_flushed" /
  "torch_flushed": one call after an L2 flush (timing.gpu_seconds), the cold-read time the roofline
  compares with;
- "prepared_call" / "eager_call": host time per call of the fused prepared launch and of the eager
  draft_topk (the exact path);
- `roofline_us`: the logits' bytes over the measured copy bandwidth (bench.ceilings; reading once);
- `max_abs_diff_vs_torch`: the fused log-probabilities against the exact path's; `ids_equal_torch`:
  the same ids (ties aside, the selection is the same); `chunks`: the fused v3 kernel's 4096-logit
  chunks per slice (draft_topk.slice_chunks' choice);
- "kernel_slicing" (D=7, k <= 64, fused v3 only): the same kernel in a CUDA graph at each slicing
  (`chunks` 1 to 4, CTAs per row = V / (4096 chunks)), what slice_chunks' choice is checked against.

Every row names the top-k path that produced it in `topk_path`: "exact" (torch's ops), "fused_v1" /
"fused_v3" (draft_topk.TopKLaunch.path, with `version`), "sglang" (SGLang's own torch top-k), or
"none" (the build stage's rows start from random drafts: no top-k ran). Rows before this column
existed are read by `topk_path_of`.

stage "tree_stage" (the same K2.6-vocabulary logits on the device to tree tensors there, eager, each call
synchronised): "sglang" is SGLang's build_ddtree_tree + build_eagle_tree_format from a local copy of its
source (--sglang-utils, never committed), "dropin" the same two calls of kdtree_lib.integrations.sglang
(`matches_sglang`: its outputs equal SGLang's), "kdtree" the project's own stage, draft_topk then
build_tree; "kdtree_graph" its prepared launches (exact top-k, build) replayed in a CUDA graph,
"kdtree_graph_fused" the same with the fused top-k; and the drop-in's parts: "dropin_topk" (its top-k on
the device: the prepared build's own, the fused kernel or torch's exact formula), "dropin_kernel" (its
build kernel, in a CUDA graph), "dropin_call" (the host time per eager call of its two calls: what the
worker's Python pays, launches enqueued, not waited for), "dropin_graph" (its two calls captured by the
benchmark in a CUDA graph); "dropin_graphed" (wall, synchronised) and "dropin_graphed_call" (host time per
call) the same two calls with KDTREE_SGLANG_GRAPH=1, the drop-in replaying its own graph (logits copied in,
outputs copied out); on a CPU "dropin_host_build" (the host build). The drop-in's rows carry the top-k path
its prepared build ran (`topk_path`: fused_v3, or exact with KDTREE_SGLANG_TOPK=exact, above width 128, or
on a CPU) and how it ran its calls (`dropin_path`: eager, or graph for the dropin_graphed rows; empty on
the other methods' rows). Each path is called once before it is timed (compilation, prepared shapes, the
graph's capture).

    python -m kdtree_lib.bench.tree_build [--quick] [--only build,topk,stage] [--sglang-utils PATH]
                                          [--results-dir DIR]
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np

from .. import cli, results
from . import command_parser
from ..contracts import DraftTopK
from ..draft_topk import MAX_CHUNKS, TopKLaunch, draft_topk, prepare_draft_topk
from ..tree_build import BUILD_KERNEL, TREE_OUTPUTS, best_first_pops, build_tree, prepare_build_launch
from .ceilings import copy_bandwidth
from .inputs import random_draft
from .timing import gpu_seconds, graph_seconds, host_seconds, wall_seconds

BATCHES = (1, 8, 64)
DEPTHS = (7, 15)
BUDGETS = (8, 16, 32, 64, 128)
TOPK_KS = (8, 64, 1024)
K26_VOCAB = 163_840
FIELDS = ("parents", "tokens", "log_weights")
# the top-k each tree_stage method runs: draft_topk's default on a GPU, the drop-in's torch top-k and
# the exact prepared launch are torch's ops; SGLang's path its own; "kdtree_graph_fused" the fused kernels
STAGE_TOPK_PATHS = {"sglang": "sglang", "dropin_copy": "none", "dropin_host_build": "none", "dropin_kernel": "none",
                    "kdtree_graph_fused": "fused_v3"}
# the tree_stage methods that run the drop-in's own top-k: labelled by the path its prepared build ran
# (fused_v3, or exact: KDTREE_SGLANG_TOPK=exact, a width above 128, or the host path on a CPU)
DROPIN_TOPK_METHODS = ("dropin", "dropin_topk", "dropin_call", "dropin_graph", "dropin_graphed", "dropin_graphed_call")
# how the drop-in's rows ran its calls (`dropin_path`): eagerly (its launches, each call) or replaying its own
# CUDA graph (KDTREE_SGLANG_GRAPH=1: the logits copied into the graph's buffer, one replay, the outputs copied out;
# "eager" on a dropin_graphed row whose logits exceed the graph's bound, integrations.sglang.GRAPH_LOGITS_BYTES)
DROPIN_PATHS = {"dropin": "eager", "dropin_topk": "eager", "dropin_kernel": "eager", "dropin_call": "eager",
                "dropin_graph": "eager", "dropin_host_build": "eager", "dropin_graphed": "graph",
                "dropin_graphed_call": "graph"}


def _same_stage_outputs(ours, theirs) -> bool:
    """Two answers of (build_ddtree_tree, build_eagle_tree_format) equal element for element (child maps
    as lists)."""
    import torch
    (tree, eagle), (other_tree, other_eagle) = ours, theirs
    return all(list(a) == list(b) if index == 3 else bool(torch.equal(a, b))
               for index, (a, b) in enumerate(zip(tree, other_tree))) and all(
        bool(torch.equal(a, b)) for a, b in zip(eagle, other_eagle))


@contextlib.contextmanager
def _environment(name: str, value: str):
    """os.environ[name] = value for the block (the previous value, or none, restored)."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def serving_worker_build(logp, ids, budget: int, root):
    """Baseline: host copy of the top-k, a Python heap per request, tree tensors back to the GPU.

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
        for node, (parent, depth, rank, _) in enumerate(best_first_pops(logp_host[b], budget), start=1):
            tokens[b, node] = ids_host[b, depth - 1, rank]
            parents[b, node] = parent
            mask[b, node] = mask[b, parent]
            mask[b, node, node] = True
    return (torch.from_numpy(tokens).to(device), torch.from_numpy(parents).to(device),
            torch.from_numpy(mask).to(device))


def bench_build(batches=BATCHES, depths=DEPTHS, budgets=BUDGETS) -> list[dict]:
    """The build three ways at K = budget, plus the entry point's and a prepared launch's host cost."""
    import torch
    rows = []
    for depth in depths:
        for batch in batches:
            for budget in budgets:
                draft, root = random_draft(batch, depth, budget, seed=batch * 1000 + budget, device="cuda")
                host_draft = DraftTopK(draft.logp.cpu().numpy(), draft.ids.cpu().numpy())
                host_root = root.cpu().numpy()
                want = build_tree(host_draft, budget, root=host_root, backend="numpy")
                reference = wall_seconds(lambda: build_tree(host_draft, budget, root=host_root, backend="numpy"))
                serving = wall_seconds(lambda: (serving_worker_build(draft.logp, draft.ids, budget, root),
                                                torch.cuda.synchronize()))
                launch = prepare_build_launch(draft, budget, root=root)
                kernel, method = graph_seconds(launch)
                torch.cuda.synchronize()
                matches = all(np.array_equal(getattr(launch.out, name).cpu().numpy(), getattr(want, name))
                              for name in FIELDS)
                call = host_seconds(lambda: build_tree(draft, budget, root=root, backend="cupy"))
                prepared = host_seconds(launch)
                config = dict(stage="build", batch=batch, depth=depth, topk=budget, budget=budget,
                              mean_nodes=float(want.n_nodes.mean()))
                measured = (("serving_cpu", "numpy", serving, "wall"), ("numpy", "numpy", reference, "wall"),
                            ("kernel", "cupy", kernel, method), ("kernel_call", "cupy", call, "host"),
                            ("prepared_call", "cupy", prepared, "host"))
                for name, backend, seconds, timing in measured:
                    rows.append({**config, "method": name, "version": 2 if backend == "cupy" else "", "topk_path": "none",
                                 "backend": backend, "time_us": round(seconds * 1e6, 3), "timing": timing,
                                 "speedup_vs_serving": round(serving / seconds, 2),
                                 "matches_reference": matches if backend == "cupy" else ""})
                print(f"build D={depth:2d} B={batch:3d} budget={budget:4d}: serving {serving * 1e6:10.1f} us  "
                      f"numpy {reference * 1e6:10.1f} us  {BUILD_KERNEL} {kernel * 1e6:7.2f} us match={matches}  "
                      f"call {call * 1e6:6.1f} us  prepared {prepared * 1e6:5.1f} us", flush=True)
    return rows


def bench_draft_topk(batches=BATCHES, depths=DEPTHS, ks=TOPK_KS, vocab: int = K26_VOCAB) -> list[dict]:
    """The fused top-k + log-softmax against the exact torch path and the one-read roofline."""
    import torch
    bandwidth = copy_bandwidth()
    rows = []
    for depth in depths:
        for batch in batches:
            generator = torch.Generator(device="cuda").manual_seed(batch * 100 + depth)
            logits = torch.randn(batch, depth, vocab, device="cuda", generator=generator) * 3
            n_bytes = logits.numel() * 4
            roofline = n_bytes / bandwidth
            for k in ks:
                launch = prepare_draft_topk(logits, k, backend="cupy")
                exact = draft_topk(logits, k, backend="torch")
                launch()
                error = float((launch.out.logp - exact.logp).abs().max())
                ids_equal = bool(torch.equal(launch.out.ids, exact.ids))
                timings = {"kernel": graph_seconds(launch), "torch": graph_seconds(lambda: draft_topk(logits, k)),
                           "kernel_flushed": (gpu_seconds(launch), "l2_flushed"),
                           "torch_flushed": (gpu_seconds(lambda: draft_topk(logits, k)), "l2_flushed"),
                           "prepared_call": (host_seconds(launch), "host"),
                           "eager_call": (host_seconds(lambda: draft_topk(logits, k)), "host")}
                launch.check_input()
                config = dict(stage="draft_topk", batch=batch, depth=depth, vocab=vocab, topk=k,
                              logits_gb=round(n_bytes / 1e9, 4), max_abs_diff_vs_torch=error, ids_equal_torch=ids_equal,
                              copy_gb_per_s=round(bandwidth / 1e9, 1), roofline_us=round(roofline * 1e6, 3))
                for name, (seconds, timing) in timings.items():
                    exact_path = "torch" in name or name == "eager_call"
                    rows.append({**config, "method": name, "backend": "torch" if exact_path else "cupy",
                                 "topk_path": "exact" if exact_path else launch.path,
                                 "version": "" if exact_path else launch.version,
                                 "chunks": "" if exact_path or launch.path != "fused_v3" else launch.chunks,
                                 "time_us": round(seconds * 1e6, 3), "timing": timing,
                                 "read_gb_per_s": round(n_bytes / seconds / 1e9, 1)})
                if depth == 7 and k <= 64 and launch.path == "fused_v3":
                    slicing = []
                    for chunks in range(1, MAX_CHUNKS + 1):
                        sliced = TopKLaunch(logits, k, launch.out, chunks=chunks)
                        seconds, timing = graph_seconds(sliced)
                        slicing.append(f"{chunks}: {seconds * 1e6:.1f}")
                        rows.append({**config, "method": "kernel_slicing", "backend": "cupy", "topk_path": sliced.path,
                                     "version": sliced.version, "chunks": chunks, "time_us": round(seconds * 1e6, 3),
                                     "timing": timing, "read_gb_per_s": round(n_bytes / seconds / 1e9, 1)})
                    print(f"  slicing (chunks per slice: us) {', '.join(slicing)}; chosen {launch.chunks}", flush=True)
                print(f"draft_topk B={batch:3d} D={depth:2d} k={k:4d}: {launch.path} {timings['kernel'][0] * 1e6:8.1f} us "
                      f"(flushed {timings['kernel_flushed'][0] * 1e6:8.1f}, roofline {roofline * 1e6:7.1f})  torch "
                      f"{timings['torch'][0] * 1e6:8.1f} us  host: prepared {timings['prepared_call'][0] * 1e6:5.1f} "
                      f"eager {timings['eager_call'][0] * 1e6:5.1f} us  max|diff| {error:.1e} ids equal {ids_equal}",
                      flush=True)
    return rows


def bench_tree_stage(sglang_utils=None, batches=BATCHES, depths=DEPTHS, budgets=BUDGETS, vocab: int = K26_VOCAB,
                     device: str = "cuda") -> list[dict]:
    """The tree stage from draft logits [B, D, V] to tree tensors, SGLang's way, the drop-in's and kdtree's."""
    import torch
    from ..integrations import sglang as dropin
    finish = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for depth in depths:
        for batch in batches:
            generator = torch.Generator(device=device).manual_seed(batch * 100 + depth)
            logits = torch.randn(batch, depth, vocab, device=device, generator=generator) * 3
            for budget in budgets:
                def sglang_path(module):
                    tree = module.build_ddtree_tree(logits, budget, logits.device)
                    return tree, module.build_eagle_tree_format(tree[2], tree[5], budget + 1, logits.device)

                paths = {"dropin": lambda: sglang_path(dropin),
                         "kdtree": lambda: build_tree(draft_topk(logits, budget), budget)}
                if sglang_utils is not None:
                    paths["sglang"] = lambda: sglang_path(sglang_utils)
                for path in paths.values():  # first calls compile and prepare: not what a step pays
                    path()
                finish()
                timings = {name: (wall_seconds(lambda: (path(), finish())), "wall") for name, path in paths.items()}
                dropin_parts, dropin_topk_path = _dropin_parts(logits, budget, finish)
                timings.update(dropin_parts)
                graphed, how = None, dict(DROPIN_PATHS)
                if device == "cuda":  # the drop-in's own graph replay (KDTREE_SGLANG_GRAPH=1): its calls as they are
                    with _environment(dropin.GRAPH_ENV, "1"):
                        graphed = paths["dropin"]()  # captures
                        finish()
                        timings["dropin_graphed"] = (wall_seconds(lambda: (paths["dropin"](), finish())), "wall")
                        timings["dropin_graphed_call"] = (host_seconds(paths["dropin"]), "host")
                        replayed = dropin.prepared_build(logits, budget).graph is not None  # else above its bound
                    how.update(dropin_graphed="graph" if replayed else "eager",
                               dropin_graphed_call="graph" if replayed else "eager")
                topk_paths = dict(STAGE_TOPK_PATHS)
                topk_paths.update({name: dropin_topk_path for name in DROPIN_TOPK_METHODS})
                if device == "cuda":
                    exact = prepare_draft_topk(logits, budget, backend="torch")
                    build = prepare_build_launch(exact(), budget)
                    timings["kdtree_graph"] = graph_seconds(lambda: (exact(), build()))
                    fused = prepare_draft_topk(logits, budget, backend="cupy")
                    fused_build = prepare_build_launch(fused(), budget)
                    timings["kdtree_graph_fused"] = graph_seconds(lambda: (fused(), fused_build()))
                    topk_paths["kdtree_graph_fused"] = fused.path
                matches = graphed_matches = ""
                if sglang_utils is not None:
                    ours, theirs = paths["dropin"](), paths["sglang"]()
                    matches = _same_stage_outputs(ours, theirs)
                    if graphed is not None:
                        graphed_matches = matches and _same_stage_outputs(graphed, ours)
                sglang_seconds = timings.get("sglang", (None,))[0]
                for name, (seconds, timing) in timings.items():
                    whole = name == "dropin_graphed" or not name.startswith("dropin_")  # the same call as SGLang's
                    rows.append(dict(stage="tree_stage", batch=batch, depth=depth, vocab=vocab, budget=budget,
                                     method=name, backend="cupy" if name.startswith("kdtree") else "torch",
                                     topk_path=topk_paths.get(name, "exact"), dropin_path=how.get(name, ""),
                                     time_us=round(seconds * 1e6, 3), timing=timing,
                                     matches_sglang=graphed_matches if name.startswith("dropin_graphed") else matches,
                                     speedup_vs_sglang=round(sglang_seconds / seconds, 2)
                                     if sglang_seconds and whole else ""))
                print(f"tree stage D={depth:2d} B={batch:3d} budget={budget:4d}: " + "  ".join(
                    f"{name} {seconds * 1e6:9.1f} us" for name, (seconds, _) in timings.items())
                    + f"  dropin == sglang: {matches}", flush=True)
    return rows


def _dropin_parts(logits, budget: int, finish) -> tuple[dict, str]:
    """Where the drop-in's time goes, and the top-k path it runs. On a GPU: its top-k on the device
    ("dropin_topk": the prepared build's own, fused or exact; wall, synchronised), its build kernel
    alone ("dropin_kernel", in a CUDA graph), the host cost of its two eager calls (build_ddtree_tree,
    build_eagle_tree_format: "dropin_call", host time per call, back to back) and the same two calls
    replayed in a CUDA graph ("dropin_graph": what a captured worker step pays). On the CPU: torch's
    exact top-k and the host build of the sglang policy."""
    import torch
    from ..draft_topk import torch_topk_logprobs
    from ..integrations import sglang as dropin
    batch, depth, vocab = (int(n) for n in logits.shape)
    if logits.device.type != "cuda":
        policy = dropin.policy_from_environment()
        width = dropin.topk_width(policy, budget, depth, vocab)
        logp, ids = torch_topk_logprobs(logits, width)
        host = DraftTopK(logp.cpu().numpy(), ids.to(torch.int32).cpu().numpy())
        return {"dropin_topk": (wall_seconds(lambda: (torch_topk_logprobs(logits, width), finish())), "wall"),
                "dropin_host_build": (wall_seconds(lambda: build_tree(host, budget, policy=policy, backend="numpy")),
                                      "wall")}, "exact"
    prepared = dropin.prepared_build(logits, budget)
    parts = {"dropin_topk": (wall_seconds(lambda: (prepared.draft(logits), finish())), "wall")}
    logp, ids = prepared.draft(logits)
    out = prepared.launch.allocate(logits)
    parts["dropin_kernel"] = graph_seconds(lambda: prepared.launch(logp, ids, out))

    def both_calls():
        tree = dropin.build_ddtree_tree(logits, budget, logits.device)
        return dropin.build_eagle_tree_format(tree[2], tree[5], budget + 1, logits.device)

    parts["dropin_call"] = (host_seconds(both_calls), "host")
    parts["dropin_graph"] = graph_seconds(both_calls)
    return parts, prepared.topk_path


# ----------------------------------------------------------------------------------------------
# reading the rows back (notebook 04)

def build_summary(rows: list[dict]) -> dict:
    """What notebook 04 states, read from one run's build rows: per depth, at batch 64 (else the run's
    largest) and budget 64, the kernel's time, the serving build's over it and the host cost of the
    eager call and of a prepared launch; the kernel's growth over the run's budgets there; and whether
    every kernel row matched the reference."""
    table = build_table(rows)
    summary = {}
    for depth in sorted({line["depth"] for line in table}):
        lines = [line for line in table if line["depth"] == depth]
        batch = 64 if any(line["batch"] == 64 for line in lines) else max(line["batch"] for line in lines)
        by_budget = {line["budget"]: line for line in lines if line["batch"] == batch and "kernel_us" in line}
        budget = 64 if 64 in by_budget else max(by_budget)
        key = f"D={depth} B={batch} budget={budget}"
        for column in ("kernel_us", "serving_over_kernel", "kernel_call_us", "prepared_call_us"):
            if column in by_budget[budget]:
                summary[f"{key} {column}"] = by_budget[budget][column]
        low, high = min(by_budget), max(by_budget)
        summary[f"D={depth} B={batch} kernel growth {low}->{high}"] = round(
            by_budget[high]["kernel_us"] / by_budget[low]["kernel_us"], 2)
        summary[f"D={depth} B={batch} budget ratio {low}->{high}"] = high / low
        at_budget = {line["batch"]: line["kernel_us"] for line in lines if line["budget"] == budget and "kernel_us" in line}
        summary[f"D={depth} budget={budget} kernel B={max(at_budget)} over B={min(at_budget)}"] = round(
            at_budget[max(at_budget)] / at_budget[min(at_budget)], 3)
        summary[f"D={depth} all kernel rows match the reference"] = all(
            r["matches_reference"] for r in results.select(rows, stage="build", method="kernel", depth=depth))
    return summary


TOPK_TARGET_B1_US = 12.0       # issue 29: fused top-k in a CUDA graph, B=1, D=7, k <= 64
TOPK_TARGET_ROOFLINE_RATIO = 2.0  # ... and <= 2x the one-read roofline at B >= 8


def topk_path_of(row: dict) -> str:
    """The top-k path that produced a tree_build row. Rows written before the `topk_path` column: the
    build stage ran none; tree_stage and the draft_topk "torch"/eager rows ran torch's ops; the
    draft_topk "kernel*"/prepared rows ran the fused v1 kernel unless they equal torch's values to the
    bit (`max_abs_diff_vs_torch` 0): prepare_draft_topk then defaulted to the exact path, so those
    rows (8878d11 .. this column) timed torch's ops under the kernel's name."""
    if row.get("topk_path"):
        return row["topk_path"]
    stage, method = row.get("stage"), row.get("method", "")
    if stage == "build":
        return "none"
    if stage == "tree_stage":
        return STAGE_TOPK_PATHS.get(method, "exact")
    if method.startswith("torch") or method == "eager_call":
        return "exact"
    # the cell may come as text or already parsed; int() would truncate a parsed 1.9e-6 to 0
    diff = row.get("max_abs_diff_vs_torch")
    return "exact" if diff not in (None, "") and float(diff) == 0.0 else "fused_v1"


def topk_targets(rows: list[dict]) -> list[dict]:
    """Per batch and k <= 64 at D=7, from one run's draft_topk rows: the path the "kernel" rows ran,
    its CUDA-graph time against issue 29's target (<= 12 us at B=1, <= 2x the roofline at B >= 8),
    met or not, and torch's exact path beside it."""
    rows = results.select(rows, stage="draft_topk")
    lines = []
    for r in sorted(results.select(rows, method="kernel", depth=7), key=lambda r: (r["batch"], r["topk"])):
        if r["topk"] > 64:
            continue
        target = TOPK_TARGET_B1_US if r["batch"] == 1 else TOPK_TARGET_ROOFLINE_RATIO * r["roofline_us"]
        exact = results.select(rows, method="torch", batch=r["batch"], depth=7, topk=r["topk"])
        lines.append(dict(batch=r["batch"], k=r["topk"], path=topk_path_of(r), kernel_us=r["time_us"],
                          target_us=round(target, 1), met=r["time_us"] <= target,
                          over_roofline=round(r["time_us"] / r["roofline_us"], 2),
                          exact_us=exact[0]["time_us"] if exact else None))
    return lines


def topk_summary(rows: list[dict]) -> dict:
    """What notebook 04 records from one run's draft_topk rows: the paths, each target met or missed."""
    rows = results.select(rows, stage="draft_topk")
    lines = topk_targets(rows)
    summary = {"paths": sorted({f"{r['method']}={topk_path_of(r)}" for r in rows if r["method"] in ("kernel", "torch")}),
               "targets met": sum(line["met"] for line in lines),
               "targets missed": sum(not line["met"] for line in lines)}
    for line in lines:
        key = f"B={line['batch']} k={line['k']}"
        summary.update({f"{key} kernel us": line["kernel_us"], f"{key} target us": line["target_us"],
                        f"{key} met": line["met"], f"{key} exact us": line["exact_us"]})
    for method in ("prepared_call", "eager_call"):
        host = results.select(rows, method=method)
        if host:
            summary[f"{method} max_us"] = max(r["time_us"] for r in host)
    return summary


def topk_takeaway(rows: list[dict]) -> str:
    """The lines notebook 04 prints under its top-k table, from the same rows as topk_targets."""
    lines = topk_targets(rows)
    paths = sorted({line["path"] for line in lines})
    text = [f"the 'kernel' rows ran {', '.join(paths) or 'nothing'}; D=7, k <= 64: {sum(l['met'] for l in lines)} "
            f"of {len(lines)} targets met"]
    for line in lines:
        text.append(f"  B={line['batch']:2d} k={line['k']:2d}: {line['path']} {line['kernel_us']:.1f} us vs target "
                    f"{line['target_us']} us ({'met' if line['met'] else 'MISSED by ' + format(line['kernel_us'] / line['target_us'], '.1f') + 'x'}; "
                    f"{line['over_roofline']}x the roofline)"
                    + (f"; torch's exact path {line['exact_us']:.1f} us" if line["exact_us"] is not None else ""))
    table = [line for line in topk_table(rows) if line.get("kernel_us") and line.get("torch_us")]
    behind = [f"B={line['batch']} D={line['depth']} k={line['k']} ({line['kernel_path']} {line['kernel_us']:.1f} vs "
              f"{line['torch_us']:.1f} us)" for line in table if line["kernel_us"] >= line["torch_us"]]
    text.append(f"the 'kernel' path is faster than torch's exact path at {len(table) - len(behind)} of {len(table)} "
                f"configurations" + (f"; not at {', '.join(behind)}" if behind else ""))
    return "\n".join(text)


def build_table(rows: list[dict]) -> list[dict]:
    """One line per (depth, batch, budget) of a run's build rows: every method's time side by side."""
    lines = {}
    for r in results.select(rows, stage="build"):
        line = lines.setdefault((r["depth"], r["batch"], r["budget"]),
                                dict(depth=r["depth"], batch=r["batch"], budget=r["budget"]))
        if r["method"] != "kernel" or r.get("version") in (None, "", 2):  # the kernel build_tree launches
            line[f"{r['method']}_us"] = r["time_us"]
    table = [lines[key] for key in sorted(lines)]
    for line in table:
        if "kernel_us" in line and "serving_cpu_us" in line:
            line["serving_over_kernel"] = round(line["serving_cpu_us"] / line["kernel_us"], 1)
    return table


def kernel_history(rows: list[dict], *, batch: int = 64, budget: int = 64, depth: int = 15) -> list[dict]:
    """Every measurement of the build kernel at one configuration, oldest first (all versions)."""
    return [{key: results.parse_number(r.get(key)) for key in ("commit", "date", "device", "version", "time_us")}
            for r in results.select(rows, stage="build", method="kernel", batch=batch, budget=budget, depth=depth)]


def topk_table(rows: list[dict]) -> list[dict]:
    """One line per (batch, depth, k) of a run's draft_topk rows: the fused kernel, torch and the roofline."""
    lines = {}
    for r in results.select(rows, stage="draft_topk"):
        line = lines.setdefault((r["batch"], r["depth"], r["topk"]), dict(batch=r["batch"], depth=r["depth"], k=r["topk"],
                                                                          roofline_us=r.get("roofline_us")))
        line[f"{r['method']}_us"] = r["time_us"]
        if r["method"] == "kernel":
            line["kernel_path"] = topk_path_of(r)
    return [lines[key] for key in sorted(lines)]


def format_table(table: list[dict]) -> str:
    """Aligned text of table lines (their union of columns; empty where a line has no value)."""
    columns = list(dict.fromkeys(key for line in table for key in line))
    cell = lambda value: "" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)  # noqa: E731
    widths = {c: max(len(c), *(len(cell(line.get(c))) for line in table)) for c in columns}
    return "\n".join([" ".join(f"{c:>{widths[c]}}" for c in columns)]
                     + [" ".join(f"{cell(line.get(c)):>{widths[c]}}" for c in columns) for line in table])


def kernel_matches_reference(draft: DraftTopK, budget: int, root) -> bool:
    """The prepared kernel build on device arrays, its outputs poisoned first (0xA5 bytes), against the
    reference build of host copies: every field equal, log-weights bit for bit."""
    import torch
    launch = prepare_build_launch(draft, budget, root=root)
    for name in TREE_OUTPUTS:
        getattr(launch.out, name).view(torch.uint8).fill_(0xA5)
    got = launch()
    want = build_tree(DraftTopK(draft.logp.cpu().numpy(), draft.ids.cpu().numpy()), budget, root=root.cpu().numpy(),
                      backend="numpy")
    # byte views: torch holds the uint32 mask but cannot hand it to NumPy as such
    return all(np.array_equal(getattr(got, name).view(torch.uint8).cpu().numpy(), getattr(want, name).view(np.uint8))
               for name in TREE_OUTPUTS)


def stage_summary(rows: list[dict]) -> dict:
    """The tree stage against SGLang's build path, from one run's tree_stage rows: per method, the
    smallest speed-up over SGLang's path at B=1 and at the run's largest batch, budgets 32 to 64, and
    whether the drop-in equalled SGLang's outputs on every row."""
    stage = [r for r in results.select(rows, stage="tree_stage") if 32 <= r["budget"] <= 64]
    summary = {"dropin equals sglang on every row": all(r["matches_sglang"] is True
                                                        for r in results.select(rows, stage="tree_stage"))}
    for batch in sorted({1, max((r["batch"] for r in stage), default=1)}):
        for method in ("dropin", "kdtree", "kdtree_graph", "kdtree_graph_fused"):
            ratios = [r["speedup_vs_sglang"] for r in results.select(stage, method=method, batch=batch)
                      if isinstance(r["speedup_vs_sglang"], (int, float))]
            if ratios:
                summary[f"B={batch} budgets 32-64 {method} over sglang, min"] = min(ratios)
    return summary


STAGE_TARGET_B1 = 30.0        # issue 29: the drop-in over SGLang's path, eager, same call, B=1 (every budget)
STAGE_TARGET_B64_SMALL = 100.0  # ... at B=64, budget 8
STAGE_TARGET_B64_LARGE = 300.0  # ... at B=64, budgets >= 32
STAGE_GRAPH_TARGET_US = 20.0  # kdtree's stage in a CUDA graph, B=1, D=7, budget <= 64


def stage_targets(rows: list[dict]) -> list[dict]:
    """Issue 29's tree-stage targets at D=7, from one run's tree_stage rows: the drop-in's speed-up over
    SGLang's path (B=1 every budget, B=64 budget 8 and budgets >= 32) with its parts (host time per
    eager call, its calls replayed in a CUDA graph, its top-k, its build kernel), and kdtree's stage in
    a CUDA graph with the fused top-k at B=1, budgets <= 64; each met or not."""
    stage = results.select(rows, stage="tree_stage", depth=7)

    def time_of(method, batch, budget):
        found = results.select(stage, method=method, batch=batch, budget=budget)
        return found[0]["time_us"] if found else None

    lines = []
    rows_of = [r for method in ("dropin", "dropin_graphed") for r in results.select(stage, method=method)]
    for r in sorted(rows_of, key=lambda r: (r["method"] != "dropin", r["batch"], r["budget"])):
        batch, budget = r["batch"], r["budget"]
        target = (STAGE_TARGET_B1 if batch == 1 else STAGE_TARGET_B64_SMALL if batch == 64 and budget == 8
                  else STAGE_TARGET_B64_LARGE if batch == 64 and budget >= 32 else None)
        sglang = time_of("sglang", batch, budget)
        if target is None or sglang is None:
            continue
        ratio = sglang / r["time_us"]
        host = "dropin_call" if r["method"] == "dropin" else "dropin_graphed_call"  # its host time per call
        lines.append(dict(what=r["method"], batch=batch, budget=budget, time_us=r["time_us"], sglang_us=sglang,
                          ratio=round(ratio, 1), target=target, met=ratio >= target,
                          host_us=time_of(host, batch, budget), graph_us=time_of("dropin_graph", batch, budget),
                          topk_us=time_of("dropin_topk", batch, budget), kernel_us=time_of("dropin_kernel", batch, budget)))
    for r in sorted(results.select(stage, method="kdtree_graph_fused", batch=1), key=lambda r: r["budget"]):
        if r["budget"] <= 64:
            lines.append(dict(what="kdtree_graph_fused", batch=1, budget=r["budget"], time_us=r["time_us"],
                              target=STAGE_GRAPH_TARGET_US, met=r["time_us"] <= STAGE_GRAPH_TARGET_US))
    return lines


def stage_takeaway(rows: list[dict]) -> str:
    """The lines notebook 04 prints under its tree-stage plots, from the same rows as stage_targets:
    each target met or missed and by how much, and where the drop-in's time goes (host time per call
    against its launches in a graph at B=1; its top-k and build kernel at B=64)."""
    lines = stage_targets(rows)
    graph = [line for line in lines if line["what"] == "kdtree_graph_fused"]
    text = []
    for what, how in (("dropin", "eager"), ("dropin_graphed", "its own CUDA graph replayed, KDTREE_SGLANG_GRAPH=1")):
        dropin = [line for line in lines if line["what"] == what]
        if not dropin and what != "dropin":
            continue
        text.append(f"the drop-in over SGLang's path ({how}, same call, D=7): {sum(l['met'] for l in dropin)} of "
                    f"{len(dropin)} targets met")
        for line in dropin:
            verdict = "met" if line["met"] else f"MISSED by {line['target'] / line['ratio']:.1f}x"
            where = (f"host time per call {_us(line['host_us'])} us, its calls in a CUDA graph "
                     f"{_us(line['graph_us'])} us" if line["batch"] == 1 else
                     f"its top-k {_us(line['topk_us'])} us, its build kernel {_us(line['kernel_us'])} us")
            text.append(f"  B={line['batch']:2d} budget {line['budget']:3d}: {line['time_us']:.1f} vs "
                        f"{line['sglang_us']:.1f} us = {line['ratio']}x (target {line['target']:.0f}x: {verdict}); "
                        f"{where}")
    if graph:
        text.append(f"kdtree's stage in a CUDA graph (fused top-k), B=1 D=7: {sum(l['met'] for l in graph)} of "
                    f"{len(graph)} budgets <= 64 within {STAGE_GRAPH_TARGET_US:.0f} us: " + ", ".join(
                        f"budget {l['budget']} {l['time_us']:.1f} us" + ("" if l["met"] else
                                                                        f" (over by {l['time_us'] - l['target']:.1f} us)")
                        for l in graph))
    return "\n".join(text)


def _us(value) -> str:
    """A time in microseconds as the takeaway prints it ("?" for a row the run did not write)."""
    return "?" if value is None else f"{value:.1f}"


PARTS = ("build", "topk", "stage")


def _int_list(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated positive integers."""
    return tuple(cli.positive_int(part) for part in text.split(","))


@cli.command
def main(argv=None) -> int:
    parser = command_parser(__spec__.name, __doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few small configurations (a smoke test)")
    parser.add_argument("--only", default="build,topk", help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--sglang-utils", type=Path, default=None,
                        help="a local copy of SGLang's ddtree_utils.py: times its build beside the drop-in (stage)")
    parser.add_argument("--batches", type=_int_list, default=BATCHES)
    parser.add_argument("--depths", type=_int_list, default=DEPTHS)
    parser.add_argument("--budgets", type=_int_list, default=BUDGETS)
    parser.add_argument("--ks", type=_int_list, default=TOPK_KS)
    args = parser.parse_args(argv)
    parts = set(args.only.split(","))
    if not parts or not parts <= set(PARTS):
        raise ValueError(f"--only: {args.only!r}; expected a comma-separated subset of {','.join(PARTS)}")
    cli.require_cuda(kernels=True)
    grid = dict(batches=(1, 64), depths=(7,)) if args.quick else dict(batches=args.batches, depths=args.depths)
    if "build" in parts:
        budgets = (8, 64) if args.quick else args.budgets
        results.append_rows("tree_build", bench_build(**grid, budgets=budgets), results_dir=args.results_dir)
    if "topk" in parts:
        ks = (64,) if args.quick else args.ks
        results.append_rows("tree_build", bench_draft_topk(**grid, ks=ks), results_dir=args.results_dir)
    if "stage" in parts:
        from ..integrations.sglang import load_sglang_module
        utils = load_sglang_module(args.sglang_utils) if args.sglang_utils else None
        budgets = (8, 64) if args.quick else args.budgets
        results.append_rows("tree_build", bench_tree_stage(utils, **grid, budgets=budgets), results_dir=args.results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
