"""draft_topk: exactly the official formula, torch's float32 `topk(logits) - logsumexp(logits)`, ties included.

CPU: bit for bit against torch's CPU ops on tie-heavy logits, and bad input. With KDTREE_OFFICIAL_DIR (a
local copy of the official code, never committed): build_tree(draft_topk(logits)) is the official
build_ddtree_tree's tree node for node on tie-heavy logits up to budget 1024, on the CPU and (`-m gpu`)
on the GPU.
"""
import os

import numpy as np
import pytest
import torch

from kdtree_lib.draft_topk import draft_topk, prepare_draft_topk
from kdtree_lib.tree_build import build_tree

OFFICIAL_DIR = os.environ.get("KDTREE_OFFICIAL_DIR")
needs_official = pytest.mark.skipif(not OFFICIAL_DIR, reason="KDTREE_OFFICIAL_DIR (a local copy of the official code) not set")
STYLES = ("normal", "repeated", "integer_ties", "constant")


def tie_heavy_logits(style: str, batch: int, depth: int, vocab: int, seed: int) -> np.ndarray:
    """float32 logits [B, D, V]: normal; one distribution at every position of every request
    ("repeated"); a few distinct values permuted over the vocabulary (exact ties everywhere); or one
    value everywhere (every token tied)."""
    rng = np.random.default_rng(seed)
    if style == "normal":
        return (rng.standard_normal((batch, depth, vocab)) * 3).astype(np.float32)
    if style == "repeated":
        row = (rng.standard_normal(vocab) * 3).astype(np.float32)
        return np.broadcast_to(row, (batch, depth, vocab)).copy()
    if style == "integer_ties":
        values = rng.integers(0, 4, size=vocab).astype(np.float32)
        return np.stack([rng.permutation(values) for _ in range(batch * depth)]).reshape(batch, depth, vocab)
    if style == "constant":
        return np.full((batch, depth, vocab), 1.5, np.float32)
    raise ValueError(style)


def official_formula(request: torch.Tensor, k: int):
    """What the official build_ddtree_tree computes from one request's logits [D, V]."""
    values, ids = torch.topk(request.float(), k=min(k, request.shape[-1]), dim=-1)
    return (values - torch.logsumexp(request.float(), dim=-1, keepdim=True)).cpu(), ids.int().cpu()


# ----------------------------------------------------------------------------------------------
# CPU: exact values and ids

@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("batch, depth, vocab, k", [(3, 7, 300, 64), (2, 4, 64, 64), (1, 1, 40_000, 1024),
                                                    (2, 1, 40_000, 8), (2, 3, 1024, 1024)])
def test_cpu_path_is_torchs_formula_bit_for_bit(style, batch, depth, vocab, k):
    logits = tie_heavy_logits(style, batch, depth, vocab, seed=batch * vocab + k)
    draft = draft_topk(logits, k)
    assert draft.logp.dtype == np.float32 and draft.ids.dtype == np.int32
    assert draft.logp.shape == (batch, depth, min(k, vocab))
    for b in range(batch):
        want_logp, want_ids = official_formula(torch.from_numpy(logits[b]), k)
        assert np.array_equal(draft.logp[b].view(np.uint32), want_logp.numpy().view(np.uint32)), (style, b)
        assert np.array_equal(draft.ids[b], want_ids.numpy()), (style, b)


def test_torch_backend_keeps_torch_tensors_and_values():
    logits = torch.from_numpy(tie_heavy_logits("integer_ties", 2, 3, 500, seed=4))
    got = draft_topk(logits, 32, backend="torch")
    assert isinstance(got.logp, torch.Tensor) and got.ids.dtype == torch.int32
    want = draft_topk(logits.numpy(), 32, backend="numpy")
    assert np.array_equal(got.logp.numpy(), want.logp) and np.array_equal(got.ids.numpy(), want.ids)


