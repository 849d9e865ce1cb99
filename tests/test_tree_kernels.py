"""The tree kernels (kernels/draft_topk.cu, tree_build.cu, tree_accept.cu) against the references.

CPU: the host-side checks raise ValueError before any launch; nvcc builds both files for sm_90 and
sm_120 without spills and within 99 KB of shared memory. GPU (`-m gpu`): randomized equality with
the references on fresh seeds (printed on failure), with every output poisoned before the launch,
for CuPy arrays and torch CUDA tensors alike.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from kdtree_lib import cuda
from kdtree_lib.contracts import MAX_BUDGET, AcceptResult, DraftTopK, Tree, tree_from_parents
from kdtree_lib.draft_topk import TOPK_THREADS, draft_topk, prepare_draft_topk
from kdtree_lib.tree_accept import (_check_tree_arrays, _compaction_layout, accept, compact_cache,
                                    prepare_accept_launch, prepare_compact_launch)
from kdtree_lib.tree_build import BUILD_KERNEL, DRAFT_CACHE_BYTES, build_tree, prepare_build_launch

KERNEL_FILES = ("draft_topk.cu", "tree_build.cu", "tree_accept.cu")
SMEM_LIMIT = 99 * 1024
FRAMEWORKS = ("cupy", "torch")
TREE_FIELDS = ("tokens", "parents", "depths", "n_nodes", "mask", "first_child", "next_sibling", "log_weights")


# ----------------------------------------------------------------------------------------------
# helpers

def fresh_rng():
    """A generator on a new seed each run; the seed goes into failure messages to replay it."""
    seed = int(np.random.SeedSequence().entropy % 2**63)
    return np.random.default_rng(seed), seed


def sorted_draft(rng, batch, depth, k, style):
    """DraftTopK on the host: rows sorted descending, in one of the input styles the tests need."""
    if style == "ties":  # few distinct values: exact ties in float64 sums everywhere
        logp = -rng.integers(0, 3, size=(batch, depth, k)).astype(np.float32)
    elif style == "halves":
        logp = -0.5 * rng.integers(0, 4, size=(batch, depth, k)).astype(np.float32)
    elif style == "close":  # a few ulps apart: weights that differ only past their top 27 key bits
        logp = np.float32(-1.0) - rng.integers(0, 6, size=(batch, depth, k)).astype(np.float32) * np.float32(1.2e-7)
    else:  # log-probabilities of a peaked random distribution
        logp = np.log(rng.dirichlet(np.full(2 * k + 3, 0.3), size=(batch, depth))[..., :k]).astype(np.float32)
    if style == "neginf":  # zero-mass tails, whole rows, and a request with nothing to pop
        logp[rng.random(logp.shape) < 0.15] = -np.inf
        logp[0, 0, :] = -np.inf
    logp = -np.sort(-logp, axis=-1)
    ids = np.stack([rng.permutation(4 * k + 5)[:k] for _ in range(batch * depth)]).reshape(batch, depth, k)
    return logp, ids.astype(np.int32)


def to_device(x: np.ndarray, kind: str):
    if kind == "torch":
        import torch
        return torch.as_tensor(x, device="cuda")
    import cupy
    return cupy.asarray(x)


def host(x) -> np.ndarray:
    """Host copy of a device array (torch uint32 goes through an int32 view)."""
    if type(x).__module__.startswith("torch"):
        import torch
        if x.dtype == torch.uint32:
            return x.view(torch.int32).cpu().numpy().view(np.uint32)
        return x.cpu().numpy()
    return x.get()


def poison(*arrays) -> None:
    """Fill outputs with 0xA5 bytes (not -1, not 0, not -inf), so unwritten elements show."""
    for x in arrays:
        if type(x).__module__.startswith("torch"):
            import torch
            x.view(torch.uint8).fill_(0xA5)
        else:
            import cupy
            x.view(cupy.uint8).fill(0xA5)


def assert_same_tree(got: Tree, want: Tree, context: str) -> None:
    for name in TREE_FIELDS:
        a, b = host(getattr(got, name)), getattr(want, name)
        if name == "log_weights":  # bit for bit (float64 arithmetic in the same order)
            a, b = a.view(np.uint64), b.view(np.uint64)
        assert a.shape == b.shape, f"{name} shape {a.shape} != {b.shape} ({context})"
        bad = np.argwhere(a != b)
        assert bad.size == 0, f"{name} differs at {bad[:5].tolist()} ({context})"


# ----------------------------------------------------------------------------------------------
# CPU: compilation and host-side checks

@pytest.mark.parametrize("arch", cuda.ARCHITECTURES)
@pytest.mark.parametrize("file_name", KERNEL_FILES)
def test_kernels_compile_without_spills(file_name, arch, tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")
    report = cuda.ptxas_report(file_name, arch, tmp_path)
    assert report.kernels, report.log
    for name, kernel in report.kernels.items():
        assert kernel.spilled_bytes == 0 and kernel.shared_bytes <= SMEM_LIMIT, (name, kernel)


@pytest.mark.parametrize("arch", cuda.ARCHITECTURES)
def test_build_kernel_fits_static_and_staged_shared_memory(arch, tmp_path):
    """The build kernel's static shared memory plus the draft cache its launcher asks for <= 99 KB."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")
    kernel = cuda.ptxas_report("tree_build.cu", arch, tmp_path).kernels[BUILD_KERNEL]
    assert kernel.shared_bytes + DRAFT_CACHE_BYTES <= SMEM_LIMIT, kernel


