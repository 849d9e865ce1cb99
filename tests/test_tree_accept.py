"""The reference walk: lossless at T=0 and T>0 on toy targets, compaction, and bad input."""
import numpy as np
import pytest
import torch

from kdtree_lib.contracts import AcceptResult, root_to_node_paths, tree_from_parents
from kdtree_lib.tree_accept import accept, compact_cache, compaction_plan, posterior_tokens
from kdtree_lib.draft_topk import draft_topk
from kdtree_lib.tree_build import build_tree

VOCAB = 12


def greedy_next(context: list[int]) -> int:
    """A toy deterministic target: the next token depends on the last two tokens and the length."""
    previous = context[-2] if len(context) > 1 else 0
    return (7 * context[-1] + 3 * previous + len(context)) % VOCAB


def autoregressive(prompt: list[int], n: int) -> list[int]:
    out = list(prompt)
    while len(out) < len(prompt) + n:
        out.append(greedy_next(out))
    return out[len(prompt):]


def noisy_draft_logits(contexts, depth, rng):
    """A drafter that guesses the target's greedy continuation right about 60% of the time."""
    logits = rng.normal(size=(len(contexts), depth, VOCAB)).astype(np.float32)
    for b, context in enumerate(contexts):
        for d, token in enumerate(autoregressive(context, depth)):
            guess = token if rng.random() < 0.6 else int(rng.integers(VOCAB))
            logits[b, d, guess] += 3.0
    return logits


def emitted_tokens(tree, result, b):
    path = result.path[b, : result.n_accepted[b]]
    return [int(tree.tokens[b, node]) for node in path[1:]] + [int(result.bonus[b])]


@pytest.mark.parametrize("budget, mode", [(1, "tree"), (6, "tree"), (24, "tree"), (4, "chain")])
def test_greedy_ddtree_equals_autoregressive(budget, mode):
    rng = np.random.default_rng(budget)
    prompts = [[1, 2], [5], [3, 3, 9]]
    outputs = [[] for _ in prompts]
    target_len = 30
    accepted_lengths = []
    while min(len(o) for o in outputs) < target_len:
        contexts = [p + o for p, o in zip(prompts, outputs)]
        draft = draft_topk(noisy_draft_logits(contexts, 4, rng), budget)
        tree = build_tree(draft, budget, root=np.array([c[-1] for c in contexts], np.int32), mode=mode)
        posterior = np.zeros((tree.batch, tree.capacity), np.int32)
        for b, context in enumerate(contexts):
            for node, path in enumerate(root_to_node_paths(tree, b)):
                posterior[b, node] = greedy_next(context + [int(tree.tokens[b, n]) for n in path[1:]])
        result = accept(tree, posterior)
        for b in range(len(prompts)):
            outputs[b] += emitted_tokens(tree, result, b)
        accepted_lengths += list(result.n_accepted)
    for prompt, output in zip(prompts, outputs):
        assert output[:target_len] == autoregressive(prompt, target_len)
    assert max(accepted_lengths) > 1  # the drafts were actually used


def bigram_table(rng, vocab):
    return rng.dirichlet(np.full(vocab, 0.7), size=vocab)


def first_two_tokens(table, root, walk, rng, trials=4000, budget=6, depth=3):
    """Decode two tokens after `root` for `trials` requests with DDTree rounds and return them."""
    outputs = [[] for _ in range(trials)]
    roots = np.full(trials, root, np.int32)
    while min(len(o) for o in outputs) < 2:
        drafter_logits = np.log(table[roots]).astype(np.float32)[:, None, :].repeat(depth, 1)
        drafter_logits += rng.normal(size=drafter_logits.shape).astype(np.float32)
        tree = build_tree(draft_topk(drafter_logits, budget), budget, root=roots)
        node_probs = table[tree.tokens]  # (B, N, V): a bigram target depends on the node's token only
        posterior = posterior_tokens(np.log(node_probs), temperature=1.0, generator=rng)
        result = walk(tree, posterior)
        for b in range(trials):
            outputs[b] += emitted_tokens(tree, result, b)
        roots = np.array([o[-1] for o in outputs], np.int32)
    return np.array([o[:2] for o in outputs])


def chi_square_p_value(samples, expected_probs):
    counts = np.bincount(samples[:, 0] * len(expected_probs) + samples[:, 1],
                         minlength=expected_probs.size).astype(np.float64)
    expected = expected_probs.ravel() * len(samples)
    keep = expected > 5
    statistic = float((((counts - expected) ** 2) / expected)[keep].sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(statistic / 2.0, dtype=torch.float64)))


