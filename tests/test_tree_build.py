"""The reference tree build against brute force, properties, and bad input."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kdtree_lib.precision import rounding_bound
from kdtree_lib.contracts import DraftTopK, pack_mask, root_to_node_paths, tree_from_parents, unpack_mask
from kdtree_lib.draft_topk import draft_topk
from kdtree_lib.tree_build import SGLangPolicy, build_tree, prepare_build_launch

# Dyadic log-probabilities: float64 sums and differences of these are exact, so the heap's
# subtract-then-add arithmetic equals the plain path sum and ties are real ties.
DYADIC = [0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.5]


def make_draft(logp: np.ndarray, ids: np.ndarray | None = None) -> DraftTopK:
    logp = np.asarray(logp, np.float32)
    if ids is None:  # distinct token ids per row: token = 100 * depth + rank
        batch, depth, k = logp.shape
        ids = (100 * np.arange(depth)[None, :, None] + np.arange(k)[None, None, :]).repeat(batch, 0)
    return DraftTopK(logp=logp, ids=np.asarray(ids, np.int32))


def brute_force_order(logp: np.ndarray, budget: int) -> list[tuple[int, ...]]:
    """Every finite path as a rank tuple, ordered by (-log w, rank tuple); the first `budget`."""
    depth_limit, k = logp.shape
    paths = []
    for depth in range(1, depth_limit + 1):
        for ranks in itertools.product(range(k), repeat=depth):
            weight = sum(float(logp[d, r]) for d, r in enumerate(ranks))
            if np.isfinite(weight):
                paths.append((-weight, ranks))
    return [ranks for _, ranks in sorted(paths)[:budget]]


def rank_tuples(tree, b: int) -> list[tuple[int, ...]]:
    """Each non-root node's rank tuple, read back from its token ids (token = 100 * depth + rank)."""
    tokens = tree.tokens[b]
    return [tuple(int(tokens[n]) % 100 for n in path[1:]) for path in root_to_node_paths(tree, b)[1:]]


def sorted_dyadic_rows(draw, batch, depth, k, allow_neg_inf=True):
    values = DYADIC + ([-np.inf] if allow_neg_inf else [])
    flat = draw(st.lists(st.sampled_from(values), min_size=batch * depth * k, max_size=batch * depth * k))
    return -np.sort(-np.array(flat, np.float64).reshape(batch, depth, k), axis=-1)


@st.composite
def tie_heavy_drafts(draw):
    batch = draw(st.integers(1, 3))
    depth = draw(st.integers(1, 4))
    k = draw(st.integers(1, 4))
    logp = sorted_dyadic_rows(draw, batch, depth, k)
    if draw(st.booleans()):  # repeated rows
        logp[:, :] = logp[:, :1]
    budget = draw(st.integers(1, 80))
    return logp, budget


# ----------------------------------------------------------------------------------------------
# exact order: the heap equals a global sort by (key, rank tuple), ties included

@settings(max_examples=150, deadline=None)
@given(tie_heavy_drafts())
def test_pop_order_equals_brute_force_including_ties(case):
    logp, budget = case
    tree = build_tree(make_draft(logp), budget)
    for b in range(logp.shape[0]):
        assert rank_tuples(tree, b) == brute_force_order(logp[b], budget)


def test_random_continuous_drafts_match_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(20):
        logits = rng.normal(size=(2, 3, 5)) * 2
        draft = draft_topk(logits.astype(np.float32), 5)
        tree = build_tree(make_draft(draft.logp), 40)
        for b in range(2):
            assert rank_tuples(tree, b) == brute_force_order(draft.logp[b], 40)


# ----------------------------------------------------------------------------------------------
# structural properties on random and tie-heavy inputs

@settings(max_examples=150, deadline=None)
@given(tie_heavy_drafts())
def test_tree_properties(case):
    logp, budget = case
    batch, depth_limit, k = logp.shape
    draft = make_draft(logp)
    tree = build_tree(draft, budget, root=np.arange(batch, dtype=np.int32) + 7)
    assert tree.capacity == budget + 1 and tree.max_depth == depth_limit
    finite = np.isfinite(logp).sum(axis=-1)  # (B, D) usable entries per position
    for b in range(batch):
        n = tree.n_nodes[b]
        possible = sum(int(np.prod(finite[b, :d])) for d in range(1, depth_limit + 1))
        assert n == min(budget, possible) + 1
        assert tree.tokens[b, 0] == b + 7 and tree.parents[b, 0] == -1 and tree.depths[b, 0] == 0
        for i in range(1, n):
            parent = tree.parents[b, i]
            assert 0 <= parent < i
            assert tree.depths[b, i] == tree.depths[b, parent] + 1 <= depth_limit
        # padding
        assert (tree.parents[b, n:] == -1).all() and (tree.tokens[b, n:] == 0).all()
        assert (tree.depths[b, n:] == 0).all() and np.isneginf(tree.log_weights[b, n:]).all()
        # best-first: log-weights non-increasing in pop order (up to float64 rounding)
        rounding = rounding_bound(np.float64, terms=2 * n, magnitude=np.abs(tree.log_weights[b, 1:n]).max(initial=0))
        assert (np.diff(tree.log_weights[b, 1:n]) <= rounding).all()  # a weight is <= 2n adds from the root's
        # children lists: pop order, all children of each node, distinct tokens among siblings
        for v in range(n):
            children, child = [], tree.first_child[b, v]
            while child >= 0:
                children.append(child)
                child = tree.next_sibling[b, child]
            assert children == [i for i in range(1, n) if tree.parents[b, i] == v]
            assert len({tree.tokens[b, c] for c in children}) == len(children)
    # mask = ancestor closure
    bits = unpack_mask(tree.mask, tree.capacity)
    for b in range(batch):
        for i in range(tree.capacity):
            ancestors, v = {i}, i
            while tree.parents[b, v] >= 0:
                v = tree.parents[b, v]
                ancestors.add(v)
            assert set(np.flatnonzero(bits[b, i])) == ancestors


