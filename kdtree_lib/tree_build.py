"""Draft trees: per-position top-k of the drafter, and DDTree's best-first tree build.

The layouts (DraftTopK, Tree) and the limits are `kdtree_lib.contracts`', shared by every backend, so a
test compares arrays directly.

The build is the paper's best-first heap (arXiv 2604.12989), reproduced operation for operation so
the tree is identical to the official code's, ties included. The one addition: an entry whose
log-probability is -inf (a token the drafter gives zero mass, e.g. a masked vocabulary slot) is
never pushed, where the official arithmetic would produce NaN weights.
"""
from __future__ import annotations

import functools
import heapq
import warnings
import numpy as np

from . import backend as _backend
from . import cuda
from .checks import (check_array, check_finite, check_positive_int, check_same_device, dtype_name,
                     framework, to_numpy)
from .contracts import (MAX_BUDGET, MAX_DEPTH, MAX_TOPK, TREE_MODES, DraftTopK, Tree, tree_from_parents,
                        tree_nodes)

# ----------------------------------------------------------------------------------------------
# draft top-k

def draft_topk(logits, k: int, *, backend: str = "auto") -> DraftTopK:
    """Log-softmax of the drafter's logits [B, D, V], top K = min(k, V) per position.

    Rows are sorted by descending log-probability; equal values keep the smaller token id first,
    so the result (and the tree built from it) is deterministic.
    """
    check_array("logits", logits, dtypes=("float32", "float16", "bfloat16", "float64"), ndim=3)
    k = check_positive_int("k", k)
    chosen = _backend.resolve(backend, ("numpy", "cupy"), logits)
    if chosen == "cupy":
        return _draft_topk_cupy(logits, k)
    x = to_numpy(logits).astype(np.float32)
    check_finite("logits", x, allow_neg_inf=True)
    row_max = x.max(axis=-1, keepdims=True)
    if np.isneginf(row_max).any():
        raise ValueError("logits: a row is entirely -inf (no token has any probability)")
    shifted = x - row_max
    logp = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    top = min(k, x.shape[-1])
    order = np.argsort(-logp, axis=-1, kind="stable")[..., :top]
    return DraftTopK(logp=np.take_along_axis(logp, order, axis=-1).astype(np.float32),
                     ids=order.astype(np.int32))


# ----------------------------------------------------------------------------------------------
# tree build

def build_tree(draft: DraftTopK, budget: int, *, root=None, mode: str = "tree",
               backend: str = "auto") -> Tree:
    """DDTree's best-first tree of `budget` draft nodes (plus the root), or the DFlash chain.

    mode="tree": capacity N = budget + 1. mode="chain": the top-1 path of depth
    min(budget, D), capacity N = min(budget, D) + 1. `root` [B] holds the last committed
    tokens (tokens[:, 0]); 0 when omitted.
    """
    logp, ids, budget, root = _check_build_args(draft, budget, root, mode)
    chosen = _backend.resolve(backend, ("numpy", "cupy"), logp)
    if chosen == "cupy":
        return _build_tree_cupy(logp, ids, budget, root, mode)
    logp, ids, root = to_numpy(logp), to_numpy(ids), to_numpy(root)
    check_finite("draft.logp", logp, allow_neg_inf=True)
    if (logp[..., 1:] > logp[..., :-1]).any():
        raise ValueError("draft.logp: each row must be sorted in descending order")
    batch, depth_limit, _ = logp.shape
    capacity = tree_nodes(budget, mode=mode, depth=depth_limit)
    parents = np.full((batch, capacity), -1, np.int32)
    tokens = np.zeros((batch, capacity), np.int32)
    log_weights = np.full((batch, capacity), -np.inf, np.float64)
    pop = _best_first_pops if mode == "tree" else _chain_pops
    for b in range(batch):
        popped = pop(logp[b], budget)
        n = len(popped) + 1
        tokens[b, 0] = root[b]
        log_weights[b, 0] = 0.0
        for i, (parent, depth, rank, log_w) in enumerate(popped, start=1):
            parents[b, i] = parent
            tokens[b, i] = ids[b, depth - 1, rank]
            log_weights[b, i] = log_w
        tokens[b, n:] = 0
    return tree_from_parents(parents, tokens, max_depth=depth_limit, log_weights=log_weights)