def test_cupy_backend_refuses_host_inputs():
    logp, ids = sorted_draft(np.random.default_rng(0), 1, 2, 3, "smooth")
    with pytest.raises(ValueError, match="backend"):
        build_tree(DraftTopK(logp, ids), 4, backend="cupy")


@pytest.mark.parametrize("change, message", [
    (dict(budget=MAX_BUDGET + 1), "budget"),
    (dict(budget=0), "budget"),
    (dict(logp=np.zeros((1, 33, 4), np.float32)), "depth"),
    (dict(logp=np.zeros((1, 2, 1025), np.float32)), "top-k"),
    (dict(logp=np.zeros((1, 2, 4), np.float64)), "dtype"),
    (dict(ids=np.zeros((1, 2, 5), np.int32)), "draft.ids"),
    (dict(root=np.zeros(2, np.int32)), "root"),
    (dict(mode="beam"), "mode"),
])
def test_build_checks_arguments_before_launch(change, message):
    args = dict(logp=np.zeros((1, 2, 4), np.float32), budget=8, root=None, mode="tree")
    args.update(change)
    args.setdefault("ids", np.zeros(args["logp"].shape, np.int32))
    with pytest.raises(ValueError, match=message):
        build_tree(DraftTopK(args["logp"], args["ids"]), args["budget"], root=args["root"], mode=args["mode"],
                   backend="cupy")


def test_draft_topk_kernel_limits():
    with pytest.raises(ValueError, match="at most 1024"):
        prepare_draft_topk(np.zeros((1, 1, 2000), np.float32), 1500, backend="cupy")
    with pytest.raises(ValueError, match="vocabulary"):
        prepare_draft_topk(np.zeros((1, 1, 0), np.float32), 4)


def test_accept_checks_tree_layout():
    tree = tree_from_parents(np.array([[-1, 0, 0]]), np.array([[5, 6, 7]]), max_depth=1)
    _check_tree_arrays(tree)
    with pytest.raises(ValueError, match="tree.tokens"):
        _check_tree_arrays(Tree(**{**vars(tree), "tokens": tree.tokens.astype(np.int64)}))
    big = tree_from_parents(-np.ones((1, MAX_BUDGET + 2), np.int32), np.zeros((1, MAX_BUDGET + 2), np.int32))
    with pytest.raises(ValueError, match="capacity"):
        _check_tree_arrays(big)


def _compaction_args(width=576, dtype=np.int16, layers=3, batch=2, slots=40, path_len=8):
    caches = [np.zeros((batch, slots, width), dtype) for _ in range(layers)]
    result = AcceptResult(path=np.zeros((batch, path_len), np.int32), n_accepted=np.ones(batch, np.int32),
                          bonus=np.zeros(batch, np.int32))
    return caches, np.zeros(batch, np.int32), result