@settings(max_examples=60, deadline=None)
@given(tie_heavy_drafts())
def test_chain_mode_is_the_argmax_path(case):
    logp, budget = case
    batch, depth_limit, _ = logp.shape
    draft = make_draft(logp)
    chain = build_tree(draft, budget, mode="chain")
    assert chain.capacity == min(budget, depth_limit) + 1
    for b in range(batch):
        usable = int(np.argmin(np.append(np.isfinite(logp[b, :, 0]), False)))  # leading finite top-1s
        n = min(budget, usable) + 1
        assert chain.n_nodes[b] == n
        assert list(chain.parents[b, 1:n]) == list(range(n - 1))
        assert list(chain.tokens[b, 1:n]) == list(draft.ids[b, : n - 1, 0])
        top1 = logp[b, : n - 1, 0]
        np.testing.assert_allclose(chain.log_weights[b, 1:n], np.cumsum(top1), rtol=0,
                                   atol=rounding_bound(np.float64, terms=n, magnitude=np.abs(top1).sum()))


def test_small_cases_edge_shapes():
    # K=1 and D=1 and a budget above the number of possible nodes
    assert build_tree(make_draft(np.zeros((1, 3, 1))), 10).n_nodes[0] == 4
    tree = build_tree(make_draft(np.log(np.full((2, 1, 4), 0.25))), 100)
    assert list(tree.n_nodes) == [5, 5] and tree.capacity == 101
    # a row of -inf ends the tree at that depth
    logp = np.array([[[0.0, -1.0], [-np.inf, -np.inf]]])
    assert build_tree(make_draft(logp), 8).n_nodes[0] == 3
    # requests in one batch with different drafts get different trees
    rng = np.random.default_rng(3)
    drafts = draft_topk(rng.normal(size=(2, 4, 30)).astype(np.float32) * 3, 8)
    tree = build_tree(drafts, 16)
    assert not np.array_equal(tree.tokens[0], tree.tokens[1])


def test_tree_from_parents_and_mask_packing():
    parents = np.array([[-1, 0, 0, 1, 3, -1, -1]])
    tree = tree_from_parents(parents, np.arange(7)[None])
    assert tree.n_nodes[0] == 5 and list(tree.depths[0]) == [0, 1, 1, 2, 3, 0, 0]
    assert list(tree.first_child[0]) == [1, 3, -1, 4, -1, -1, -1]
    assert list(tree.next_sibling[0]) == [-1, 2, -1, -1, -1, -1, -1]
    bits = np.random.default_rng(0).random((3, 70, 70)) < 0.3
    packed = pack_mask(bits)
    assert packed.dtype == np.uint32 and packed.shape == (3, 70, 3)
    assert np.array_equal(unpack_mask(packed, 70), bits)
    assert pack_mask(np.eye(33, dtype=bool))[32, 1] == 1 and pack_mask(np.eye(33, dtype=bool))[31, 0] == 1 << 31
    with pytest.raises(ValueError, match="parent must precede"):
        tree_from_parents(np.array([[-1, 2, 0]]), np.zeros((1, 3)))


# ----------------------------------------------------------------------------------------------
# bad input names the argument

