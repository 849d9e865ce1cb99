"""Figures: every plot is drawn from results files or library calls and saved under data/figures/.

One module per topic (trees, decode, acceptance, verify_attn, tp_step, projection, ...), so a notebook
cell is one call and a batch rerun redraws the same picture; this module holds what they share:
saving, and generic heat maps, status matrices and bar charts. $KDTREE_FIGURES_DIR, when set,
replaces data/figures/ (tests point it at a temporary folder).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..paths import FIGURES_DIR

FIGURES_DIR_ENV = "KDTREE_FIGURES_DIR"
STATUS_COLORS = {"ok": "#4c9a2a", "n/a": "#d9d9d9", "no GPU": "#f2c14e", "error": "#d1495b"}


def save_figure(fig, notebook: str, name: str, *, figures_dir: Path | None = None) -> Path:
    """Write `fig` to data/figures/<notebook>-<name>.png (the names batch reruns regenerate)."""
    if figures_dir is None:
        figures_dir = os.environ.get(FIGURES_DIR_ENV) or FIGURES_DIR
    directory = Path(figures_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{notebook}-{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def draw_heatmap(ax, values, *, title: str, xlabel: str, ylabel: str, floor: float = 1e-9, vmax: float | None = None):
    """|values| on a log colour scale (floored at `floor`, so exact zeros show as the floor), with a colorbar."""
    import matplotlib.colors as colors
    import matplotlib.pyplot as plt
    import matplotlib.ticker as ticker

    magnitude = np.maximum(np.abs(np.asarray(values, np.float64)), floor)
    image = ax.imshow(magnitude, aspect="auto", interpolation="nearest", cmap="magma",
                      norm=colors.LogNorm(vmin=floor, vmax=vmax or max(float(magnitude.max()), floor * 10)))
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    plt.colorbar(image, ax=ax, fraction=0.046)
    return image


def draw_status_matrix(ax, statuses: dict, rows: list[str], columns: list[str]):
    """A grid of coloured cells, one per (row, column), labelled with its status ('ok', 'n/a', 'no GPU', 'error: …')."""
    from matplotlib.patches import Rectangle

    for i, row in enumerate(rows):
        for j, column in enumerate(columns):
            status = statuses[(row, column)]
            kind = status.split(":")[0]
            ax.add_patch(Rectangle((j, i), 0.96, 0.9, color=STATUS_COLORS.get(kind, STATUS_COLORS["error"])))
            ax.text(j + 0.48, i + 0.45, kind, ha="center", va="center", fontsize=9)
    ax.set_xlim(0, len(columns))
    ax.set_ylim(len(rows), 0)
    ax.set_xticks(np.arange(len(columns)) + 0.48)
    ax.set_xticklabels(columns)
    ax.set_yticks(np.arange(len(rows)) + 0.45)
    ax.set_yticklabels(rows)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)


def draw_distributions(ax, distributions: dict, *, title: str, xlabel: str = "token"):
    """Side-by-side bars of several probability vectors over the same tokens (label -> probs)."""
    width = 0.8 / len(distributions)
    for index, (label, probs) in enumerate(distributions.items()):
        probs = np.asarray(probs)
        ax.bar(np.arange(len(probs)) + (index - (len(distributions) - 1) / 2) * width, probs, width, label=label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("probability")
    ax.legend(fontsize=8)
