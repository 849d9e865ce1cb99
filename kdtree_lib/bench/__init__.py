"""Benchmarks: one module per measured thing, each a command (`python -m kdtree_lib.bench.<name>`).

They share `timing` (the one way to time a GPU call) and `inputs` (synthetic drafts, trees and random
weights); no benchmark imports another, so each can change without moving the others' numbers.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from .. import cli


def command_parser(module: str, doc: str | None) -> cli.ArgumentParser:
    """The parser of `python -m <module>` (a benchmark), with the options every benchmark takes: today
    `--results-dir`, where its rows go."""
    parser = cli.ArgumentParser(prog=f"python -m {module}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="where the rows go (default: $KDTREE_RESULTS_DIR, else data/results/)")
    return parser
