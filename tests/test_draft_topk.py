"""draft_topk: exactly the official formula, torch's float32 `topk(logits) - logsumexp(logits)`, ties included.

CPU: bit for bit against torch's CPU ops on tie-heavy logits, and bad input. With KDTREE_OFFICIAL_DIR (a
local copy of the official code, never committed): build_tree(draft_topk(logits)) is the official
build_ddtree_tree's tree node for node on tie-heavy logits up to budget 1024, on the CPU and (`-m gpu`)
on the GPU.

GPU (`-m gpu`): the fused kernels (v3 one launch of many CTAs per row for k <= 128, v1 above) against a host reference
on fresh random, tie-heavy, constant and -inf-masked logits with poisoned outputs (B in {1, 8, 64}, D in
{7, 15}, ragged k, V from 300 to 163,840), replayed in a CUDA graph, bad rows flagged without a host
read, and the trees built from them against the exact path's on the stand-in drafter's held-out logits.
"""
import os

import numpy as np
import pytest
import torch

from kdtree_lib.contracts import DraftTopK
from kdtree_lib.draft_topk import FAST_MAX_K, MAX_CHUNKS, TopKLaunch, draft_topk, prepare_draft_topk
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


# ----------------------------------------------------------------------------------------------
# benchmark rows: which top-k path ran, and issue 29's targets read from them

def test_rows_are_labelled_by_the_topk_path_that_ran():
    from kdtree_lib.bench.tree_build import topk_path_of, topk_targets
    old_exact = dict(stage="draft_topk", method="kernel", max_abs_diff_vs_torch="0.0")  # before the column
    old_fused = dict(stage="draft_topk", method="kernel", max_abs_diff_vs_torch="9.5e-07")
    assert topk_path_of(old_exact) == "exact" and topk_path_of(old_fused) == "fused_v1"
    assert topk_path_of(dict(stage="draft_topk", method="torch_flushed")) == "exact"
    assert topk_path_of(dict(stage="build", method="kernel")) == "none"
    assert topk_path_of(dict(stage="tree_stage", method="sglang")) == "sglang"
    assert topk_path_of(dict(old_exact, topk_path="fused_v3")) == "fused_v3"
    run = [dict(stage="draft_topk", method=method, batch=batch, depth=7, topk=64, roofline_us=roofline,
                time_us=time, topk_path=path)
           for batch, roofline, fused, exact in ((1, 1.1, 11.9, 104.0), (64, 69.0, 140.0, 1480.0))
           for method, time, path in (("kernel", fused, "fused_v3"), ("torch", exact, "exact"))]
    lines = {line["batch"]: line for line in topk_targets(run)}
    assert lines[1]["met"] and lines[1]["target_us"] == 12.0 and lines[1]["exact_us"] == 104.0
    assert not lines[64]["met"] and lines[64]["target_us"] == 138.0 and lines[64]["path"] == "fused_v3"


# ----------------------------------------------------------------------------------------------
# the fused kernels (backend "cupy"): v3 (one launch, many CTAs per row, k <= FAST_MAX_K) and v1 (one CTA per row)


EPS32 = float(np.finfo(np.float32).eps)


def fresh_seed() -> int:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print("seed", seed)
    return seed


def reference_topk(logits: np.ndarray, k: int):
    """The k largest logits per row, larger value first and ties by ascending id (exact float
    comparisons on the host: the candidates >= the k-th largest value, sorted by (-value, id)), and
    torch's float32 logsumexp of the row."""
    vocab = logits.shape[-1]
    top = min(k, vocab)
    rows = logits.reshape(-1, vocab)
    ids = np.empty((len(rows), top), np.int64)
    for r, row in enumerate(rows):
        kth = np.partition(row, vocab - top)[vocab - top]
        candidates = np.flatnonzero(row >= kth)
        ids[r] = candidates[np.lexsort((candidates, -row[candidates].astype(np.float64)))[:top]]
    ids = ids.reshape(logits.shape[:-1] + (top,))
    log_z = torch.logsumexp(torch.from_numpy(logits), dim=-1, keepdim=True).numpy()
    return np.take_along_axis(logits, ids, -1), ids, log_z


def assert_fused_matches(got, logits: np.ndarray, k: int, context: str, reference=None) -> None:
    """Selection exact (the ids of the reference, in its order); log-probabilities within the rounding
    of the two float32 normalisers. v3 sums 16 exps per thread in sequence, then merges 256 threads
    and V / 4096 slices by pairs (about 16 + log2 V roundings), v1 about V / 1024 + log2 V; torch's own
    sum is of the same order. Each relative error of a sum is an absolute error of its log, the exps
    add 2 ulp each, and the final subtraction rounds once at the magnitudes involved."""
    values, ids, log_z = reference if reference is not None else reference_topk(logits, k)
    values, ids = values[..., :k], ids[..., :k]  # a wider reference's prefix is the narrower one
    logp, got_ids = got.logp.cpu().numpy(), got.ids.cpu().numpy()
    assert got_ids.shape == ids.shape and got_ids.dtype == np.int32, context
    assert np.array_equal(got_ids, ids), f"ids differ at {np.argwhere(got_ids != ids)[:5].tolist()} ({context})"
    vocab = logits.shape[-1]
    roundings = 2 * (max(16, vocab / 1024) + np.log2(vocab) + 4)
    bound = EPS32 * (roundings + 2 * (np.abs(values) + np.abs(log_z)))
    error = np.abs(logp.astype(np.float64) - (values.astype(np.float64) - log_z))
    assert np.isfinite(logp).all() and (error <= bound).all(), \
        f"max error {error.max():.3g}, bound there {bound.flat[error.argmax()]:.3g} ({context})"


