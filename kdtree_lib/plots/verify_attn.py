"""Notebook 05's figures: the verify-attention kernels' time and throughput from the benchmark rows
(`kdtree_lib.bench.verify_attn` writes them), beside the torch baselines, the roofline and the measured ceilings.

The axes carry no legend of their own: `legend_beside` draws one for the whole figure, right of the
axes, so no legend covers a line.
"""
from __future__ import annotations

from ..results import select

PROVIDER_STYLE = {"kernel": ("C0", "o-"), "torch_fallback": ("C3", "s--"), "sdpa": ("C2", "^--"),
                  "roofline": ("k", ":"), "roofline_mma": ("0.5", ":")}
VARIANT_COLORS = ("C1", "C4", "C5", "C6")


def _series(rows, **fixed):
    """(label, color, style, rows) per provider, then one per kernel variant timed alongside."""
    for provider, (color, style) in PROVIDER_STYLE.items():
        chosen = select(rows, provider=provider, **fixed)
        if chosen:
            yield provider, color, style, chosen
    variants = select(rows, provider="kernel_variant", **fixed)
    for color, config in zip(VARIANT_COLORS, sorted({r["config"] for r in variants})):
        yield config, color, "x-", select(variants, config=config)


def _title(ax, fixed: dict) -> None:
    ax.set_title(", ".join(f"{k}={v}" for k, v in fixed.items()), fontsize=9)


def plot_time(ax, rows, x: str, **fixed):
    """Time (µs, log) of every provider and kernel variant against `x` ('length' or 'nodes')."""
    for label, color, style, chosen in _series(rows, **fixed):
        ax.plot(*zip(*sorted((r[x], r["time_us"]) for r in chosen)), style, color=color, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel("time (µs)")
    _title(ax, fixed)


def plot_achieved(ax_flops, ax_bytes, rows, **fixed):
    """Kernel (and variant) TFLOP/s and TB/s against rows = N·H, with the measured ceilings as lines."""
    kernel = sorted(select(rows, provider="kernel", **fixed), key=lambda r: r["rows"])
    if not kernel:
        return
    ceil = kernel[0]
    for ax, key, unit in ((ax_flops, "tflops", "TFLOP/s"), (ax_bytes, "tbps", "TB/s")):
        for label, color, style, chosen in _series(rows, **fixed):
            if label != "roofline_mma":
                ax.plot(*zip(*sorted((r["rows"], r[key]) for r in chosen)), style, color=color, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows = N·H")
        ax.set_ylabel(unit)
        _title(ax, fixed)
    # one legend serves both panels (legend_beside): every ceiling its own style
    ax_flops.axhline(ceil["matmul_tflops"], color="k", lw=0.8, linestyle="-", label="cuBLAS bf16 ceiling")
    ax_flops.axhline(ceil["mma_sync_tflops"], color="0.5", lw=0.8, linestyle="--", label="mma.sync ceiling")
    ax_bytes.axhline(ceil["copy_tbps"], color="k", lw=1.2, linestyle=":", label="copy bandwidth")


def legend_beside(fig, fontsize: int = 8):
    """One legend for every labelled line of the figure's axes (each label once), right of the axes."""
    handles = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    return fig.legend(handles.values(), handles.keys(), loc="center left", bbox_to_anchor=(1.0, 0.5),
                      fontsize=fontsize, frameon=False)
