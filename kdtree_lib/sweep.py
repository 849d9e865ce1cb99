"""Acceptance-vs-budget sweeps from an offline oracle.

At T=0 a DDTree round that starts with committed context y[:t+1] (root y[t]) accepts the longest
prefix of the target's greedy continuation y[t+1:] that is a path of the tree, plus the root. The
tree depends only on the drafter's top-k for that context, and decoding is lossless, so the
contexts a live decode visits are prefixes of the target's greedy sequence. Record once per
prompt the greedy sequence and the drafter's top-k at every position; then, for any budget, depth
or top-k, build the trees of all positions in one batched call, read off the accepted length at
each position, and chase the rounds: t -> t + accepted(t). That equals the live decode's
acceptance exactly (tested against the live loop) and costs milliseconds on the GPU kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .checks import check_array, check_positive_int, to_numpy
from .tree_accept import accept
from .tree_build import DraftTopK, build_tree


@dataclass
class OracleRecord:
    """One prompt's recording: the drafter's top-k at each position and the target's greedy tokens.

    draft: DraftTopK [T, D, K] where row t is the draft made with root tokens[t];
    tokens: int32 [T + D + 1] the target's greedy sequence from the first root on (tokens[0] is the
    last prompt token), so the continuation of position t is tokens[t+1 : t+1+D].
    """
    draft: DraftTopK
    tokens: np.ndarray


def accepted_at_every_position(record: OracleRecord, budget: int, *, depth: int | None = None,
                               topk: int | None = None, mode: str = "tree",
                               backend: str = "auto") -> np.ndarray:
    """int32 [T]: the number of nodes (root included) a round starting at position t accepts."""
    logp, ids, tokens = _sliced(record, depth, topk)
    positions, depth_limit, _ = logp.shape
    tree = build_tree(DraftTopK(logp, ids), budget, root=tokens[:positions].astype(np.int32), mode=mode,
                      backend=backend)
    tree = tree.to_numpy()
    # The greedy target's token at a node of depth d on the greedy path is tokens[t + d + 1]; nodes
    # off that path are never reached by the walk, so their posterior does not matter.
    continuation = np.stack([tokens[t + 1: t + 2 + depth_limit] for t in range(positions)])  # (T, D+1)
    posterior = np.take_along_axis(continuation, tree.depths.astype(np.int64), axis=1).astype(np.int32)
    return np.asarray(accept(tree, posterior, backend="numpy").n_accepted)


def round_lengths(accepted: np.ndarray, n_new_tokens: int | None = None) -> list[int]:
    """Chase the rounds from position 0: the accepted length of each round a live decode makes.

    Each round commits `accepted[t]` tokens (the root and the accepted drafts) and moves the root
    to t + accepted[t]; it stops when the record runs out or `n_new_tokens` are generated.
    """
    limit = len(accepted) if n_new_tokens is None else min(len(accepted), n_new_tokens)
    lengths, t = [], 0
    while t < limit:
        lengths.append(int(accepted[t]))
        t += int(accepted[t])
    return lengths


def mean_acceptance(records: list[OracleRecord], budget: int, **options) -> float:
    """Mean tokens per round over all rounds of all recorded prompts."""
    rounds = [n for record in records
              for n in round_lengths(accepted_at_every_position(record, budget, **options))]
    if not rounds:
        raise ValueError("records: no positions recorded")
    return float(np.mean(rounds))


def _sliced(record: OracleRecord, depth, topk):
    if not isinstance(record, OracleRecord):
        raise ValueError(f"record: expected an OracleRecord, got {type(record).__name__}")
    logp = check_array("record.draft.logp", record.draft.logp, dtypes="float32", ndim=3)
    positions, depth_limit, k = logp.shape
    check_array("record.draft.ids", record.draft.ids, dtypes="int32", shape=(positions, depth_limit, k))
    tokens = to_numpy(check_array("record.tokens", record.tokens, dtypes=("int32", "int64"),
                                  shape=(positions + depth_limit + 1,)))
    depth = depth_limit if depth is None else check_positive_int("depth", depth)
    topk = k if topk is None else check_positive_int("topk", topk)
    if depth > depth_limit:
        raise ValueError(f"depth: at most the recorded depth {depth_limit}, got {depth}")
    if topk > k:
        raise ValueError(f"topk: at most the recorded top-k {k}, got {topk}")
    return (np.ascontiguousarray(to_numpy(logp)[:, :depth, :topk]),
            np.ascontiguousarray(to_numpy(record.draft.ids)[:, :depth, :topk]), tokens[: positions + depth + 1])