def test_build_tree_rejects_bad_input():
    good = make_draft(np.log(np.full((2, 3, 4), 0.25)))
    cases = [
        (dict(draft=good, budget=0), "budget: expected a positive integer"),
        (dict(draft=good, budget=-3), "budget: expected a positive integer"),
        (dict(draft=good, budget=1025), "budget: at most 1024"),
        (dict(draft=good, budget=2.0), "budget: expected a positive integer"),
        (dict(draft=(good.logp, good.ids), budget=4), "draft: expected a DraftTopK"),
        (dict(draft=DraftTopK(good.logp.astype(np.float64), good.ids), budget=4), "draft.logp: expected dtype float32"),
        (dict(draft=DraftTopK(good.logp, good.ids[:1]), budget=4), "draft.ids: expected shape"),
        (dict(draft=DraftTopK(good.logp, good.ids.astype(np.int64)), budget=4), "draft.ids: expected dtype int32"),
        (dict(draft=make_draft(np.full((1, 2, 2), np.nan)), budget=4), "draft.logp: contains NaN"),
        (dict(draft=make_draft(np.array([[[-1.0, 0.0]]])), budget=4), "sorted in descending order"),
        (dict(draft=make_draft(np.array([[[2.5, 1.0]]])), budget=4), "draft.logp: log-probabilities must be <= 0"),
        (dict(draft=make_draft(np.full((1, 2, 2), np.inf)), budget=4), r"draft.logp: contains \+inf"),
        (dict(draft=good, budget=4, policy="beam"), "policy: expected one of"),
        (dict(draft=good, budget=4, root=np.zeros(3, np.int32)), "root: expected shape"),
        (dict(draft=good, budget=4, mode="beam"), "mode: expected one of"),
        (dict(draft=good, budget=4, backend="gpu"), "backend: expected one of"),
        (dict(draft=make_draft(np.zeros((1, 33, 2))), budget=4), "depth D must be in 1..32"),
        (dict(draft=make_draft(np.zeros((1, 0, 2))), budget=4), "depth D must be in 1..32"),
        (dict(draft=DraftTopK(good.logp, -good.ids - 1), budget=4), "draft.ids: token ids must be >= 0, got -204"),
        (dict(draft=good, budget=4, root=np.array([5, -1], np.int32)), "root: token ids must be >= 0, got -1"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            build_tree(**kwargs)
    with pytest.raises(ValueError, match="backend: 'cupy' needs"):
        build_tree(good, 4, backend="cupy")


# ----------------------------------------------------------------------------------------------
# the other policies (docs/DESIGN.md, tree policies)

@settings(max_examples=100, deadline=None)
@given(tie_heavy_drafts())
def test_spine_first_is_the_chain_then_the_papers_order(case):
    logp, budget = case
    draft = make_draft(logp)
    tree = build_tree(draft, budget, policy="spine_first")
    chain = build_tree(draft, budget, mode="chain")
    for b in range(logp.shape[0]):
        spine = int(chain.n_nodes[b]) - 1
        assert list(tree.tokens[b, 1:spine + 1]) == list(chain.tokens[b, 1:spine + 1])
        assert list(tree.parents[b, 1:spine + 1]) == list(range(spine))
        # past the spine: every other path in the paper's (weight, rank tuple) order
        rest = [ranks for ranks in brute_force_order(logp[b], 10 ** 6) if any(ranks)]
        assert rank_tuples(tree, b)[spine:] == rest[:budget - spine]


@settings(max_examples=100, deadline=None)
@given(tie_heavy_drafts())
def test_sglang_policy_keeps_its_invariants(case):
    logp, budget = case
    batch, depth_limit, k = logp.shape
    policy = SGLangPolicy()
    tree = build_tree(make_draft(logp), budget, policy=policy)
    width = policy.width(budget, depth_limit)
    for b in range(batch):
        n = int(tree.n_nodes[b])
        depths, parents = tree.depths[b, 1:n], tree.parents[b, 1:n]
        assert (np.diff(depths) >= 0).all() and (np.diff(parents) >= 0).all(), "breadth-first, parent-grouped"
        assert all(int(ranks[-1]) < width for ranks in rank_tuples(tree, b)), "at most `width` candidates"
        if budget == depth_limit:
            assert list(parents) == list(range(n - 1)), "budget == D: the top-1 chain"


def test_policies_check_their_parameters():
    good = make_draft(np.log(np.full((2, 3, 4), 0.25)))
    cases = [(SGLangPolicy(max_topk=0), "policy.max_topk: expected an integer in 1..1024"),
             (SGLangPolicy(max_topk=2.5), "policy.max_topk"),
             (SGLangPolicy(depth_bonus=float("nan")), "policy.depth_bonus: expected a finite number"),
             (SGLangPolicy(stop_margin=float("inf")), "policy.stop_margin: expected a finite number"),
             ("beam", "policy: expected one of")]
    for policy, match in cases:
        with pytest.raises(ValueError, match=match):
            build_tree(good, 4, policy=policy)
    with pytest.raises(ValueError, match="policy: the kernel builds the 'paper' policy"):
        prepare_build_launch(good, 4, policy="sglang")


def test_sglang_layout_kernel_builds_only_the_sglang_and_paper_policies():
    from kdtree_lib.tree_build import SGLangBuildLaunch
    with pytest.raises(ValueError, match="policy: SGLang's layout is built for the 'sglang' and 'paper' policies"):
        SGLangBuildLaunch(1, 7, 6, 32, 0, policy="spine_first", ids_int64=True)
