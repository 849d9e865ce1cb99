"""Figures: every plot is drawn from results files or library calls and saved under data/figures/."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
FIGURES_DIR = REPO_ROOT / "data" / "figures"


def save_figure(fig, notebook: str, name: str, *, figures_dir: Path | None = None) -> Path:
    """Write `fig` to data/figures/<notebook>-<name>.png (the names batch reruns regenerate)."""
    directory = Path(figures_dir) if figures_dir is not None else FIGURES_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{notebook}-{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path
