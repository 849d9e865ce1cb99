"""The decode loop's figures: tokens/s vs budget against AR and the chain, and stage times per round."""
from __future__ import annotations

import numpy as np

from ..bench.decode import LATEST_KEYS
from ..decode import STAGES
from ..results import as_float, newest_per, select


def plot_throughput(ax, rows: list[dict], *, batch: int) -> None:
    """Tokens/s vs budget: DDTree graph and eager, host-tree and reference-style lines; AR and chain
    as horizontal lines."""
    rows = newest_per(rows, LATEST_KEYS)
    series = [("kdtree", "ddtree", True, "DDTree, CUDA graph", "-o"), ("kdtree", "ddtree", False, "DDTree, eager", "--o"),
              ("host_tree", "ddtree", False, "DDTree, host heap tree", ":s"),
              ("reference_style", "ddtree", False, "reference style (transformers + heapq + dense mask)", "-.^"),
              ("official", "ddtree", False, "the paper's official code (transformers, sdpa)", "-.v")]
    for impl, method, graph, label, style in series:
        chosen = sorted(select(rows, impl=impl, method=method, cuda_graph=graph, batch=batch),
                        key=lambda r: as_float(r["budget"]))
        chosen = [r for r in chosen if r.get("tokens_per_second")]
        if chosen:
            ax.plot([as_float(r["budget"]) for r in chosen], [as_float(r["tokens_per_second"]) for r in chosen],
                    style, label=label)
    for index, (method, label) in enumerate((("ar", "autoregressive"), ("chain", "DFlash chain"))):
        chosen = (select(rows, impl="kdtree", method=method, cuda_graph=True, batch=batch)
                  or select(rows, impl="kdtree", method=method, cuda_graph=False, batch=batch))
        for r in chosen[:1]:
            graph = "graph" if str(r["cuda_graph"]) == "True" else "eager"
            ax.axhline(as_float(r["tokens_per_second"]), color=f"C{5 + index}", linestyle=":", label=f"{label}, {graph}")
    ax.set_xscale("log", base=2)
    speeds = [y for line in ax.get_lines() for y in line.get_ydata()]
    # a log axis over less than a decade shows no labelled decade, only crowded minor labels: linear there
    if speeds and min(speeds) > 0 and max(speeds) / min(speeds) >= 10:
        ax.set_yscale("log")
    ax.set_xlabel("budget (draft nodes per tree)")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"batch {batch}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)


def plot_stage_breakdown(ax, rows: list[dict], *, batch: int) -> None:
    """Stacked ms per round by stage (eager, CUDA events) for AR, chain and DDTree at each budget."""
    rows = [r for r in select(newest_per(rows, LATEST_KEYS), impl="kdtree", cuda_graph=False, batch=batch)
            if r.get("draft_ms_per_round") not in (None, "")]
    rows.sort(key=lambda r: (("ar", "chain", "ddtree").index(r["method"]), as_float(r["budget"])))
    labels = [r["method"] if r["method"] != "ddtree" else f"tree {int(as_float(r['budget']))}" for r in rows]
    bottom = np.zeros(len(rows))
    for stage in STAGES:
        values = np.array([as_float(r[f"{stage}_ms_per_round"]) for r in rows])
        ax.bar(labels, values, bottom=bottom, label=stage)
        bottom += values
    ax.set_ylabel("ms per round")
    ax.set_title(f"stage times per round, batch {batch} (eager)")
    ax.tick_params(axis="x", rotation=45)
    ax.legend(fontsize=8)
