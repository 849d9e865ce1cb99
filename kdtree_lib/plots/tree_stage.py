"""Figures of the tree stage (notebooks 04 and 06): build and top-k times against budget and rows,
the stage against SGLang's build path, and the accept walk with the cache compaction."""
from __future__ import annotations

from ..results import select


SERIES = {  # method -> (label, style) in the plots
    "serving_cpu": ("serving worker: host copy + Python heap", "o-"),
    "numpy": ("NumPy reference", "s-"),
    "kernel": ("kernel (CUDA graph)", "^-"),
    "kernel_call": ("kernel via the eager entry point", "^:"),
    "prepared_call": ("kernel via a prepared launch (host)", "v:"),
}


def plot_build_times(ax, rows: list[dict], *, batch: int, depth: int) -> None:
    """Time per step vs budget (log-log) for every build method of one run, one line per kernel version."""
    _time_vs_budget(ax, rows, [(method, label, style) for method, (label, style) in SERIES.items()],
                    title=f"tree build, B={batch}, D={depth}", batch=batch, depth=depth)


def plot_topk_times(ax, rows: list[dict], *, k: int) -> None:
    """Draft top-k in a CUDA graph vs rows B·D: one line per top-k path that ran (rows labelled by
    bench.tree_build.topk_path_of), the one-read roofline and issue 29's 2x-roofline target."""
    from ..bench.tree_build import topk_path_of
    by_path: dict[str, list] = {}
    for r in select(rows, stage="draft_topk", topk=k):
        if r["method"] in ("kernel", "torch"):
            by_path.setdefault(topk_path_of(r), []).append((r["batch"] * r["depth"], r["time_us"]))
    for path, points in sorted(by_path.items()):
        label, style = TOPK_PATHS.get(path, (path, "x-"))
        ax.plot(*zip(*sorted(points)), style, label=label)
    roof = sorted({(r["batch"] * r["depth"], r["roofline_us"]) for r in select(rows, stage="draft_topk", topk=k)
                   if r.get("roofline_us") not in (None, "")})
    if roof:
        ax.plot(*zip(*roof), "k--", lw=0.8, label="logits ÷ copy bandwidth")
        ax.plot([x for x, _ in roof], [2 * y for _, y in roof], "k:", lw=0.8, label="2 × that (target, B ≥ 8)")
    ax.set(xscale="log", yscale="log", xlabel="rows B·D (V = 163,840)", ylabel="GPU time, CUDA graph (µs)",
           title=f"draft top-k, k={k}")
    ax.grid(True, which="both", alpha=0.3)


TOPK_PATHS = {  # topk_path -> (label, style)
    "exact": ("torch topk − logsumexp (exact)", "o-"),
    "fused_v1": ("fused v1 (one CTA per row)", "s-"),
    "fused_v2": ("fused v2 (slices + merge)", "^-"),
    "fused_v3": ("fused v3 (one launch, last CTA merges)", "v-"),
}


def plot_tree_stage(ax, rows: list[dict], *, batch: int, depth: int) -> None:
    """Time per step vs budget for SGLang's build path, the drop-in and kdtree's stage (eager and graph)."""
    series = [("sglang", "SGLang's build path", "o-"), ("dropin", "the drop-in", "s-"),
              ("dropin_graphed", "the drop-in, KDTREE_SGLANG_GRAPH=1", "s:"),
              ("kdtree", "kdtree draft_topk → build_tree", "^-"), ("kdtree_graph", "kdtree, CUDA graph", "^:"),
              ("kdtree_graph_fused", "kdtree, CUDA graph, fused top-k", "v:")]
    _time_vs_budget(ax, rows, series, title=f"tree stage, B={batch}, D={depth}", stage="tree_stage", batch=batch,
                    depth=depth)


def _time_vs_budget(ax, rows: list[dict], series, *, title: str, **where) -> None:
    """One line per (method, label, style) of time per step against budget, on log axes; a method
    measured in several kernel versions in these rows (the `version` column) gets one line per version,
    so points of different kernels are never joined."""
    for method, label, style in series:
        chosen = select(rows, method=method, **where)
        versions = sorted({str(r.get("version") or "") for r in chosen})
        for version in versions:
            points = sorted((r["budget"], r["time_us"]) for r in chosen if str(r.get("version") or "") == version)
            if points:
                ax.plot(*zip(*points), style, label=label + (f", v{version}" if len(versions) > 1 and version else ""))
    ax.set(yscale="log", xlabel="budget (nodes)", ylabel="time per step (µs)", title=title)
    ax.set_xscale("log", base=2)
    ax.grid(True, which="both", alpha=0.3)


def plot_accept_times(ax, rows: list[dict], *, budget: int) -> None:
    """Walk, compaction of every layer, and both (CUDA graph), vs batch size."""
    for method, label in (("accept_kernel", "accept (walk)"), ("compact_kernel", "compaction, all layers"),
                          ("accept_compact_kernel", "accept + compaction")):
        points = sorted((r["batch"], r["time_us"]) for r in select(rows, method=method, budget=budget))
        if points:
            ax.plot(*zip(*points), "o-", label=label)
    ax.set(xscale="log", yscale="log", xlabel="batch B", ylabel="GPU time per step (µs)",
           title=f"tree accept + KV compaction, budget {budget}")
    ax.grid(True, which="both", alpha=0.3)
