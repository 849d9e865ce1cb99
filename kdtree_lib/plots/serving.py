"""The live service's figures, from serving.csv rows (kdtree_lib.serving.client): tokens/s per request
and in aggregate against concurrency, acceptance length against the budget label, and the TPOT
distribution of the streamed requests. Rows may be parsed or CSV text; failed requests are left out."""
from __future__ import annotations

import numpy as np

from ..results import as_float
from ..serving.client import arm_summaries


def label_order(labels) -> list[str]:
    """Budget labels in reading order: numbers by value, then the rest (chain, ar, ...) by name."""
    def key(label):
        try:
            return (0, float(label), "")
        except ValueError:
            return (1, 0.0, label)
    return sorted(set(labels), key=key)


def _good(rows, endpoint=None):
    return [r for r in rows if str(r["ok"]) == "True" and (endpoint is None or r["endpoint"] == endpoint)]


def plot_throughput(per_request_ax, aggregate_ax, rows: list[dict], *, endpoint: str = "generate") -> None:
    """Left: every request's tokens/s against concurrency (points, medians joined); right: the arm's
    aggregate tokens/s (all its completion tokens over its wall clock); one colour per budget label."""
    good = _good(rows, endpoint)
    summaries = arm_summaries(good)
    for index, label in enumerate(label_order(r["budget_label"] for r in good)):
        color = f"C{index}"
        mine = [r for r in good if r["budget_label"] == label]
        levels = sorted({int(as_float(r["concurrency"])) for r in mine})
        per_request = {c: [as_float(r["tokens_per_second"]) for r in mine if int(as_float(r["concurrency"])) == c]
                       for c in levels}
        for c, values in per_request.items():
            per_request_ax.scatter([c] * len(values), values, s=12, alpha=0.5, color=color)
        per_request_ax.plot(levels, [np.median(per_request[c]) for c in levels], "-o", color=color,
                            label=f"budget {label}")
        arms = sorted((s["concurrency"], s["aggregate_tokens_per_second"]) for s in summaries
                      if s["budget_label"] == label and s["aggregate_tokens_per_second"])
        aggregate_ax.plot([c for c, _ in arms], [v for _, v in arms], "-o", color=color, label=f"budget {label}")
    levels = sorted({int(as_float(r["concurrency"])) for r in good})
    for ax, title in ((per_request_ax, "per request"), (aggregate_ax, "aggregate (the arm's tokens / its wall clock)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(level) for level in levels])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel("tokens / s")
        ax.set_title(f"{endpoint}: {title}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)


def plot_acceptance(ax, rows: list[dict]) -> None:
    """Mean acceptance length (completion tokens per verify step, SGLang's spec_accept_length) per
    budget label, one series per concurrency, bars one standard deviation over the requests."""
    good = [r for r in _good(rows, "generate") if r.get("spec_accept_length") not in (None, "")]
    labels = label_order(r["budget_label"] for r in good)
    levels = sorted({int(as_float(r["concurrency"])) for r in good})
    width = 0.6 / max(len(levels), 1)
    for index, level in enumerate(levels):
        values = [[as_float(r["spec_accept_length"]) for r in good
                   if r["budget_label"] == label and int(as_float(r["concurrency"])) == level] for label in labels]
        x = np.arange(len(labels)) + (index - (len(levels) - 1) / 2) * width
        ax.errorbar(x, [np.mean(v) if v else np.nan for v in values], yerr=[np.std(v) if v else 0 for v in values],
                    fmt="o", capsize=3, label=f"concurrency {level}")
    ax.set_xticks(np.arange(len(labels)))
    ax.set_xticklabels(labels)
    ax.set_xlabel("budget label")
    ax.set_ylabel("tokens per verify step")
    ax.set_title("acceptance length (spec_accept_length)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_tpot(ax, rows: list[dict]) -> None:
    """The distribution (empirical CDF) of time per output token over the streamed requests, one line
    per (budget label, endpoint, concurrency)."""
    streamed = [r for r in _good(rows) if r.get("tpot_s") not in (None, "")]
    groups = sorted({(r["budget_label"], r["endpoint"], int(as_float(r["concurrency"]))) for r in streamed},
                    key=lambda g: (label_order(r["budget_label"] for r in streamed).index(g[0]), g[1], g[2]))
    for label, endpoint, level in groups:
        values = np.sort([1e3 * as_float(r["tpot_s"]) for r in streamed if (r["budget_label"], r["endpoint"],
                          int(as_float(r["concurrency"]))) == (label, endpoint, level)])
        ax.step(np.concatenate([values[:1], values]), np.arange(len(values) + 1) / len(values), where="post",
                label=f"budget {label}, {endpoint}, concurrency {level}")
    ax.set_xlabel("time per output token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TPOT, streamed requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