def styled_logits(style: str, batch: int, depth: int, vocab: int, seed: int) -> np.ndarray:
    if style == "neginf":  # a masked vocabulary: most of every row -inf, whole slices of it
        logits = tie_heavy_logits("normal", batch, depth, vocab, seed)
        logits[..., 1000:] = -np.inf
        logits[..., 7000:7100] = 2.0
        return logits
    return tie_heavy_logits(style, batch, depth, vocab, seed)


def prepared_fused(logits: np.ndarray, k: int) -> TopKLaunch:
    launch = prepare_draft_topk(torch.from_numpy(logits).cuda(), k, backend="cupy")
    launch.out.logp.view(torch.int32).fill_(0x7FA5A5A5)  # poison: a NaN pattern every element must overwrite
    launch.out.ids.fill_(-0x5A5A5A5B)
    return launch


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("depth", [7, 15])
def test_fused_topk_at_kimis_vocabulary(batch, depth):
    seed = fresh_seed()
    logits = tie_heavy_logits("normal", batch, depth, 163_840, seed)
    reference = reference_topk(logits, 1024)
    for k in (1, 8, 37, 64, FAST_MAX_K, FAST_MAX_K + 1, 1024):  # ragged k; v3 up to FAST_MAX_K, v1 above
        launch = prepared_fused(logits, k)
        assert launch.path == ("fused_v3" if k <= FAST_MAX_K else "fused_v1")
        got = launch()
        torch.cuda.synchronize()
        assert_fused_matches(got, logits, k, f"seed={seed} B={batch} D={depth} k={k}", reference)
        launch.check_input()  # nothing flagged


@pytest.mark.gpu
@pytest.mark.parametrize("style", ["normal", "repeated", "integer_ties", "constant", "neginf"])
@pytest.mark.parametrize("vocab", [163_840, 50_003, 4096, 300])  # whole slices, a ragged last slice (vec1), one slice
def test_fused_topk_ties_and_shapes(style, vocab):
    seed = fresh_seed()
    logits = styled_logits(style, 3, 7, vocab, seed) if vocab > 7100 or style != "neginf" else \
        styled_logits("normal", 3, 7, vocab, seed)
    reference = reference_topk(logits, 300)
    for k in (1, 64, FAST_MAX_K, 300):  # v3's merge: all candidates ranked (k=1), radix-selected (64, 128)
        launch = prepared_fused(logits, k)
        got = launch()
        torch.cuda.synchronize()
        assert_fused_matches(got, logits, k, f"seed={seed} {style} V={vocab} k={k} {launch.path}", reference)


@pytest.mark.gpu
@pytest.mark.parametrize("style", ["normal", "integer_ties", "neginf"])
@pytest.mark.parametrize("vocab", [163_840, 50_003])
def test_fused_topk_slices_of_several_chunks(style, vocab):
    """Batches large enough for slices of several chunks (their candidates re-read), ties and -inf."""
    seed = fresh_seed()
    logits = styled_logits(style, 64, 7, vocab, seed)
    reference = reference_topk(logits, FAST_MAX_K)
    for k in (5, 64, FAST_MAX_K):
        launch = prepared_fused(logits, k)
        assert launch.chunks > 1
        got = launch()
        torch.cuda.synchronize()
        assert_fused_matches(got, logits, k, f"seed={seed} {style} V={vocab} k={k} chunks={launch.chunks}", reference)


@pytest.mark.gpu
@pytest.mark.parametrize("style", ["normal", "integer_ties"])
def test_fused_topk_at_every_slicing(style):
    """v3 at each slicing (1 to MAX_CHUNKS chunks per slice: a chunk kept in registers, or re-read),
    whatever slice_chunks would pick for the shape."""
    seed = fresh_seed()
    logits = styled_logits(style, 2, 7, 163_840, seed)
    reference = reference_topk(logits, 64)
    device_logits = torch.from_numpy(logits).cuda()
    for chunks in range(1, MAX_CHUNKS + 1):
        for k in (8, 64):
            out = DraftTopK(logp=torch.full((2, 7, k), float("nan"), device="cuda"),
                            ids=torch.full((2, 7, k), -7, dtype=torch.int32, device="cuda"))
            launch = TopKLaunch(device_logits, k, out, chunks=chunks)
            assert launch.path == "fused_v3" and launch.chunks == chunks
            got = launch()
            torch.cuda.synchronize()
            assert_fused_matches(got, logits, k, f"seed={seed} {style} chunks={chunks} k={k}", reference)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [8, 64])