def test_compaction_layout_picks_copy_unit():
    caches, lengths, result = _compaction_args(width=7)  # 14-byte rows: 2-byte units
    assert _compaction_layout(caches, lengths, result) == (40, 14, 2)
    caches, lengths, result = _compaction_args(width=3, dtype=np.uint8)
    assert _compaction_layout(caches, lengths, result)[2] == 1
    caches, lengths, result = _compaction_args(width=576)
    slots, row_bytes, unit = _compaction_layout(caches, lengths, result)
    assert row_bytes == 1152 and unit in (16, 4, 2) and all(c.ctypes.data % unit == 0 for c in caches)


def test_compaction_checks_layout():
    caches, lengths, result = _compaction_args()
    with pytest.raises(ValueError, match=r"caches\[1\]"):
        _compaction_layout([caches[0], caches[1][:, :, :8]], lengths, result)
    with pytest.raises(ValueError, match=r"caches\[2\]"):
        _compaction_layout(caches[:2] + [caches[2].astype(np.float32)], lengths, result)
    with pytest.raises(ValueError, match="C-contiguous"):
        _compaction_layout([np.zeros((2, 40, 1152), np.int16)[:, :, ::2]], lengths, result)
    with pytest.raises(ValueError, match="result.path"):
        _compaction_layout(caches, lengths, _compaction_args(path_len=70)[2])
    with pytest.raises(ValueError, match="result.n_accepted"):
        _compaction_layout(caches, lengths, AcceptResult(result.path, result.n_accepted.astype(np.int64),
                                                         result.bonus))


# ----------------------------------------------------------------------------------------------
# GPU: tree build

BUILD_CASES = [  # (batch, depth D, top-k K, budget, style)
    (1, 1, 1, 1, "smooth"),
    (3, 4, 5, 7, "ties"),
    (4, 6, 3, 1024, "ties"),        # the heap empties long before the budget
    (5, 7, 8, 32, "halves"),         # one warp, one slot per lane
    (6, 7, 9, 33, "ties"),           # one warp, a lane's second slot in use
    (8, 15, 64, 64, "smooth"),       # the largest single-warp budget
    (8, 15, 64, 64, "ties"),
    (4, 7, 9, 65, "ties"),           # two warps: winners through shared memory
    (7, 5, 33, 100, "neginf"),
    (3, 15, 300, 300, "ties"),
    (2, 32, 1024, 1024, "smooth"),   # the node ceiling: 1024 pops, 1024 threads
    (2, 32, 1024, 1024, "ties"),     # ranks past the 640 staged per depth come from global memory
    (3, 9, 1024, 1023, "halves"),
    (6, 6, 64, 64, "close"),         # v2: equal 27-bit prefixes, different weights
    (3, 9, 40, 120, "close"),
]

# v2: the largest prefix twice in one lane's slots (j and j + 32) and nowhere else, at some pop
# (found by search; the kernel must not take the later column): logp [D, K] as float32 bits, budget
IN_LANE_PREFIX_TIES = [
    ([[3214783312, 3223692689, 3224885861, 3241491700, 3246754864],
      [3208889242, 3214195683, 3221361082, 3236575727, 3238377827],
      [3219647324, 3226315960, 3231079051, 3232190972, 3237867748],
      [3213309905, 3220253391, 3236232961, 3237346587, 3241086879],
      [3219602472, 3219984668, 3231280682, 3237779610, 3241969553],
      [3217227405, 3224636379, 3225982689, 3236346849, 3240525969],
      [3214462519, 3221143727, 3221612832, 3225491300, 3231893383]], 196),
    ([[0x80000000, 0x80000000, 0xBF000000, 0xBF800000, 0xBF800000],   # -0.0 -0.0 -0.5 -1 -1
      [0xBF000000, 0xBF800000, 0xBF800000, 0xBF800000, 0xBFC00000],
      [0x80000000, 0xBF000000, 0xBF800000, 0xBFC00000, 0xBFC00000]], 157),
]


def check_build_kernel(logp, ids, budget, kind, context):
    """Tree and chain builds of (logp, ids) by the kernel (outputs poisoned first) against the reference."""
    batch, depth, _ = logp.shape
    root = np.random.default_rng(budget).integers(0, 1000, size=batch).astype(np.int64 if kind == "torch" else np.int32)
    for mode in ("tree", "chain"):
        want = build_tree(DraftTopK(logp, ids), budget, root=root, mode=mode, backend="numpy")
        d_logp, d_ids, d_root = (to_device(x, kind) for x in (logp, ids, root))
        launch = prepare_build_launch(DraftTopK(d_logp, d_ids), budget, root=d_root, mode=mode)
        poison(*(getattr(launch.out, name) for name in TREE_FIELDS))
        assert_same_tree(launch(), want, f"{context} mode={mode} {kind}")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", FRAMEWORKS)
