"""Acceptance figures: mean acceptance length vs budget, and the distribution of acceptance lengths."""
from __future__ import annotations

import json

import numpy as np


def plot_acceptance_vs_budget(ax, rows: list[dict], *, title: str = "") -> None:
    """Mean acceptance length vs budget (log2 axis): a line per (source, block size, mode), live
    runs as markers with error bars where they have several seeds."""
    groups = {}
    for row in rows:
        groups.setdefault((row["source"], int(float(row["block_size"])), row["mode"]), []).append(row)
    styles = {"oracle": dict(marker=".", linestyle="-"), "monte_carlo": dict(marker=".", linestyle="--"),
              "live": dict(marker="o", linestyle="none", markersize=7, markerfacecolor="none")}
    colors = {}
    for (source, block, mode), group in sorted(groups.items()):
        group.sort(key=lambda r: float(r["budget"]))
        budget = np.array([float(r["budget"]) for r in group])
        mean = np.array([float(r["mean_acceptance"]) for r in group])
        error = np.array([float(r.get("stderr") or "nan") for r in group])
        color = colors.setdefault((block, mode), f"C{len(colors)}")
        label = f"{source.replace('_', ' ')}, block {block}" + (", chain" if mode == "chain" else "")
        ax.errorbar(budget, mean, yerr=np.where(np.isfinite(error), error, 0), color=color, label=label,
                    **styles.get(source, {}))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget (draft nodes per tree)")
    ax.set_ylabel("mean acceptance length (tokens per round)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_acceptance_histogram(ax, rows: list[dict], *, title: str = "") -> None:
    """Fraction of rounds by acceptance length, one bar group per row (e.g. a few budgets)."""
    width = 0.8 / max(len(rows), 1)
    for i, row in enumerate(rows):
        counts = np.array(json.loads(row["histogram"]), float)
        lengths = np.arange(1, len(counts) + 1)
        ax.bar(lengths + (i - (len(rows) - 1) / 2) * width, counts / max(counts.sum(), 1), width=width,
               label=f"budget {int(float(row['budget']))}, block {int(float(row['block_size']))}")
    ax.set_xlabel("acceptance length (tokens per round)")
    ax.set_ylabel("fraction of rounds")
    ax.set_title(title)
    ax.legend(fontsize=8)


def plot_replay_vs_live(ax, rows: list[dict], *, title: str = "") -> None:
    """At T > 0: the Monte-Carlo replay's mean acceptance against the live runs' (± their standard error), one
    point per (block size, package, budget), on the y = x line where they agree: every budget its own point,
    whatever budgets were run (a budget axis would stack a one-budget run on one x)."""
    pairs = []
    for r in rows:
        if r["source"] != "monte_carlo":
            continue
        twin = [x for x in rows if x["source"] == "live"
                and all(str(x[k]) == str(r[k]) for k in ("block_size", "package", "budget"))]
        if twin:
            pairs.append((r, twin[0]))
    for i, (replay, live) in enumerate(pairs):
        ax.errorbar(float(live["mean_acceptance"]), float(replay["mean_acceptance"]), xerr=float(live["stderr"]),
                    fmt="o", color=f"C{i % 10}", capsize=3,
                    label=f"block {replay['block_size']}, {replay['package']}, budget {replay['budget']}")
    values = [float(x["mean_acceptance"]) for pair in pairs for x in pair]
    if values:
        span = [min(values) * 0.95, max(values) * 1.05]
        ax.plot(span, span, "k--", lw=0.8, label="replay = live")
    ax.set_xlabel("live sampled runs: mean tokens per round (± standard error)")
    ax.set_ylabel("Monte-Carlo replay: mean tokens per round")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
