"""Where the repository keeps things, and the byte sizes every cost model shares (written once)."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
KERNEL_DIR = REPO_ROOT / "kernels"
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
RUNS_DIR = REPO_ROOT / "runs"
DATA_DIR = REPO_ROOT / "data"
CONFIGS_DIR = DATA_DIR / "configs"
CORPUS_DIR = DATA_DIR / "corpus"
MODELS_DIR = DATA_DIR / "models"
RESULTS_DIR = DATA_DIR / "results"
FIGURES_DIR = DATA_DIR / "figures"
K26_CONFIG = CONFIGS_DIR / "kimi-k2.6.json"

BF16_BYTES = 2
FP32_BYTES = 4
GIB = 1 << 30
