"""Acceptance sources: tokens per round per budget and the chain's, measured (oracle rows) or observed elsewhere."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import results
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
    from ..acceptance import largest_measurement
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
# where a tree's extra tokens come from: the drafter's rank-0 nodes against their siblings, per depth

@dataclass(frozen=True)
class DepthStructure:
    """What the accepted paths of oracle records show at one budget, per depth d = 1..D.

    reached[d]: rounds whose accepted path got to depth d − 1 (so could accept a node at depth d);
    rank0[d] / sibling[d]: rounds accepting, at depth d, the drafter's top-1 token of that depth or
    another of its top-k (a sibling); after_rank0[d] / after_sibling[d]: (rounds that accepted a
    rank-0 / sibling node at depth d − 1, how many of them accepted a node at depth d).
    tree_mean = 1 + prefix_mean + sibling_mean: tokens per round (root included), split into the
    nodes of the all-rank-0 prefix and the nodes at or after the path's first sibling;
    chain_mean: the DFlash chain's (the top-1 path of `chain_depth` drafts) on the same records."""
    budget: int
    chain_depth: int
    rounds: int
    reached: dict[int, int]
    rank0: dict[int, int]
    sibling: dict[int, int]
    after_rank0: dict[int, tuple[int, int]]
    after_sibling: dict[int, tuple[int, int]]
    tree_mean: float
    prefix_mean: float
    sibling_mean: float
    chain_mean: float

    @property
    def sibling_share_of_gain(self) -> float:
        """sibling_mean over the tree's gain over the chain (tree_mean − chain_mean): above 1 when the
        tree's rank-0 prefix accepts less than the chain does (a budget below the chain's depth)."""
        gain = self.tree_mean - self.chain_mean
        return self.sibling_mean / gain if gain > 0 else float("nan")

    def lines(self) -> list[str]:
        """Printable: per depth the acceptance of rank-0 nodes and siblings, and after each."""
        out = [f"budget {self.budget}, {self.rounds} rounds: tokens per round {self.tree_mean:.3f} = 1 (root) + "
               f"{self.prefix_mean:.3f} (all-rank-0 prefix) + {self.sibling_mean:.3f} (at or after the first sibling); "
               f"chain of {self.chain_depth}: {self.chain_mean:.3f}; siblings give "
               + (f"{self.sibling_share_of_gain:.0%} of the tree's gain over the chain "
                  f"({self.tree_mean - self.chain_mean:+.3f} tokens per round)" if self.tree_mean > self.chain_mean
                  else f"{self.sibling_mean:.3f} tokens, and the tree does not beat the chain here"
                       f" ({self.tree_mean - self.chain_mean:+.3f})")]
        for d in sorted(self.reached):
            if not self.reached[d]:
                continue
            def rate(pair):
                return f"{pair[1] / pair[0]:.0%} of {pair[0]}" if pair[0] else "none"
            after = (f"; after a rank-0 node at depth {d - 1}: {rate(self.after_rank0[d])}, "
                     f"after a sibling: {rate(self.after_sibling[d])}") if d > 1 else ""
            out.append(f"  depth {d}: of {self.reached[d]} rounds reaching it, rank 0 accepted "
                       f"{self.rank0[d] / self.reached[d]:.0%}, a sibling {self.sibling[d] / self.reached[d]:.0%}{after}")
        return out


def depth_structure(records, budget: int, *, chain_depth: int, backend: str = "numpy") -> DepthStructure:
    """The DepthStructure of oracle records (acceptance.record_oracle, T = 0) at `budget`, over the rounds a
    live decode makes (acceptance.round_lengths chased from position 0 of each record); a node's rank is
    the place of its token in the drafter's top-k at its depth (DFlash drafts every depth at once)."""
    from ..acceptance import accepted_at_every_position, round_lengths
    from ..checks import to_numpy
    from ..tree_accept import accept
    from ..tree_build import build_tree
    from ..contracts import DraftTopK
    if not records:
        raise ValueError("records: expected at least one oracle record")
    depth_limit = int(records[0].draft.logp.shape[1])
    zero = {d: 0 for d in range(1, depth_limit + 1)}
    reached, rank0, sibling = dict(zero), dict(zero), dict(zero)
    after = {"rank0": {d: [0, 0] for d in zero}, "sibling": {d: [0, 0] for d in zero}}
    lengths_all, prefix_all, siblings_all, chain_all = [], [], [], []
    for record in records:
        logp, ids, tokens = (to_numpy(x) for x in (record.draft.logp, record.draft.ids, record.tokens))
        positions = logp.shape[0]
        tree = build_tree(DraftTopK(logp, ids), budget, root=tokens[:positions], backend=backend)
        depths, node_tokens = to_numpy(tree.depths).astype(np.int64), to_numpy(tree.tokens)
        continuation = np.lib.stride_tricks.sliding_window_view(tokens[1:], depth_limit + 1)[:positions]
        result = accept(tree, np.take_along_axis(continuation, depths, axis=1).astype(np.int32), backend=backend)
        path, n_accepted = to_numpy(result.path), to_numpy(result.n_accepted)
        chain = round_lengths(accepted_at_every_position(record, min(chain_depth, depth_limit), mode="chain",
                                                         backend=backend))
        chain_all += chain
        t = 0
        for length in round_lengths(n_accepted):
            kinds = []  # per accepted depth 1..length-1: "rank0" or "sibling"
            for d in range(1, length):
                token = node_tokens[t, path[t, d]]
                kinds.append("rank0" if token == ids[t, d - 1, 0] else "sibling")
            for d in range(1, depth_limit + 1):
                if d - 1 >= length:  # the path stopped before depth d − 1
                    break
                reached[d] += 1
                accepted_here = d < length
                if accepted_here:
                    (rank0 if kinds[d - 1] == "rank0" else sibling)[d] += 1
                if d >= 2:
                    counter = after[kinds[d - 2]][d]
                    counter[0] += 1
                    counter[1] += int(accepted_here)
            first_sibling = kinds.index("sibling") if "sibling" in kinds else len(kinds)
            lengths_all.append(length)
            prefix_all.append(first_sibling)
            siblings_all.append(len(kinds) - first_sibling)
            t += length
    return DepthStructure(budget, chain_depth, len(lengths_all), reached, rank0, sibling,
                          {d: tuple(v) for d, v in after["rank0"].items()},
                          {d: tuple(v) for d, v in after["sibling"].items()},
                          float(np.mean(lengths_all)), float(np.mean(prefix_all)), float(np.mean(siblings_all)),
                          float(np.mean(chain_all)))
