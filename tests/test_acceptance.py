"""The offline acceptance oracle equals a live greedy decode's acceptance, round for round."""
import numpy as np
import pytest

from kdtree_lib.acceptance import OracleRecord, accepted_at_every_position, mean_acceptance, round_lengths
from kdtree_lib.tree_accept import accept
from kdtree_lib.contracts import DraftTopK, root_to_node_paths
from kdtree_lib.draft_topk import draft_topk
from kdtree_lib.tree_build import build_tree

VOCAB, DEPTH, TOPK = 16, 5, 6


def greedy_next(context):
    return (5 * context[-1] + 3 * len(context) + (context[-2] if len(context) > 1 else 1)) % VOCAB


def drafter_topk(context):
    """A deterministic toy drafter: noisy logits seeded by the context, biased to the truth."""
    rng = np.random.default_rng(hash(tuple(context)) % 2**32)
    logits = rng.normal(size=(1, DEPTH, VOCAB)).astype(np.float32)
    truth = list(context)
    for d in range(DEPTH):
        truth.append(greedy_next(truth))
        if rng.random() < 0.7:
            logits[0, d, truth[-1]] += 2.5
    return draft_topk(logits, TOPK)


def live_rounds(prompt, n_new, budget, mode):
    context, rounds = list(prompt), []
    while len(context) - len(prompt) < n_new:
        draft = drafter_topk(context)
        tree = build_tree(draft, budget, root=np.array([context[-1]], np.int32), mode=mode)
        posterior = np.array([[greedy_next(context + [int(tree.tokens[0, n]) for n in path[1:]])
                               for path in root_to_node_paths(tree, 0)]
                              + [0] * (tree.capacity - tree.n_nodes[0])], np.int32)
        result = accept(tree, posterior)
        path = result.path[0, : result.n_accepted[0]]
        context += [int(tree.tokens[0, n]) for n in path[1:]] + [int(result.bonus[0])]
        rounds.append(int(result.n_accepted[0]))
    return rounds


def record(prompt, n_positions):
    tokens = list(prompt)
    while len(tokens) < len(prompt) + n_positions + DEPTH:
        tokens.append(greedy_next(tokens))
    drafts = [drafter_topk(tokens[: len(prompt) + t]) for t in range(n_positions)]
    return OracleRecord(draft=DraftTopK(np.concatenate([d.logp for d in drafts]), np.concatenate([d.ids for d in drafts])),
                        tokens=np.array(tokens[len(prompt) - 1:], np.int32))


@pytest.mark.parametrize("budget, mode", [(1, "tree"), (8, "tree"), (32, "tree"), (5, "chain")])
def test_oracle_equals_live_decode(budget, mode):
    prompt, n_new = [3, 1, 4], 40
    live = live_rounds(prompt, n_new, budget, mode)
    oracle = round_lengths(accepted_at_every_position(record(prompt, n_new), budget, mode=mode))
    assert oracle == live[: len(oracle)] and sum(oracle) >= n_new
    assert max(live) > 1


def test_depth_and_topk_slices_and_monotone_budget():
    rec = record([2, 7], 30)
    # a bigger budget's tree extends the smaller one's pop order, so it accepts at least as much
    per_budget = [accepted_at_every_position(rec, budget) for budget in (1, 4, 16, 64)]
    assert all((small <= big).all() for small, big in zip(per_budget, per_budget[1:]))
    assert mean_acceptance([rec], 1) >= 1 and mean_acceptance([rec], 64) > mean_acceptance([rec], 1)
    shallow = accepted_at_every_position(rec, 64, depth=2, topk=3)
    assert shallow.max() <= 3
    with pytest.raises(ValueError, match="depth: at most the recorded depth"):
        accepted_at_every_position(rec, 8, depth=DEPTH + 1)
    with pytest.raises(ValueError, match="topk: at most the recorded top-k"):
        accepted_at_every_position(rec, 8, topk=TOPK + 1)
    with pytest.raises(ValueError, match="record.tokens: expected shape"):
        accepted_at_every_position(OracleRecord(rec.draft, rec.tokens[:-1]), 8)


def test_largest_measurement_reports_the_biggest_run_not_the_newest():
    from kdtree_lib.acceptance import largest_measurement
    row = dict(source="oracle", block_size="8", mode="tree", temperature="0.0", pair="p", device="d")
    gpu = [dict(row, date="2026-01-01T00:00:00Z", commit="a", package=package, budget=str(b), prompts=prompts,
                new_tokens="256", mean_acceptance=str(a))
           for package, prompts in (("networkx", "32"), ("numpyro", "16")) for b, a in ((8, 3.7), (32, 4.2))]
    cpu = [dict(row, date="2026-01-02T00:00:00Z", commit="b", package="networkx", budget=str(b), prompts="40",
                new_tokens="8", mean_acceptance="1.6") for b in (8, 32)]
    chosen = largest_measurement(gpu + cpu, mode="tree", temperature=0)
    assert len(chosen) == 4 and {r["commit"] for r in chosen} == {"a"}    # both packages of the GPU run
    assert sorted(r["mean_acceptance"] for r in chosen) == ["3.7", "3.7", "4.2", "4.2"]
    assert largest_measurement(gpu + cpu, mode="chain") == []