@pytest.mark.parametrize("batch, depth, k, budget, style", BUILD_CASES)
def test_build_tree_kernel_equals_reference(batch, depth, k, budget, style, kind):
    rng, seed = fresh_rng()
    logp, ids = sorted_draft(rng, batch, depth, k, style)
    check_build_kernel(logp, ids, budget, kind, f"seed={seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("bits, budget", IN_LANE_PREFIX_TIES)
def test_build_tree_kernel_in_lane_prefix_ties(bits, budget):
    logp = np.array(bits, np.uint32).view(np.float32)[None]
    ids = np.arange(logp.size, dtype=np.int32).reshape(logp.shape)
    check_build_kernel(logp, ids, budget, "cupy", "in-lane prefix ties")


@pytest.mark.gpu
def test_prepared_launches_refuse_other_buffers():
    """A prepared launch reads the buffers it was prepared with; handing it others is an error."""
    import torch
    logp, ids = sorted_draft(np.random.default_rng(0), 2, 3, 8, "smooth")
    draft = DraftTopK(torch.as_tensor(logp, device="cuda"), torch.as_tensor(ids, device="cuda"))
    build = prepare_build_launch(draft, 8)
    assert build(draft) is build.out
    with pytest.raises(ValueError, match="draft, root: not the buffers"):
        build(DraftTopK(draft.logp.clone(), draft.ids))
    with pytest.raises(ValueError, match="draft, root: not the buffers"):
        build(root=torch.zeros(2, dtype=torch.int64, device="cuda"))
    logits = torch.randn(2, 3, 100, device="cuda")
    for backend in ("torch", "cupy"):
        topk = prepare_draft_topk(logits, 8, backend=backend)
        topk(logits)
        with pytest.raises(ValueError, match="logits: not the buffer"):
            topk(logits[:1])
    posterior = torch.zeros(2, 9, dtype=torch.int32, device="cuda")
    walk = prepare_accept_launch(build.out, posterior)
    walk(posterior)
    with pytest.raises(ValueError, match="posterior: not the buffer"):
        walk(posterior.clone())


@pytest.mark.gpu
@pytest.mark.parametrize("kind", FRAMEWORKS)
def test_build_tree_public_entry_point(kind):
    rng, seed = fresh_rng()
    logp, ids = sorted_draft(rng, 64, 15, 64, "smooth")
    got = build_tree(DraftTopK(to_device(logp, kind), to_device(ids, kind)), 64, backend="auto")
    assert type(got.tokens).__module__.split(".")[0] == kind
    assert_same_tree(got, build_tree(DraftTopK(logp, ids), 64, backend="numpy"), f"seed={seed}")


# ----------------------------------------------------------------------------------------------
# GPU: draft top-k

def assert_fused_topk_matches(got: DraftTopK, logits: np.ndarray, k: int, context: str) -> None:
    """The fused kernel against torch's formula: the same selection exactly (the k largest logits, ties
    by ascending token id), log-probabilities within the rounding of its own float32 normaliser.

    The kernel and torch differ only in the normaliser log(sum exp(x - max)): each of its 1024 threads
    adds about V / 1024 terms before a tree merge, so the sum's relative error is at most about
    (V / 1024 + log2 V) float32 eps, which is the log's absolute error; the subtractions add an eps of
    the magnitudes involved.
    """
    import torch
    x = torch.from_numpy(logits)
    top = min(k, logits.shape[-1])
    values = torch.topk(x, top, dim=-1).values.numpy()
    log_z = torch.logsumexp(x, dim=-1, keepdim=True).numpy()
    logp, ids = host(got.logp), host(got.ids).astype(np.int64)
    assert logp.shape == values.shape and ids.shape == values.shape, context
    chosen = np.take_along_axis(logits, ids, -1)
    assert np.array_equal(chosen, values), f"not the k largest logits in order ({context})"
    tied = chosen[..., 1:] == chosen[..., :-1]
    assert (ids[..., 1:][tied] > ids[..., :-1][tied]).all(), f"ties not by ascending id ({context})"
    vocab = logits.shape[-1]
    eps = np.finfo(np.float32).eps
    bound = eps * (vocab / TOPK_THREADS + np.log2(vocab) + 2 * (np.abs(chosen) + np.abs(log_z)
                                                               + np.abs(logits.max(-1, keepdims=True))))
    error = np.abs(logp - (chosen - log_z))
    assert (error <= bound).all(), f"max error {error.max():.3g}, bound there {bound.flat[error.argmax()]:.3g} ({context})"


TOPK_CASES = [  # (batch, depth, vocab, k, style)
    (2, 3, 163_840, 1024, "normal"),
    (1, 4, 163_840, 37, "normal"),
    (1, 2, 163_840, 1, "wide"),
    (2, 2, 163_840, 1024, "integers"),   # massive exact ties: ids decided by the tie rule alone
    (1, 3, 5_003, 1024, "integers"),
    (2, 2, 5_003, 64, "neginf"),
    (1, 2, 50, 64, "normal"),            # k > V: K = V
    (1, 1, 163_840, 1024, "constant"),   # every value equal: the radix select reaches the ids
]


def topk_logits(rng, shape, style):
    if style == "integers":
        logits = -rng.integers(0, 4, size=shape).astype(np.float32)  # includes -0.0
    elif style == "constant":
        logits = np.full(shape, 1.25, np.float32)
    elif style == "wide":
        logits = (rng.standard_normal(shape) * 30).astype(np.float32)
    else:
        logits = (rng.standard_normal(shape) * 3).astype(np.float32)
    if style == "neginf":
        logits[rng.random(shape) < 0.5] = -np.inf
    return logits


@pytest.mark.gpu
@pytest.mark.parametrize("kind", FRAMEWORKS)
@pytest.mark.parametrize("batch, depth, vocab, k, style", TOPK_CASES)
def test_fused_topk_kernel_selects_exactly(batch, depth, vocab, k, style, kind):
    rng, seed = fresh_rng()
    logits = topk_logits(rng, (batch, depth, vocab), style)
    launch = prepare_draft_topk(to_device(logits, kind), k, backend="cupy")
    poison(launch.out.logp, launch.out.ids)
    assert_fused_topk_matches(launch(), logits, k, f"seed={seed} {style} {kind}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", FRAMEWORKS)
def test_auto_on_the_gpu_is_torchs_cuda_formula(kind, dtype):
    """draft_topk's default on device logits: torch's CUDA topk - logsumexp for the batch, bit for bit."""
    import torch
    rng, seed = fresh_rng()
    logits = torch.as_tensor(topk_logits(rng, (3, 7, 163_840), "integers"), device="cuda")
    if dtype == "bfloat16":
        if kind == "cupy":
            pytest.skip("CuPy has no bfloat16")
        logits = logits.to(torch.bfloat16)
    given = logits if kind == "torch" else to_device(logits.cpu().numpy(), "cupy")
    got = draft_topk(given, 256)
    assert type(got.logp).__module__.split(".")[0] == kind
    values, ids = torch.topk(logits.float(), 256, dim=-1)
    want = (values - torch.logsumexp(logits.float(), dim=-1, keepdim=True)).cpu().numpy()
    assert np.array_equal(host(got.logp).view(np.uint32), want.view(np.uint32)), f"seed={seed}"
    assert np.array_equal(host(got.ids), ids.int().cpu().numpy()), f"seed={seed}"
    if dtype == "float32":  # the prepared exact path: the same values from fixed buffers, also replayed in a graph
        launch = prepare_draft_topk(given, 256, backend="torch")
        poison(launch.out.logp, launch.out.ids)
        graph = torch.cuda.CUDAGraph()
        launch()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            launch()
        poison(launch.out.logp, launch.out.ids)
        graph.replay()
        torch.cuda.synchronize()
        assert np.array_equal(host(launch.out.logp).view(np.uint32), want.view(np.uint32)), f"seed={seed} prepared"
        assert np.array_equal(host(launch.out.ids), ids.int().cpu().numpy()), f"seed={seed} prepared"


# ----------------------------------------------------------------------------------------------
# GPU: accept and compaction

def random_posterior(rng, tree: Tree, follow: float, vocab: int) -> np.ndarray:
    """The target's token per node: with probability `follow` the token of a random child of the
    node (so walks go deep), otherwise a random token."""
    posterior = rng.integers(0, vocab, size=(tree.batch, tree.capacity)).astype(np.int32)
    for b in range(tree.batch):
        for node in range(int(tree.n_nodes[b])):
            children = np.flatnonzero(tree.parents[b] == node)
            if children.size and rng.random() < follow:
                posterior[b, node] = tree.tokens[b, rng.choice(children)]
    return posterior


def random_tree(rng, batch, capacity, vocab):
    """A random tree with small-vocabulary tokens (duplicate tokens among siblings included)."""
    parents = np.full((batch, capacity), -1, np.int32)
    for b in range(batch):
        for i in range(1, int(rng.integers(1, capacity + 1))):
            parents[b, i] = rng.integers(0, i)
    return tree_from_parents(parents, rng.integers(0, vocab, size=(batch, capacity)))


def device_tree(tree: Tree, kind: str) -> Tree:
    return Tree(**{name: (value if name == "max_depth" else to_device(value, kind))
                   for name, value in vars(tree).items()})


@pytest.mark.gpu
@pytest.mark.parametrize("kind", FRAMEWORKS)
@pytest.mark.parametrize("batch, capacity, vocab, follow", [
    (1, 1, 5, 0.9), (7, 9, 3, 0.8), (16, 65, 4, 0.9), (5, 1025, 6, 0.95), (33, 200, 1000, 0.5)])
def test_accept_kernel_equals_reference(batch, capacity, vocab, follow, kind):
    rng, seed = fresh_rng()
    tree = random_tree(rng, batch, capacity, vocab)
    posterior = random_posterior(rng, tree, follow, vocab)
    want = accept(tree, posterior, backend="numpy")
    d_tree = device_tree(tree, kind)
    for d_posterior in (to_device(posterior, kind), to_device(posterior.astype(np.int64), kind)):
        launch = prepare_accept_launch(d_tree, d_posterior)
        poison(launch.out.path, launch.out.n_accepted, launch.out.bonus)
        got = launch()
        for name in ("path", "n_accepted", "bonus"):
            assert np.array_equal(host(getattr(got, name)), getattr(want, name)), f"{name} seed={seed} {kind}"


def random_accept_result(rng, batch, path_len, capacity) -> AcceptResult:
    """Increasing paths with path[k] >= k, many of them overlapping (a source that is another
    accepted node's destination)."""
    path = np.full((batch, path_len), -1, np.int32)
    n_accepted = rng.integers(1, path_len + 1, size=batch).astype(np.int32)
    for b in range(batch):
        nodes = np.sort(rng.choice(np.arange(1, capacity), size=n_accepted[b] - 1, replace=False))
        path[b, :n_accepted[b]] = np.concatenate([[0], nodes])
    return AcceptResult(path=path, n_accepted=n_accepted, bonus=np.zeros(batch, np.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("kind, width, dtype", [
    ("torch", 576, "bfloat16"), ("cupy", 576, "int16"), ("cupy", 7, "int16"), ("cupy", 5, "float32"),
    ("cupy", 3, "uint8"), ("torch", 2000, "bfloat16")])
def test_compaction_kernel_equals_reference(kind, width, dtype):
    rng, seed = fresh_rng()
    batch, layers, path_len, capacity, slots = 6, 4, 16, 40, 120
    result = random_accept_result(rng, batch, path_len, capacity)
    for lengths in (rng.integers(0, slots - capacity, size=batch).astype(np.int32),
                    rng.integers(0, slots - capacity, size=batch).astype(np.int64)):
        raw = [rng.integers(0, 2**15, size=(batch, slots, width)).astype(np.int16 if dtype != "uint8" else np.uint8)
               for _ in range(layers)]
        if dtype == "float32":
            raw = [r.astype(np.float32) for r in raw]
        want = [r.copy() for r in raw]
        want_lengths = compact_cache(want, lengths, result, backend="numpy")
        if kind == "torch":
            import torch
            caches = [torch.as_tensor(r, device="cuda").view(torch.bfloat16) for r in raw]
        else:
            caches = [to_device(r, kind) for r in raw]
        d_result = AcceptResult(*(to_device(x, kind) for x in (result.path, result.n_accepted, result.bonus)))
        d_lengths = to_device(lengths, kind)
        new_lengths = to_device(np.zeros_like(lengths), kind)
        poison(new_lengths)
        prepare_compact_launch(caches, d_lengths, d_result, new_lengths=new_lengths)()
        assert np.array_equal(host(new_lengths), want_lengths), f"seed={seed}"
        for layer, (cache, expected) in enumerate(zip(caches, want)):
            got = host(cache.view(torch.int16)) if kind == "torch" else host(cache)
            assert np.array_equal(got, expected), f"layer {layer} seed={seed} lengths {lengths.dtype}"


@pytest.mark.gpu
def test_decode_step_never_synchronizes_the_host():
    """draft_topk -> build_tree -> accept -> compact_cache with torch tensors under torch's sync
    debug mode (error on any synchronizing call) and CuPy's allow_synchronize(False)."""
    import cupyx
    import torch
    _, seed = fresh_rng()
    torch.manual_seed(seed)
    batch, depth, budget = 4, 7, 32
    logits = torch.randn(batch, depth, 4096, device="cuda")
    caches = [torch.zeros(batch, 256, 576, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    lengths = torch.full((batch,), 100, dtype=torch.int32, device="cuda")
    posterior = torch.randint(0, 4096, (batch, budget + 1), dtype=torch.int32, device="cuda")

    def step():
        tree = build_tree(draft_topk(logits, budget), budget)
        result = accept(tree, posterior)
        return compact_cache(caches, lengths, result)

    step()  # compiles the kernels and builds the layer table
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with cupyx.allow_synchronize(False):
            new_lengths = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert new_lengths.is_cuda and int(new_lengths.min()) >= 101


@pytest.mark.gpu
def test_kernels_follow_torch_current_stream():
    """Producer, kernels and consumer all on a side stream with no synchronization in between."""
    import torch
    _, seed = fresh_rng()
    torch.manual_seed(seed)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        logits = torch.randn(16, 15, 32_768, device="cuda") * 3
        fused = prepare_draft_topk(logits, 64, backend="cupy")()
        draft = draft_topk(logits, 64)
        tree = build_tree(draft, 64)
    stream.synchronize()
    assert_fused_topk_matches(fused, logits.cpu().numpy(), 64, f"seed={seed} side stream")
    want = build_tree(DraftTopK(host(draft.logp), host(draft.ids)), 64, backend="numpy")
    assert_same_tree(tree, want, "side stream")


@pytest.mark.gpu
def test_compaction_takes_a_host_accept_result():
    """Device caches with the NumPy walk's AcceptResult: copied to the device, then the kernel."""
    import torch
    rng, seed = fresh_rng()
    result = random_accept_result(rng, 3, 9, 30)
    lengths = rng.integers(0, 40, size=3).astype(np.int32)
    raw = [rng.integers(0, 2**15, size=(3, 80, 576)).astype(np.int16) for _ in range(2)]
    want = [r.copy() for r in raw]
    want_lengths = compact_cache(want, lengths, result, backend="numpy")
    caches = [torch.as_tensor(r, device="cuda").view(torch.bfloat16) for r in raw]
    new_lengths = compact_cache(caches, torch.as_tensor(lengths, device="cuda"), result)
    assert np.array_equal(host(new_lengths), want_lengths), f"seed={seed}"
    assert all(np.array_equal(host(c.view(torch.int16)), w) for c, w in zip(caches, want)), f"seed={seed}"


def test_buffer_signature_tells_a_prepared_buffer_from_a_copy_or_a_view():
    """What the prepared launches compare: the same array matches; a copy (other address), a reshape
    (other shape) or another dtype over the same bytes does not."""
    x = np.zeros((2, 3), np.float32)
    assert cuda.buffer_signature(x) == cuda.buffer_signature(x)
    for other in (x.copy(), x.reshape(3, 2), x.view(np.int32)):
        assert cuda.buffer_signature(other) != cuda.buffer_signature(x)
    assert len(cuda.buffer_signature(x, x)) == 2