def test_lower_precision_logits_are_widened_first():
    logits = torch.randn(2, 3, 100, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    got = draft_topk(logits, 10)
    want_logp, want_ids = official_formula(logits[1], 10)
    assert np.array_equal(got.logp[1], want_logp.numpy()) and np.array_equal(got.ids[1], want_ids.numpy())


def test_masked_vocabulary_keeps_neg_inf_tails():
    logits = torch.randn(1, 2, 10)
    logits[..., 3:] = float("-inf")
    draft = draft_topk(logits, 5)
    assert np.isneginf(draft.logp[..., 3:]).all() and np.isfinite(draft.logp[..., :3]).all()
    assert build_tree(draft, 20).n_nodes[0] == 3 + 9 + 1


# ----------------------------------------------------------------------------------------------
# bad input names the argument, before any work

def _with(value, where=(0, 1, 2)):
    logits = np.zeros((2, 3, 8), np.float32)
    logits[where] = value
    return logits


@pytest.mark.parametrize("logits, k, backend, match", [
    (np.zeros((2, 3, 4), np.int32), 2, "auto", "logits: expected dtype"),
    (np.zeros((3, 4), np.float32), 2, "auto", "logits: expected 3 dimensions"),
    (np.zeros((1, 2, 0), np.float32), 2, "auto", "logits: the vocabulary axis is empty"),
    (np.zeros((1, 0, 5), np.float32), 2, "auto", "logits: the draft depth D"),
    (_with(np.nan), 2, "auto", "logits: contains NaN"),
    (_with(np.inf), 2, "auto", r"logits: contains \+inf"),
    (_with(-np.inf, (1, 2)), 2, "numpy", "logits: a row is entirely -inf"),
    (np.zeros((1, 1, 4), np.float32), 0, "auto", "k: expected a positive integer"),
    (np.zeros((1, 1, 4), np.float32), 2.5, "auto", "k: expected a positive integer"),
    ([[[0.0]]], 2, "auto", "logits: expected a numpy array"),
    (np.zeros((1, 1, 4), np.float32), 2, "gpu", "backend: expected one of"),
])
def test_bad_input_raises(logits, k, backend, match):
    with pytest.raises(ValueError, match=match):
        draft_topk(logits, k, backend=backend)


def test_the_fused_kernel_needs_device_logits():
    with pytest.raises(ValueError, match="backend: 'cupy'"):
        draft_topk(np.zeros((1, 1, 4), np.float32), 2, backend="cupy")
    with pytest.raises(ValueError, match="backend: 'cupy'"):
        prepare_draft_topk(np.zeros((1, 1, 4), np.float32), 2)
    with pytest.raises(ValueError, match="logits: expected dtype float32"):
        prepare_draft_topk(np.zeros((1, 1, 4), np.float16), 2)


# ----------------------------------------------------------------------------------------------
# the official code's tree from logits (KDTREE_OFFICIAL_DIR)

OFFICIAL_CASES = [  # (style, depth, vocab, budget)
    ("normal", 7, 3000, 64),
    ("repeated", 7, 3000, 256),
    ("repeated", 15, 2000, 1024),
    ("integer_ties", 7, 1500, 512),
    ("integer_ties", 15, 1024, 1024),   # K = V
    ("constant", 4, 50, 1024),          # K = V, every token tied, the heap empties before the budget
    ("constant", 7, 1024, 1024),
]


def assert_official_tree(ddtree, logits_2d: torch.Tensor, budget: int, context: str) -> None:
    """build_tree(draft_topk(one request's logits)) against the official build_ddtree_tree, node for node."""
    token_ids, node_depths, parents, _, _, _ = ddtree.build_ddtree_tree(logits_2d, budget)
    tree = build_tree(draft_topk(logits_2d[None], budget), budget).to_numpy()
    n = int(tree.n_nodes[0])
    assert n == len(parents), f"{n} nodes, official {len(parents)} ({context})"
    assert tree.parents[0, :n].tolist() == list(parents), context
    assert tree.tokens[0, 1:n].tolist() == token_ids.tolist(), context
    assert tree.depths[0, 1:n].tolist() == node_depths.tolist(), context


@pytest.fixture(scope="module")
def official_ddtree():
    from kdtree_lib.bench.decode import load_official
    return load_official(OFFICIAL_DIR)[0]


@needs_official
@pytest.mark.parametrize("style, depth, vocab, budget", OFFICIAL_CASES)
def test_official_tree_from_logits_on_cpu(style, depth, vocab, budget, official_ddtree, monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)  # its clock, on a CPU
    logits = torch.from_numpy(tie_heavy_logits(style, 1, depth, vocab, seed=depth * vocab + budget)[0])
    assert_official_tree(official_ddtree, logits, budget, f"{style} D={depth} V={vocab} budget={budget} cpu")


@needs_official
@pytest.mark.gpu
@pytest.mark.parametrize("style, depth, vocab, budget", OFFICIAL_CASES + [("normal", 7, 163_840, 1024)])
def test_official_tree_from_logits_on_gpu(style, depth, vocab, budget, official_ddtree):
    logits = torch.from_numpy(tie_heavy_logits(style, 1, depth, vocab, seed=depth * vocab + budget)[0]).cuda()
    assert_official_tree(official_ddtree, logits, budget, f"{style} D={depth} V={vocab} budget={budget} cuda")
