"""Physics checks: every number the projection takes in is one some hardware can produce.

A measured row faster than its roofline (reading its bytes above the run's measured copy bandwidth, or
doing its FLOPs above the measured matmul rate) and an efficiency above 1 (or not above 0) are
impossible: the projection refuses them, naming the row or rows (or the parameter) that produced them,
rather than projecting a box faster than its own memory.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Iterable

STAMP_KEYS = ("device", "date", "commit")
SHAPE_KEYS = ("provider", "config", "method", "stage", "scope", "tp", "batch", "nodes", "length", "context", "tokens",
              "topk", "budget", "depth", "routing", "layer")


class Unphysical(ValueError):
    """An input faster than the hardware allows; the message names the value and the rows it came from."""


def row_label(row: dict) -> str:
    """One row as a reader finds it again: its stamp and its shape."""
    stamp = " ".join(str(row[k])[:19] for k in STAMP_KEYS if row.get(k) not in (None, ""))
    shape = " ".join(f"{k}={row[k]}" for k in SHAPE_KEYS if row.get(k) not in (None, ""))
    return f"[{stamp}: {shape}]"


def rows_label(rows: list[dict], limit: int = 3) -> str:
    labels = [row_label(r) for r in rows[:limit]]
    return ", ".join(labels) + (f" and {len(rows) - limit} more" if len(rows) > limit else "")


def check_fraction(name: str, value: float, *, source: str) -> float:
    """`value` as a fraction of a roofline: 0 < value <= 1, else Unphysical naming `source`."""
    value = float(value)
    if not 0 < value <= 1:
        what = "above 1: faster than its roofline" if value > 1 else "not positive"
        raise Unphysical(f"{name} = {value:.4g} is {what}; refused (from {source})")
    return value


def check_efficiency(efficiency, *, source: str):
    """Every fraction of an Efficiency (or a KernelTime's two) within (0, 1]; the *_fixed seconds >= 0."""
    for key, value in asdict(efficiency).items():
        if value is None or key in ("fixed",):
            continue
        if key.endswith("_fixed"):
            if value < 0:
                raise Unphysical(f"efficiency.{key} = {value:.4g} s is negative; refused (from {source})")
            continue
        check_fraction(f"efficiency.{key}", value, source=source)
    return efficiency


@dataclass(frozen=True)
class Refusal:
    """A measured row the projection does not use, and why."""
    file: str
    row: dict
    why: str

    def line(self) -> str:
        return f"REFUSED {self.file} {row_label(self.row)}: {self.why}"


def check_rows(file: str, rows: Iterable[dict], *, measured: Callable[[dict], float],
               bytes_seconds: Callable[[dict], float] | None = None,
               flops_seconds: Callable[[dict], float] | None = None) -> tuple[list[dict], list[Refusal]]:
    """(rows kept, rows refused): a row whose measured seconds are below its bytes / copy bandwidth (it
    would read faster than the run's own measured copy) or below its FLOPs / matmul rate is refused."""
    kept, refused = [], []
    for row in rows:
        seconds, why = measured(row), []
        if not seconds > 0:
            why.append(f"measured time {seconds:.4g} s is not positive")
        for term, floor in (("copy bandwidth", bytes_seconds), ("matmul rate", flops_seconds)):
            if floor is None or not seconds > 0:
                continue
            limit = floor(row)
            if seconds < limit:
                why.append(f"{seconds * 1e6:.4g} us is below its roofline at the measured {term} "
                           f"({limit * 1e6:.4g} us: {limit / seconds:.3f}x the {term})")
        (refused.append(Refusal(file, row, "; ".join(why))) if why else kept.append(row))
    return kept, refused
