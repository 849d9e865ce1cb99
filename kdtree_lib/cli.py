"""How every `python -m kdtree_lib.X` command refuses an input: one line `prog: message` on stderr and exit
status 2, never a traceback.

A command's `main(argv=None) -> int` is decorated with `@command` and builds its parser with
`ArgumentParser`. The decorator turns a refused input into that one line and returns 2, so a test can call
`main([...])` in-process and read the status. A refused input is

- a `Refused` (this module's class: a usage error, a missing CUDA GPU, any refusal that is no ValueError);
- a ValueError raised by kdtree_lib's own code (the library names the argument and what it expected); a
  ValueError raised inside another library (torch, numpy...) is no check of ours but most likely a bug,
  so it keeps its traceback;
- a file-system error that names its path (no such file, not a folder, permission denied...);
- any of these raised in a rank spawned by torch.multiprocessing (model.tp.launch), which hands it back
  as the rank's traceback text: read from that text by the same rule.

Anything else is a bug and keeps its traceback; so does everything when KDTREE_TRACEBACK=1 (to debug a
refusal).
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
EXIT_REFUSED = 2  # argparse's own status for a usage error
PATH_ERRORS = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)


class Refused(Exception):
    """An input the command cannot use, where no ValueError fits (no CUDA GPU, a failed lookup...)."""


class UsageError(Refused):
    """A command line argparse refuses (an unknown flag, a value of the wrong type or out of its choices)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, refusing a bad command line in one line (no usage block) through `@command`."""

    def error(self, message):
        raise UsageError(f"{message} (see --help)")


def _number(text: str, kind, expected: str, ok) -> int | float:
    """`text` as a `kind` for which ok(value) holds; else an argparse error naming the flag (argparse
    prefixes `argument --flag: `), so a refusal names what the user typed, not a parameter inside."""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _number(text, int, "a positive integer", lambda v: v >= 1)


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _number(text, int, "an integer >= 0", lambda v: v >= 0)


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (no inf, no nan)."""
    return _number(text, float, "a finite number >= 0", lambda v: math.isfinite(v) and v >= 0)


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _number(text, float, "a finite number > 0", lambda v: math.isfinite(v) and v > 0)


def integer_in(low: int, high: int | None = None):
    """argparse type: an integer in low..high (high None: no upper bound)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected an integer in {low}..{high if high is not None else 'inf'}, "
                                             f"got {value}")
        return value
    parse.__name__ = "integer"
    return parse


def require_cuda(*, kernels: bool = False) -> None:
    """Refuse a command that needs a CUDA GPU when torch sees none (the one check every GPU command makes
    before its first CUDA call, instead of failing inside torch or cupy); kernels=True: the command also
    launches this project's kernels, which go through CuPy."""
    import torch
    if not torch.cuda.is_available():
        reason = "this torch has no CUDA" if torch.version.cuda is None else "torch sees no CUDA device"
        raise Refused(f"needs a CUDA GPU ({reason})")
    from .backend import cuda_available
    if kernels and not cuda_available():
        raise Refused("needs a CUDA GPU that CuPy sees (the kernels launch through CuPy; is cupy installed?)")


def raised_by_kdtree(error: BaseException) -> bool:
    """Whether the innermost Python frame of `error`'s traceback is kdtree_lib's code."""
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(PACKAGE_DIR)


def is_refusal(error: BaseException) -> bool:
    if isinstance(error, (Refused, *PATH_ERRORS)):
        return True
    return isinstance(error, ValueError) and raised_by_kdtree(error)


VALUE_ERRORS = ("ValueError", "MemoryPlanError")  # the ValueErrors a rank's traceback text may name


def rank_refusal(error: BaseException) -> str | None:
    """`rank R: message` for a refusal raised in a spawned rank, else None (a bug there keeps its text)."""
    if type(error).__name__ != "ProcessRaisedException":
        return None
    lines = [line for line in str(error).splitlines() if line.strip()]
    frames = [line.strip() for line in lines if line.strip().startswith('File "')]
    if not frames:
        return None
    kind, _, message = lines[-1].partition(": ")
    kind = kind.rsplit(".", 1)[-1]
    ours = Path(frames[-1].split('"')[1]).resolve().is_relative_to(PACKAGE_DIR)
    refused = {"Refused", "UsageError", *(e.__name__ for e in PATH_ERRORS)}
    if kind in refused or (kind in VALUE_ERRORS and ours):
        return f"rank {getattr(error, 'error_index', '?')}: {message}"
    return None


def one_line(error: BaseException) -> str:
    """The error's message on one line (an OSError as `path: reason`)."""
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        text = f"{error.filename}: {error.strerror}"
    else:
        text = str(error) or type(error).__name__
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def prog_of(function) -> str:
    """`python -m package.module` for a module's function, also when the module runs as __main__."""
    spec = getattr(sys.modules.get(function.__module__), "__spec__", None)
    return f"python -m {spec.name if spec is not None else function.__module__}"


def command(main):
    """Decorate a command's `main(argv=None) -> int`: a refused input prints `prog: message` on stderr and
    returns 2; anything else propagates with its traceback."""
    @functools.wraps(main)
    def run(argv=None) -> int:
        try:
            return main(argv)
        except Exception as error:
            from_rank = rank_refusal(error)
            if not (from_rank or is_refusal(error)) or os.environ.get("KDTREE_TRACEBACK") == "1":
                raise
            print(f"{prog_of(main)}: {from_rank or one_line(error)}", file=sys.stderr)
            return EXIT_REFUSED
    return run
