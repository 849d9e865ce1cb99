"""Figures of the INT4 MoE kernel (notebook 07): time per call against tokens by provider, and the
experts hit beside the kernel's time (time should follow the union, not the tokens)."""
from __future__ import annotations

from ..bench.moe_int4 import ROUTINGS
from ..results import select


PROVIDER_STYLE = {"kernel": ("C0", "o-"), "kernel_99kb": ("C1", "x:"), "kernel_ep": ("C4", "d-."),
                  "torch_bf16": ("C3", "s--"), "roofline": ("k", "--")}


def plot_time(ax, rows, *, tp: int, routing: str):
    """Time per call against M, one line per provider, on log axes."""
    for provider, (color, style) in PROVIDER_STYLE.items():
        picked = sorted(select(rows, provider=provider, tp=tp, routing=routing), key=lambda r: r["tokens"])
        if picked:
            ax.plot([r["tokens"] for r in picked], [r["time_us"] for r in picked], style, color=color, label=provider)
    ax.set(xscale="log", yscale="log", xlabel="tokens M = B·N", ylabel="µs per call", title=f"TP={tp}, {routing}")
    ax.legend(fontsize=8)


def plot_union(ax, rows, *, tp: int):
    """Experts hit and the kernel's time against M: time should follow the union, not M."""
    for routing, style in zip(ROUTINGS, ("o-", "s--")):
        picked = sorted(select(rows, provider="kernel", tp=tp, routing=routing), key=lambda r: r["tokens"])
        ax.plot([r["tokens"] for r in picked], [r["experts_hit"] for r in picked], style, color="C2",
                label=f"experts hit, {routing}")
    ax.set(xscale="log", xlabel="tokens M = B·N", ylabel="distinct experts hit", title=f"TP={tp}")
    twin = ax.twinx()
    for routing, style in zip(ROUTINGS, ("o-", "s--")):
        picked = sorted(select(rows, provider="kernel", tp=tp, routing=routing), key=lambda r: r["tokens"])
        twin.plot([r["tokens"] for r in picked], [r["time_us"] for r in picked], style, color="C0",
                  label=f"kernel µs, {routing}")
    twin.set_ylabel("kernel µs per call")
    ax.legend(fontsize=8, loc="upper left")
    twin.legend(fontsize=8, loc="lower right")
