"""Figures of the tensor-parallel verify step (notebook 12): one MoE layer by component, the whole
round against tree size, and the experts a step's tokens touch."""
from __future__ import annotations

import numpy as np

from ..projection import COMPONENTS, expected_distinct_experts, moe_layer_split

COMPONENT_COLORS = {"attention": "tab:blue", "moe": "tab:orange", "allreduce": "tab:red", "rest": "tab:gray"}


def plot_layer_components(axes, rows: list[dict], *, batches, contexts, graph: bool) -> None:
    """Stacked ms per MoE layer by component vs tree nodes N: a row of axes per context, a column per batch."""
    for row_axes, context in zip(axes, contexts):
        for ax, batch in zip(row_axes, batches):
            split = moe_layer_split(rows, batch, context, graph)
            nodes = list(split)
            bottom = np.zeros(len(nodes))
            for i, component in enumerate(COMPONENTS):
                values = np.array([split[n][i] for n in nodes]) * 1e3
                ax.bar([str(n) for n in nodes], values, bottom=bottom, color=COMPONENT_COLORS[component],
                       label=component)
                bottom += values
            ax.set_title(f"B={batch}, L={context}")
            ax.set_xlabel("tree nodes N")
            ax.set_ylabel("ms per MoE layer")
            ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend()


def plot_round_vs_nodes(axes, rounds: list[dict], *, batches, contexts) -> None:
    """Whole-model ms per verify round vs N (left) and the same over the AR step (right)."""
    for (batch, context), style in zip([(b, c) for c in contexts for b in batches], ["o-", "s-", "o--", "s--"] * 4):
        picked = sorted((r for r in rounds if (r["batch"], r["context"]) == (batch, context)), key=lambda r: r["nodes"])
        if not picked:
            continue
        nodes = [r["nodes"] for r in picked]
        axes[0].plot(nodes, [r["total"] * 1e3 for r in picked], style, label=f"B={batch}, L={context}")
        ar = picked[0]["total"] if picked[0]["nodes"] == 1 else np.nan
        axes[1].plot(nodes, [r["total"] / ar for r in picked], style, label=f"B={batch}, L={context}")
    for ax, label in zip(axes, ["ms per verify round (all layers + head + draft)", "round time / AR step time"]):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree nodes N")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()


def plot_experts_touched(ax, tokens: np.ndarray, touched: np.ndarray, config, *, title: str) -> None:
    """Distinct routed experts per layer against the step's tokens, beside uniform independent routing."""
    ax.plot(tokens, touched, "o", alpha=0.6, label="measured (random weights)")
    grid = np.unique(np.geomspace(1, max(tokens.max(), 2), 60).astype(int))
    uniform = [expected_distinct_experts(int(t), config.n_routed_experts, config.num_experts_per_tok) for t in grid]
    ax.plot(grid, uniform, "k--", label="uniform independent routing")
    ax.set_xscale("log")
    ax.set_xlabel("tokens in the step (B x N)")
    ax.set_ylabel("distinct routed experts per layer")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