def _best_first_pops(logp: np.ndarray, budget: int) -> list[tuple[int, int, int, float]]:
    """(parent, depth, rank, log w) of each popped node, in pop order: DESIGN.md §3's heap."""
    depth_limit, k = logp.shape
    pops: list[tuple[int, int, int, float]] = []
    if logp[0, 0] == -np.inf:
        return pops
    first = float(logp[0, 0])
    heap = [(-first, (0,), 0, 1, 0, first)]  # (key, rank tuple, parent, depth, rank, log w)
    while heap and len(pops) < budget:
        _, ranks, parent, depth, rank, log_w = heapq.heappop(heap)
        pops.append((parent, depth, rank, log_w))
        node = len(pops)
        if rank + 1 < k and logp[depth - 1, rank + 1] != -np.inf:
            sibling_w = log_w - float(logp[depth - 1, rank]) + float(logp[depth - 1, rank + 1])
            heapq.heappush(heap, (-sibling_w, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, sibling_w))
        if depth < depth_limit and logp[depth, 0] != -np.inf:
            child_w = log_w + float(logp[depth, 0])
            heapq.heappush(heap, (-child_w, ranks + (0,), node, depth + 1, 0, child_w))
    return pops


def _chain_pops(logp: np.ndarray, budget: int) -> list[tuple[int, int, int, float]]:
    """The top-1 path: node d has parent d-1 and the argmax token of position d."""
    pops: list[tuple[int, int, int, float]] = []
    log_w = 0.0
    for depth in range(1, min(budget, logp.shape[0]) + 1):
        if logp[depth - 1, 0] == -np.inf:
            break
        log_w += float(logp[depth - 1, 0])
        pops.append((depth - 1, depth, 0, log_w))
    return pops


def _check_build_args(draft, budget, root, mode):
    if not isinstance(draft, DraftTopK):
        raise ValueError(f"draft: expected a DraftTopK, got {type(draft).__name__}")
    if mode not in TREE_MODES:
        raise ValueError(f"mode: expected one of {TREE_MODES}, got {mode!r}")
    budget = check_positive_int("budget", budget)
    if budget > MAX_BUDGET:
        raise ValueError(f"budget: at most {MAX_BUDGET} nodes, got {budget}")
    logp = check_array("draft.logp", draft.logp, dtypes="float32", ndim=3)
    batch, depth_limit, k = logp.shape
    check_array("draft.ids", draft.ids, dtypes="int32", shape=(batch, depth_limit, k))
    if not 1 <= depth_limit <= MAX_DEPTH:
        raise ValueError(f"draft.logp: depth D must be in 1..{MAX_DEPTH}, got {depth_limit}")
    if not 1 <= k <= MAX_TOPK:
        raise ValueError(f"draft.logp: top-k K must be in 1..{MAX_TOPK}, got {k}")
    if root is None:
        root = _zeros_like_batch(logp, batch)
    check_array("root", root, dtypes=("int32", "int64"), shape=(batch,))
    check_same_device(**{"draft.logp": logp, "draft.ids": draft.ids, "root": root})
    return logp, draft.ids, budget, root


def _zeros_like_batch(x, batch):
    kind = framework(x)
    if kind == "numpy":
        return np.zeros(batch, np.int32)
    if kind == "cupy":
        import cupy
        return cupy.zeros(batch, cupy.int32)
    import torch
    return torch.zeros(batch, dtype=torch.int32, device=x.device)


# ----------------------------------------------------------------------------------------------
# CuPy kernels (kernels/tree_build.cu). Inputs are used zero-copy (made contiguous only when they
# are not), outputs are allocated in the inputs' framework, and every launch goes to torch's
# current stream (CuPy's when torch is not in use), so nothing here waits for the GPU.

_TOPK_THREADS = 1024               # KD_TOPK_THREADS in kernels/tree_build.cu
BUILD_VERSIONS = (1, 2)            # build_tree_v1, build_tree_v2 in kernels/tree_build.cu
# logp staged in shared memory, per version: with the static shared memory (9.8 KB, 45.9 KB) <= 99 KB
# (tests/test_tree_kernels.py checks the sum against ptxas' report)
_BUILD_DRAFT_CACHE_BYTES = {1: 80 * 1024, 2: 51 * 1024}


def _draft_topk_cupy(logits, k: int) -> DraftTopK:
    """Fused log-softmax + top-k of logits [B, D, V] on the GPU: one CTA per draft position."""
    batch, depth, vocab = (int(n) for n in logits.shape)
    if vocab < 1:
        raise ValueError("logits: the vocabulary axis is empty")
    top = min(k, vocab)
    if top > MAX_TOPK:
        raise ValueError(f"k: the GPU top-k keeps at most {MAX_TOPK} per position, got {k}")
    logits = cuda.contiguous(logits, "float32")
    logp = cuda.device_empty(logits, (batch, depth, top), "float32")
    ids = cuda.device_empty(logits, (batch, depth, top), "int32")
    if batch * depth:
        vectorized = vocab % 4 == 0 and int(cuda.pointer(logits)) % 16 == 0
        cuda.launch("tree_build.cu", "draft_topk_vec4" if vectorized else "draft_topk_vec1", (batch * depth,),
                    (_TOPK_THREADS,),
                    (cuda.pointer(logits), np.int32(vocab), np.int32(top), cuda.pointer(logp), cuda.pointer(ids)),
                    like=logits)
    return DraftTopK(logp=logp, ids=ids)


