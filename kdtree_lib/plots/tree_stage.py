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
    """Time per step vs budget (log-log) for every build method of one run."""
    _time_vs_budget(ax, rows, [(method, label, style) for method, (label, style) in SERIES.items()],
                    title=f"tree build, B={batch}, D={depth}", batch=batch, depth=depth)


def plot_tree_stage(ax, rows: list[dict], *, batch: int, depth: int) -> None:
    """Time per step vs budget for SGLang's build path, the drop-in and kdtree's stage (eager and graph)."""
    series = [("sglang", "SGLang's build path", "o-"), ("dropin", "the drop-in", "s-"),
              ("kdtree", "kdtree draft_topk → build_tree", "^-"), ("kdtree_graph", "kdtree, CUDA graph", "^:")]
    _time_vs_budget(ax, rows, series, title=f"tree stage, B={batch}, D={depth}", stage="tree_stage", batch=batch,
                    depth=depth)


def _time_vs_budget(ax, rows: list[dict], series, *, title: str, **where) -> None:
    """One line per (method, label, style) of time per step against budget, on log axes."""
    for method, label, style in series:
        points = sorted((r["budget"], r["time_us"]) for r in select(rows, method=method, **where))
        if points:
            ax.plot(*zip(*points), style, label=label)
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
