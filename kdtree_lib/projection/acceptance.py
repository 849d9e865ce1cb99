"""Acceptance sources: tokens per round per budget and the chain's, measured (oracle rows) or observed elsewhere."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import results
from ..acceptance import DepthStructure, depth_structure, depth_structures, largest_measurement  # noqa: F401  (re-exported)
from .inputs import Input, assumed, rows_source


SERVICE_OBSERVED = {8: 4.5, 16: 5.3, 32: 6.4}  # the live service's mean acceptance (DESIGN.md §7: 8 ≈ 4.5, 16–32: 5.3–6.4)


@dataclass(frozen=True)
class AcceptanceSource:
    """Tokens per round (root included) per budget, and the DFlash chain's (chain_drafts drafts, a path
    of that many nodes: where a plot puts it on the budget axis), from one source."""
    name: str
    curve: dict[int, float]
    chain: Input
    source: str
    measured: bool
    chain_drafts: int


def acceptance_curve(rows: list[dict], *, column: str = "mean_acceptance", **filters) -> dict[int, float]:
    """Mean tokens per round per budget (root included) from acceptance rows, e.g.
    data/results/acceptance.csv: the mean of `column` over the rows of each budget matching filters."""
    picked = results.select(rows, **filters)
    if not picked or column not in picked[0] or "budget" not in picked[0]:
        raise ValueError(f"rows: expected rows with 'budget' and {column!r} matching {filters}")
    curve: dict[int, list[float]] = {}
    for row in picked:
        curve.setdefault(int(float(row["budget"])), []).append(float(row[column]))
    return {budget: float(np.mean(values)) for budget, values in sorted(curve.items())}


def measured_acceptance(name: str, file: str, rows: list[dict], *, depth: int, **filters) -> AcceptanceSource | None:
    """The oracle tree curve (T = 0) of the biggest measurement in `rows` (read from `file`, e.g.
    data/results/acceptance.csv or a kit's box_acceptance.csv) matching filters, and its chain at
    depth `depth` (measured where the file has chain rows); None without tree rows."""
    tree = largest_measurement(rows, source="oracle", mode="tree", temperature=0, **filters)
    if not tree:
        return None
    curve = acceptance_curve(tree)
    what = f"oracle rows {filters}" if filters else "oracle rows"
    chain_rows = [r for r in largest_measurement(rows, source="oracle", mode="chain", temperature=0, **filters)
                  if int(float(r["budget"])) >= depth]
    if chain_rows:
        chain = Input("chain_acceptance", acceptance_curve(chain_rows)[min(int(float(r["budget"])) for r in chain_rows)],
                      rows_source(file, chain_rows, "oracle chain rows"), True)
    else:
        chain = _chain_assumption(curve, depth)
    return AcceptanceSource(name, curve, chain, rows_source(file, tree, what), True, depth)


def service_acceptance(observed: dict[int, float] = SERVICE_OBSERVED, *, depth: int = 7) -> AcceptanceSource:
    """The live service's observed acceptance (DESIGN.md §7), budgets it ran only: not a measurement here;
    its chain (depth drafts) is not observed either."""
    curve = {int(b): float(a) for b, a in sorted(observed.items())}
    return AcceptanceSource("service", curve, _chain_assumption(curve, depth),
                            "parameter service_acceptance: the live service's observations as DESIGN.md "
                            "§7 quotes them (budget 8 ≈ 4.5, 16–32: 5.3–6.4), read as 16 → 5.3, 32 → 6.4", False, depth)


def _chain_assumption(curve: dict[int, float], depth: int) -> Input:
    """Without chain rows: the tree's acceptance at the smallest budget of at least `depth` nodes."""
    budget = min((b for b in curve if b >= depth), default=max(curve))
    return assumed("chain_acceptance", curve[budget], "chain_acceptance",
                   f"no chain rows: the tree's acceptance at budget {budget} (a chain of {depth} drafts accepts at most "
                   "about what a tree of as many nodes does; generous to the chain)")



# ----------------------------------------------------------------------------------------------
# where a tree's extra tokens come from, read from depth rows (the owner, acceptance, makes them from oracle records)

@dataclass(frozen=True)
class DepthSource:
    """The depth structure per budget of one source's depth rows (acceptance.depth_rows: the stand-in sweep's,
    a notebook run's, the box kit's box_acceptance_depth.csv), and where they came from."""
    name: str
    structures: dict[int, DepthStructure]
    source: str

    def at(self, budget: int) -> DepthStructure:
        """The structure at `budget`, or at the nearest budget the rows hold (the smaller on a tie)."""
        return self.structures[min(self.structures, key=lambda b: (abs(b - budget), b))]

    def gain_line(self, budget: int) -> str:
        """How much of DDTree's gain over the chain comes from siblings at (or nearest) `budget`, with its source."""
        s = self.at(budget)
        where = f"budget {s.budget}" + (f" (the rows' nearest to {budget})" if s.budget != budget else "")
        gain = s.gain_over_chain
        share = (f"siblings give {s.sibling_share_of_gain:.0%} of DDTree's gain in tokens per round over the chain"
                 if gain > 0 else f"the tree accepts no more tokens per round than the chain ({gain:+.3f})")
        return (f"{self.name}, {where}: {share} (tree {s.tree_mean:.2f} = 1 + {s.prefix_mean:.2f} rank-0 prefix + "
                f"{s.sibling_mean:.2f} at or after a sibling, chain of {s.chain_depth} {s.chain_mean:.2f} tokens per round, "
                f"{s.rounds} rounds; {self.source})")


def depth_source(name: str, file: str, rows: list[dict], **criteria) -> DepthSource | None:
    """The DepthSource of the biggest measurement in depth `rows` (read from `file`) matching criteria; None without rows."""
    structures = depth_structures(rows, **criteria)
    if not structures:
        return None
    picked = largest_measurement(rows, source="oracle", mode="tree", temperature=0, **criteria)
    return DepthSource(name, structures, rows_source(file, picked, "depth rows"))
