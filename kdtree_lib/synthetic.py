"""A synthetic drafter with a realistic shape, and what a tree is worth under it.

A block-diffusion drafter (DFlash) emits, in one pass, a distribution for each of the next D
positions. Real ones are peaked (the top token carries most of the mass) with a long Zipf-like tail,
and grow less sure with depth. `zipf_draft_logits` makes such logits without a model, so the tree
build can be studied on inputs that look like the real ones.

Under a *calibrated* drafter (the target's token at draft position d is distributed as the drafter's
marginal at d, independently of the other positions) a tree node is accepted exactly when every
token on its root-to-node path matches, which has probability exp(log w) of the node. The expected
acceptance length (accepted draft tokens plus the root, as `AcceptResult.n_accepted` counts) is
therefore 1 + the sum of exp(log w) over the tree's draft nodes: the quantity DDTree's best-first
build maximises for a given budget. `calibrated_posterior` samples that model so the formula can be
checked against `tree_accept.accept` by Monte Carlo.
"""
from __future__ import annotations

import numpy as np

from .checks import check_positive_int, to_numpy
from .contracts import DraftTopK, Tree
from .draft_topk import draft_topk
from .tree_build import build_tree


def zipf_draft_logits(batch: int, depth: int, vocab: int, *, sharpness: float = 2.5, decay: float = 0.85,
                      seed: int = 0) -> np.ndarray:
    """Draft logits float32 [batch, depth, vocab]: p(rank r at position d) ∝ r^-(sharpness · decay^d).

    Each position ranks the vocabulary in its own random order (so token ids differ between
    positions); `sharpness` sets how peaked position 0 is and `decay` (in (0, 1]) how quickly
    later positions flatten.
    """
    batch, depth, vocab = (check_positive_int(name, value) for name, value in
                           (("batch", batch), ("depth", depth), ("vocab", vocab)))
    if not sharpness > 0:
        raise ValueError(f"sharpness: expected a positive number, got {sharpness!r}")
    if not 0 < decay <= 1:
        raise ValueError(f"decay: expected a number in (0, 1], got {decay!r}")
    rng = np.random.default_rng(seed)
    exponents = sharpness * decay ** np.arange(depth)                 # (D,)
    rank_logits = -exponents[:, None] * np.log(np.arange(1, vocab + 1))[None, :]  # (D, V)
    order = rng.permuted(np.broadcast_to(np.arange(vocab), (batch, depth, vocab)), axis=-1)  # (B, D, V)
    logits = np.empty((batch, depth, vocab), np.float32)
    np.put_along_axis(logits, order, np.broadcast_to(rank_logits, (batch, depth, vocab)).astype(np.float32),
                      axis=-1)
    return logits


def expected_acceptance_length(tree: Tree) -> np.ndarray:
    """float64 [B]: 1 + Σ exp(log w) over each request's draft nodes (calibrated-drafter model)."""
    tree = tree.to_numpy()
    live = np.arange(tree.capacity)[None, :] < tree.n_nodes[:, None]
    live[:, 0] = False  # the root is always accepted: it is the 1
    return 1.0 + np.where(live, np.exp(tree.log_weights), 0.0).sum(axis=1)


def expected_acceptance_curve(logits, budgets, *, top_k: int, mode: str = "tree") -> np.ndarray:
    """Expected acceptance length [len(budgets), B] of the tree (or chain) built at each budget."""
    draft = draft_topk(logits, top_k, backend="numpy")
    return np.stack([expected_acceptance_length(build_tree(draft, int(budget), mode=mode, backend="numpy"))
                     for budget in budgets])


def calibrated_posterior(logits, tree: Tree, rng: np.random.Generator) -> np.ndarray:
    """Posterior int32 [B, N] of a target that draws position d's token from the drafter's softmax.

    One token per draft position is sampled (the target's continuation), and node v carries the
    token of position depth(v), so a path is accepted exactly as far as it matches. Nodes at the
    last depth carry a token of an extra, uniformly drawn position; it only becomes the bonus.
    """
    logits = np.asarray(to_numpy(logits), np.float64)
    tree = tree.to_numpy()
    batch, depth, vocab = logits.shape
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)                         # (B, D, V)
    draws = (probs.cumsum(axis=-1) < rng.random((batch, depth, 1))).sum(axis=-1)  # (B, D)
    draws = np.minimum(draws, vocab - 1)  # a cumulative sum that rounds to just below 1
    continuation = np.concatenate([draws, rng.integers(0, vocab, (batch, 1))], axis=1)  # (B, D+1)
    return np.take_along_axis(continuation, tree.depths, axis=1).astype(np.int32)


def best_possible_sum(draft: DraftTopK, budget: int, *, b: int = 0, max_paths: int = 200_000) -> float:
    """The largest Σ exp(log w) that any tree of `budget` draft nodes can reach, by enumeration.

    Every path of ranks (r1, …, rd), d ≤ D, is a candidate node with probability Π p(rank). A path's
    prefix is at least as likely as the path, so the `budget` most likely paths always form a tree:
    the optimum is simply their sum. Only for small drafts (at most `max_paths` candidates).
    """
    logp = np.asarray(to_numpy(draft.logp)[b], np.float64)  # (D, K)
    depth_limit, k = logp.shape
    if sum(k ** d for d in range(1, depth_limit + 1)) > max_paths:
        raise ValueError(f"draft: {k}^1 + … + {k}^{depth_limit} candidate paths exceed max_paths={max_paths}; "
                         "pass a smaller draft (fewer positions or a smaller top-k)")
    level = np.zeros(1)  # log-probabilities of all paths of the current depth
    candidates = []
    for d in range(depth_limit):
        level = (level[:, None] + logp[d][None, :]).ravel()
        candidates.append(level)
    every_path = np.concatenate(candidates)
    return float(np.exp(np.sort(every_path)[::-1][:check_positive_int("budget", budget)]).sum())
