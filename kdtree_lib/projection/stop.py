"""Budget choice by cost: a latency-aware stop against the best fixed budget, on oracle records."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..contracts import tree_nodes
from .inputs import Input
from .roofline import Efficiency, Hardware, step_costs

if TYPE_CHECKING:
    from ..model import ModelConfig


def round_seconds_of_nodes(config: ModelConfig, hardware: Hardware, *, context: int, correlation: float,
                           efficiency: Efficiency, expert_bits: float, drafter: Callable[[int, int], float],
                           tree_stage: Callable[[int, int], Input]) -> Callable[[int], float]:
    """seconds(n): one batch-1 round of a tree of n nodes (root included) at `context`: the verify step
    (projection.step_costs) plus the drafter's forward drafter(1, context) and the tree stage at budget
    max(n − 1, 1); what projection.stop_rule_comparison and latency_aware_budgets take."""
    def seconds(nodes: int) -> float:
        extra = drafter(1, context) + tree_stage(1, max(nodes - 1, 1)).value
        return step_costs(config, hardware, batch=1, nodes=nodes, context=context, expert_bits=expert_bits,
                          correlation=correlation, efficiency=efficiency, fixed_seconds=extra)["total"]
    return seconds


def latency_aware_budgets(log_weights, seconds_of_nodes: Callable[[int], float], max_budget: int) -> np.ndarray:
    """int [T]: per tree (log_weights [T, N] of best-first trees, pop order, root first, padding −inf)
    the budget at which the latency-aware stop halts. With n nodes kept (root included) a round is
    expected to commit A = 1 + Σ w of the drafts kept (w = exp(log w), the drafter's path probability,
    DDTree's expected acceptance) in seconds_of_nodes(n); the next node (weight w) is added only while
    (A + w) / T(n + 1) > A / T(n), i.e. its marginal acceptance beats the marginal verify cost."""
    weights = np.exp(np.asarray(log_weights, np.float64)[:, 1:max_budget + 1])               # (T, budget)
    cost = np.array([seconds_of_nodes(n) for n in range(1, weights.shape[1] + 2)])           # T(1) .. T(budget + 1)
    expected = 1 + np.concatenate([np.zeros((len(weights), 1)), np.cumsum(weights, axis=1)[:, :-1]], axis=1)
    keep = weights * cost[:-1] > expected * (cost[1:] - cost[:-1])                           # (T, budget)
    return np.where(keep.all(axis=1), weights.shape[1], np.argmin(keep, axis=1))


def stop_rule_comparison(records, seconds_of_nodes: Callable[[int], float], budgets, *, backend: str = "auto") -> dict:
    """Tokens per second of oracle records (acceptance.record_oracle, T = 0, batch 1) under each fixed
    budget and under the latency-aware stop (its budgets rounded down to the nearest of `budgets`,
    so one build per budget): {"fixed": {budget: tokens/s}, "latency_aware": tokens/s,
    "latency_aware_mean_budget": ..., "best_fixed_budget": ..., "beats_best_fixed": bool}."""
    from ..acceptance import accepted_at_every_position, round_lengths
    seconds_of_nodes = functools.lru_cache(maxsize=None)(seconds_of_nodes)
    grid = np.array(sorted(budgets))
    fixed = {int(b): [0, 0.0] for b in grid}
    adaptive, adaptive_budgets = [0, 0.0], []
    for record in records:
        stop = latency_aware_budgets(tree_log_weights(record, int(grid[-1]), backend=backend), seconds_of_nodes,
                                     int(grid[-1]))
        on_grid = grid[np.maximum(np.searchsorted(grid, stop, side="right") - 1, 0)]
        accepted = {int(b): accepted_at_every_position(record, int(b), backend=backend) for b in grid}
        for b, per_position in accepted.items():
            lengths = round_lengths(per_position)
            fixed[b][0] += sum(lengths)
            fixed[b][1] += len(lengths) * seconds_of_nodes(tree_nodes(b))
        lengths = round_lengths(np.array([accepted[int(b)][t] for t, b in enumerate(on_grid)]))
        chosen = on_grid[np.cumsum([0, *lengths[:-1]])]
        adaptive[0] += sum(lengths)
        adaptive[1] += sum(seconds_of_nodes(tree_nodes(int(b))) for b in chosen)
        adaptive_budgets += chosen.tolist()
    rates = {b: tokens / seconds for b, (tokens, seconds) in fixed.items()}
    best = max(rates, key=rates.get)
    rate = adaptive[0] / adaptive[1]
    return {"fixed": rates, "latency_aware": rate, "latency_aware_mean_budget": float(np.mean(adaptive_budgets)),
            "best_fixed_budget": best, "beats_best_fixed": bool(rate > rates[best])}


def tree_log_weights(record, budget: int, *, backend: str = "auto") -> np.ndarray:
    """float64 [T, budget + 1]: the log weights of the best-first tree at every recorded position."""
    from ..checks import to_numpy
    from ..tree_build import build_tree
    positions = record.draft.logp.shape[0]
    return to_numpy(build_tree(record.draft, budget, root=record.tokens[:positions], backend=backend).log_weights)