def draft_greedy_walk(tree, posterior):
    """A deliberately wrong walk: follows the drafter's first child whatever the target said."""
    result = accept(tree, posterior)
    for b in range(tree.batch):
        child = tree.first_child[b, 0]
        if child >= 0:
            result.path[b, :2] = [0, child]
            result.path[b, 2:] = -1
            result.n_accepted[b] = 2
            result.bonus[b] = posterior[b, child]
    return result


def test_sampled_walk_reproduces_the_target_distribution():
    rng = np.random.default_rng(7)
    table = bigram_table(rng, 4)
    root = 2
    expected = table[root][:, None] * table  # P(t1 | root) P(t2 | t1)
    samples = first_two_tokens(table, root, accept, rng)
    assert chi_square_p_value(samples, expected) > 1e-3
    # the check is not vacuous: a walk that trusts the drafter is rejected
    wrong = first_two_tokens(table, root, draft_greedy_walk, rng)
    assert chi_square_p_value(wrong, expected) < 1e-6


def test_posterior_tokens_greedy_and_sampled_in_both_frameworks():
    logits = np.log(np.array([[[0.1, 0.7, 0.2], [0.5, 0.25, 0.25]]]))
    assert posterior_tokens(logits).tolist() == [[1, 0]]
    assert posterior_tokens(torch.from_numpy(logits)).tolist() == [[1, 0]]
    many = np.log(np.full((1, 5000, 3), 1 / 3))
    draws = posterior_tokens(many, temperature=0.5, generator=np.random.default_rng(0))
    assert draws.dtype == np.int32 and set(np.unique(draws)) == {0, 1, 2}
    torch_draws = posterior_tokens(torch.from_numpy(many), temperature=2.0)
    assert torch_draws.dtype == torch.int32 and torch_draws.shape == (1, 5000)
    with pytest.raises(ValueError, match="temperature"):
        posterior_tokens(logits, temperature=-1.0)
    with pytest.raises(ValueError, match="target_logits: contains NaN"):
        posterior_tokens(np.full((1, 2, 3), np.nan))
    one_nan = torch.from_numpy(logits.copy())
    one_nan[0, 1, 2] = float("nan")  # torch's argmax would answer 2, the NaN's index
    for temperature in (0.0, 1.0):
        with pytest.raises(ValueError, match="target_logits: contains NaN"):
            posterior_tokens(one_nan, temperature=temperature)
    for temperature in (float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="temperature: expected a finite number >= 0"):
            posterior_tokens(logits, temperature=temperature)


def hand_tree():
    # root 0 -> 1 (tok 10) -> 3 (tok 30) -> 4 (tok 40); root -> 2 (tok 20); slot 5 is padding
    parents = np.array([[-1, 0, 0, 1, 3, -1], [-1, 0, 1, 2, 0, -1]])
    tokens = np.array([[9, 10, 20, 30, 40, 0], [9, 11, 12, 13, 14, 0]])
    return tree_from_parents(parents, tokens, max_depth=4)


def test_walk_on_a_hand_made_tree():
    tree = hand_tree()
    posterior = np.array([[10, 30, 0, 41, 0, 0], [14, 0, 0, 0, 77, 0]], np.int32)
    result = accept(tree, posterior)
    assert result.path.tolist() == [[0, 1, 3, -1, -1], [0, 4, -1, -1, -1]]
    assert result.n_accepted.tolist() == [3, 2] and result.bonus.tolist() == [41, 77]


def test_compaction_moves_accepted_entries_and_advances_lengths():
    tree = hand_tree()
    result = accept(tree, np.array([[10, 30, 0, 40, 5, 0], [12, 0, 0, 0, 0, 0]], np.int32))
    lengths = np.array([3, 0], np.int32)
    source, destination = compaction_plan(result, lengths)
    assert source.tolist() == [[3, 4, 6, 7, -1], [0, -1, -1, -1, -1]]
    assert destination.tolist() == [[3, 4, 5, 6, -1], [0, -1, -1, -1, -1]]
    rng = np.random.default_rng(0)
    caches = [rng.normal(size=(2, 12, 5)) for _ in range(3)]
    before = [c.copy() for c in caches]
    torch_caches = [torch.from_numpy(c.copy()) for c in caches]
    new_lengths = compact_cache(caches, lengths, result)
    assert new_lengths.tolist() == [7, 1]
    for cache, old in zip(caches, before):
        np.testing.assert_array_equal(cache[0, :3], old[0, :3])  # the committed prefix is untouched
        np.testing.assert_array_equal(cache[0, 3:7], old[0, [3, 4, 6, 7]])
        np.testing.assert_array_equal(cache[1, :1], old[1, :1])
    torch_lengths = compact_cache(torch_caches, torch.from_numpy(lengths), result)
    assert torch_lengths.tolist() == [7, 1] and torch_lengths.dtype == torch.int32
    for cache, expected in zip(torch_caches, caches):
        np.testing.assert_array_equal(cache.numpy(), expected)