def _build_tree_cupy(logp, ids, budget: int, root, mode: str) -> Tree:
    """The kernel build (arguments already checked by _check_build_args): one launch per batch."""
    batch, depth_limit, _ = (int(n) for n in logp.shape)
    capacity = tree_nodes(budget, mode=mode, depth=depth_limit)
    tree = _empty_tree(logp, batch, capacity, depth_limit)
    _launch_build_tree(logp, ids, budget, root, mode, tree)
    return tree


def _empty_tree(like, batch: int, capacity: int, max_depth: int) -> Tree:
    """Uninitialised Tree outputs on the device of `like`, in its framework (the kernel writes all)."""
    words = (capacity + 31) // 32
    nodes = (batch, capacity)
    return Tree(tokens=cuda.device_empty(like, nodes, "int32"), parents=cuda.device_empty(like, nodes, "int32"),
                depths=cuda.device_empty(like, nodes, "int32"), n_nodes=cuda.device_empty(like, (batch,), "int32"),
                mask=cuda.device_empty(like, (batch, capacity, words), "uint32"),
                first_child=cuda.device_empty(like, nodes, "int32"),
                next_sibling=cuda.device_empty(like, nodes, "int32"),
                log_weights=cuda.device_empty(like, nodes, "float64"), max_depth=max_depth)


def _build_version(budget: int) -> int:
    """The build_tree_v* kernel the public entry point launches for this budget."""
    return 2


def _launch_build_tree(logp, ids, budget: int, root, mode: str, out: Tree, *, version: int | None = None) -> None:
    """build_tree_v<version> (default: _build_version(budget)) into preallocated outputs, one CTA
    per request; the first `cached` ranks of every depth are staged in shared memory (every rank a
    pop can read, rank <= budget + 1, unless D * K is very large).

    v1: heap slots 2 per thread on `slot_threads` threads (one warp up to budget 64, then
    ceil(budget / 2) rounded up to 32). v2: one warp pops; the CTA's other warps stage and write;
    when every readable rank fits as float64, the draft is staged as float64 (no conversion, no
    global reads in the pops).
    """
    version = _build_version(budget) if version is None else version
    if version not in BUILD_VERSIONS:
        raise ValueError(f"version: expected one of {BUILD_VERSIONS}, got {version!r}")
    batch, depth_limit, topk = (int(n) for n in logp.shape)
    if batch == 0:
        return
    logp, ids, root = cuda.contiguous(logp), cuda.contiguous(ids), cuda.contiguous(root)
    cache_bytes = _BUILD_DRAFT_CACHE_BYTES[version]
    staged_f64 = False
    if mode == "chain":
        slot_threads, threads, cached = 32, 32, 1
    else:
        if version == 1:
            slot_threads = max(32, -(-budget // 64) * 32)
            threads = 128 if slot_threads == 32 else slot_threads
        else:  # the warps past the first stage the draft and write the outputs
            slot_threads, threads = 32, min(512, max(128, -(-budget // 64) * 32))
        readable = min(topk, budget + 2)
        staged_f64 = version == 2 and 8 * depth_limit * readable <= cache_bytes
        cached = readable if staged_f64 else min(readable, cache_bytes // (4 * depth_limit))
    args = ((cuda.pointer(logp), cuda.pointer(ids), cuda.pointer(root), np.int32(dtype_name(root) == "int64"),
             np.int32(depth_limit), np.int32(topk), np.int32(budget), np.int32(out.capacity),
             np.int32(mode == "chain"), np.int32(cached))
            + ((np.int32(slot_threads),) if version == 1 else (np.int32(staged_f64),))
            + (cuda.pointer(out.tokens), cuda.pointer(out.parents), cuda.pointer(out.depths), cuda.pointer(out.n_nodes),
               cuda.pointer(out.mask), cuda.pointer(out.first_child), cuda.pointer(out.next_sibling),
               cuda.pointer(out.log_weights)))
    kernel = f"build_tree_v{version}"
    _allow_draft_cache(cuda.device_index(logp), kernel, cache_bytes)
    cuda.launch("tree_build.cu", kernel, (batch,), (threads,), args, like=logp,
                shared_mem=(8 if staged_f64 else 4) * depth_limit * cached)


@functools.lru_cache(maxsize=None)
def _allow_draft_cache(device: int, kernel: str, cache_bytes: int) -> None:
    """Let a build kernel take more than 48 KB of dynamic shared memory (once per device)."""
    import cupy
    with cupy.cuda.Device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # CuPy is moving this attribute
        cuda.device_function("tree_build.cu", kernel, device).max_dynamic_shared_size_bytes = cache_bytes