def test_fused_topk_replays_in_a_cuda_graph(k):
    """v3's per-row tickets are left at zero by every launch: replays of a captured launch, each over
    fresh logits, each right."""
    seed = fresh_seed()
    logits = tie_heavy_logits("normal", 8, 7, 163_840, seed)
    launch = prepared_fused(logits, k)
    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for replay in range(3):
        fresh = tie_heavy_logits("normal", 8, 7, 163_840, seed + 1 + replay)
        launch.logits.copy_(torch.from_numpy(fresh))  # refilled in place, as a decode step does
        launch.out.logp.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_fused_matches(launch.out, fresh, k, f"seed={seed} graph replay {replay}")


@pytest.mark.gpu
@pytest.mark.parametrize("value, message", [(np.nan, "NaN"), (np.inf, r"\+inf"), ("row", "entirely -inf")])
def test_fused_topk_flags_bad_rows_without_reading_back(value, message):
    """No value check on the hot path: a bad row comes out NaN, the others are right, and the device
    status (read by check_input, off the hot path) names `logits`; the next call starts clean."""
    seed = fresh_seed()
    logits = tie_heavy_logits("normal", 2, 7, 163_840, seed)
    if value == "row":
        logits[1, 3] = -np.inf
    else:
        logits[1, 3, 123_456] = value
        logits[1, 5, 4096:4096 + 4 * 1024] = value  # every logit of some threads (their maxima see none)
        logits[0, 6, :60_000] = -np.inf             # among -inf
        logits[0, 6, 33] = value
    launch = prepared_fused(logits, 64)
    got = launch()
    torch.cuda.synchronize()
    logp = got.logp.cpu().numpy()
    good = np.ones((2, 7), bool)
    good[1, 3] = False
    if value != "row":
        good[1, 5] = good[0, 6] = False
    assert np.isnan(logp[~good]).all()
    ref_values, ref_ids, ref_log_z = reference_topk(logits[good], 64)
    assert np.array_equal(got.ids.cpu().numpy()[good], ref_ids)
    with pytest.raises(ValueError, match=f"logits: contains .*{message}"):
        launch.check_input()
    launch.check_input()  # cleared
    launch.logits.copy_(torch.from_numpy(tie_heavy_logits("normal", 2, 7, 163_840, seed + 1)))
    launch()
    launch.check_input()
    assert np.isfinite(launch.out.logp.cpu().numpy()).all()


# ----------------------------------------------------------------------------------------------
# trees from the fused path equal the exact path's on the stand-in drafter's held-out logits

@pytest.mark.gpu
def test_fused_trees_equal_exact_trees_on_drafter_logits(drafter_logits):
    """Decode held-out prompts with the stand-in pair, record every draft's logits (conftest's
    drafter_logits), and build each tree from the exact path and from the fused path: the number of
    trees that differ is 0."""
    recorded = drafter_logits
    compared = differing = 0
    for logits in recorded:
        for budget in (8, 32, 64, FAST_MAX_K):
            exact = build_tree(draft_topk(logits, budget, backend="torch"), budget).to_numpy()
            fused = build_tree(draft_topk(logits, budget, backend="cupy"), budget).to_numpy()
            compared += exact.batch
            for b in range(exact.batch):
                same = all(np.array_equal(getattr(exact, f)[b], getattr(fused, f)[b]) for f in ("parents", "tokens"))
                differing += not same
    print(f"{differing} of {compared} trees differ ({len(recorded)} drafts)")
    assert compared > 0 and differing == 0


@pytest.mark.gpu
def test_launch_over_runs_on_another_buffer_and_keeps_none():
    """TopKLaunch.launch_over (the SGLang drop-in's logits move between calls): the same values as a
    launch prepared on that buffer; no reference kept; a buffer that does not fit refused by name."""
    generator = torch.Generator(device="cuda").manual_seed(21)
    first, second = (torch.randn(2, 7, 163_840, device="cuda", generator=generator) * 3 for _ in range(2))
    launch = prepare_draft_topk(first, 64, backend="cupy")
    launch.out.logp.view(torch.int32).fill_(0x7FA5A5A5)
    got = launch.launch_over(second)
    want = prepare_draft_topk(second.clone(), 64, backend="cupy")()
    torch.cuda.synchronize()
    assert torch.equal(got.ids, want.ids) and torch.equal(got.logp, want.logp)
    assert launch.logits is None
    with pytest.raises(ValueError, match="^logits: this launch runs over the buffer each launch_over names"):
        launch()
    misaligned = torch.cat([second.flatten(), second.flatten()[:1]])[1:].view(2, 7, 163_840)  # 4 bytes past 16
    strided = torch.randn(2, 163_840, 7, device="cuda").transpose(1, 2)
    for bad in (second[:1], second.double(), strided, misaligned):
        with pytest.raises(ValueError, match="^logits: expected a C-contiguous"):
            launch.launch_over(bad)