def test_accept_and_compaction_reject_bad_input():
    tree = hand_tree()
    good = np.zeros((2, 6), np.int32)
    with pytest.raises(ValueError, match="posterior: expected shape"):
        accept(tree, np.zeros((2, 5), np.int32))
    with pytest.raises(ValueError, match="posterior: expected dtype"):
        accept(tree, good.astype(np.float32))
    with pytest.raises(ValueError, match="tree: expected a Tree"):
        accept(tree.tokens, good)
    negative = good.copy()
    negative[1, 0] = -3  # the root's posterior: it would come back as the bonus token
    with pytest.raises(ValueError, match="posterior: token ids must be >= 0, got -3"):
        accept(tree, negative)
    with pytest.raises(ValueError, match="posterior: token ids must be >= 0"):
        accept(tree, torch.from_numpy(negative.astype(np.int64)))
    with pytest.raises(ValueError, match="posterior: token ids must be < vocab=5, got 5"):
        accept(tree, np.full((2, 6), 5, np.int32), vocab=5)
    with pytest.raises(ValueError, match="vocab: expected a positive integer"):
        accept(tree, good, vocab=0)
    assert accept(tree, np.full((2, 6), 4, np.int32), vocab=5).n_accepted.min() >= 1
    result = accept(tree, good)
    with pytest.raises(ValueError, match="caches: expected a non-empty list"):
        compact_cache([], np.zeros(2, np.int32), result)
    with pytest.raises(ValueError, match=r"caches\[1\]: expected shape"):
        compact_cache([np.zeros((2, 8, 4)), np.zeros((3, 8, 4))], np.zeros(2, np.int32), result)
    with pytest.raises(ValueError, match="lengths: expected dtype"):
        compact_cache([np.zeros((2, 8, 4))], np.zeros(2, np.float32), result)
    with pytest.raises(ValueError, match="past L_max"):
        compact_cache([np.zeros((2, 8, 4))], np.array([7, 0], np.int32),
                      AcceptResult(path=np.array([[0, 1], [0, -1]]), n_accepted=np.array([2, 1]),
                                   bonus=np.zeros(2, np.int32)))


@pytest.mark.parametrize("lengths, path, n_accepted, message", [
    ([4, -2], [[0, 1], [0, -1]], [2, 1], "lengths: expected committed lengths >= 0, got -2"),
    ([0, 3], [[0, 1], [0, -1]], [1, 1], r"result.n_accepted: \[1, 1\] disagrees with the paths' lengths \[2, 1\]"),
    ([0, 3], [[0, 1], [0, -1]], [2, 2], "result.n_accepted"),
    ([0, 3], [[0, -1], [0, 2]], [1, 1], "result.n_accepted"),
    ([0, 3], [[1, 2], [0, -1]], [2, 1], "start at the root"),
    ([0, 3], [[0, -1, 2], [0, -1, -1]], [2, 1], "start at the root"),
    ([0, 3], [[0, 2, 1], [0, -1, -1]], [3, 1], "node indices must increase"),
])
def test_compaction_refuses_values_that_would_move_the_wrong_slots(lengths, path, n_accepted, message):
    """A negative length overwrote another request's slot; an n_accepted disagreeing with its path was
    taken as is (it advances the lengths): both refused before anything moves."""
    caches = [np.arange(2 * 8 * 3, dtype=np.float32).reshape(2, 8, 3)]
    before = caches[0].copy()
    result = AcceptResult(path=np.array(path, np.int32), n_accepted=np.array(n_accepted, np.int32),
                          bonus=np.zeros(2, np.int32))
    for cache_list, length_array in ((caches, np.array(lengths, np.int32)),
                                     ([torch.from_numpy(caches[0])], torch.tensor(lengths, dtype=torch.int32))):
        with pytest.raises(ValueError, match=message):
            compact_cache(cache_list, length_array, result)
    np.testing.assert_array_equal(caches[0], before)
