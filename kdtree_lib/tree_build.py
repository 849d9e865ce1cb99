"""DDTree's best-first tree build from the drafter's top-k (DraftTopK -> Tree, docs/DESIGN.md's contracts).

The build is the paper's best-first heap (arXiv 2604.12989), reproduced operation for operation so
the tree is identical to the official code's, ties included. The one addition: an entry whose
log-probability is -inf (a token the drafter gives zero mass, e.g. a masked vocabulary slot) is
never pushed, where the official arithmetic would produce NaN weights.

The host path checks the draft's values (finite or -inf, <= 0, rows descending); the kernel path
checks metadata only, since reading device values back would synchronise every decode step.
"""
from __future__ import annotations

import functools
import heapq
import math
import warnings
from dataclasses import dataclass

import numpy as np

from . import backend as _backend
from . import cuda
from .checks import (check_array, check_finite, check_positive_int, check_same_device, check_token_ids, dtype_name,
                     framework, to_numpy)
from .contracts import MAX_BUDGET, MAX_DEPTH, MAX_TOPK, TREE_MODES, DraftTopK, Tree, tree_from_parents, tree_nodes


@dataclass(frozen=True)
class PaperPolicy:
    """The paper's best-first heap, exactly as the official code runs it."""
    name = "paper"


@dataclass(frozen=True)
class SpineFirstPolicy:
    """The full top-1 chain first, then side branches best-first (the paper's weights and tie order):
    the chain is never displaced by a heavier branch, so the tree is always at least the chain."""
    name = "spine_first"


@dataclass(frozen=True)
class SGLangPolicy:
    """SGLang's DDTree build (its speculative/ddtree_utils.py), with its defaults.

    - at most min(max(budget // D + 1, 2), max_topk) candidates per position;
    - `depth_bonus` is added to every first child's weight (deeper trees);
    - an entry off the top-1 spine whose weight is below root - log(budget) - `stop_margin` is dropped
      without a node or pushes (the spine always grows);
    - nodes are then relabelled breadth-first: depth-major, children grouped by their parent's new
      index, in pop order within a parent;
    - budget == D is the top-1 chain (SGLang's spine fast path).
    SGLang reads max_topk and depth_bonus from SGLANG_DDTREE_MAX_TOPK and SGLANG_DDTREE_DEPTH_BONUS. The
    tree's log_weights are this policy's priorities, the depth bonus included.
    """
    max_topk: int = 6
    depth_bonus: float = 0.2
    stop_margin: float = 1.0
    name = "sglang"

    def width(self, budget: int, depth: int) -> int:
        """Candidates kept per position for this budget and draft depth."""
        return min(max(budget // max(depth, 1) + 1, 2), self.max_topk)


TREE_POLICIES = {"paper": PaperPolicy(), "spine_first": SpineFirstPolicy(), "sglang": SGLangPolicy()}


def resolve_policy(policy):
    """A policy object from its name (defaults) or an instance, its parameters checked."""
    if isinstance(policy, str) and policy in TREE_POLICIES:
        return TREE_POLICIES[policy]
    if isinstance(policy, SGLangPolicy):
        if isinstance(policy.max_topk, bool) or not isinstance(policy.max_topk, (int, np.integer)) \
                or not 1 <= policy.max_topk <= MAX_TOPK:
            raise ValueError(f"policy.max_topk: expected an integer in 1..{MAX_TOPK}, got {policy.max_topk!r}")
        for field in ("depth_bonus", "stop_margin"):
            value = getattr(policy, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"policy.{field}: expected a finite number, got {value!r}")
        return policy
    if isinstance(policy, (PaperPolicy, SpineFirstPolicy)):
        return policy
    raise ValueError(f"policy: expected one of {tuple(TREE_POLICIES)} or a policy object, got {policy!r}")


def build_tree(draft: DraftTopK, budget: int, *, root=None, policy="paper", mode: str = "tree",
               backend: str = "auto") -> Tree:
    """DDTree's tree of at most `budget` draft nodes (plus the root) by `policy`, or the DFlash chain.

    mode="tree": the policy's tree at capacity N = budget + 1 ("paper", "spine_first", "sglang", or
    a policy object with its parameters). mode="chain": the top-1 path of depth min(budget, D),
    capacity N = min(budget, D) + 1. `root` [B] holds the last committed tokens (tokens[:, 0]); 0
    when omitted. The kernel builds the paper's policy. Token ids and roots must be >= 0: checked
    on the host path; device values are not read back (that would synchronise the step).
    """
    logp, ids, budget, root, policy = _check_build_args(draft, budget, root, policy, mode)
    chosen = _backend.resolve(backend, ("numpy", "cupy"), logp)
    if chosen == "cupy":
        _check_kernel_policy(policy, mode)
        return BuildLaunch(logp, ids, budget, root, mode, _empty_tree(logp, budget, mode))()
    logp, ids, root = to_numpy(logp), to_numpy(ids), to_numpy(root)
    check_draft_values(logp)
    check_token_ids("draft.ids", ids, None)
    check_token_ids("root", root, None)
    batch, depth_limit, _ = logp.shape
    capacity = tree_nodes(budget, mode=mode, depth=depth_limit)
    parents = np.full((batch, capacity), -1, np.int32)
    tokens = np.zeros((batch, capacity), np.int32)
    log_weights = np.full((batch, capacity), -np.inf, np.float64)
    for b in range(batch):
        popped = _chain_pops(logp[b], budget) if mode == "chain" else policy_pops(logp[b], budget, policy)
        tokens[b, 0] = root[b]
        log_weights[b, 0] = 0.0
        for i, (parent, depth, rank, log_w) in enumerate(popped, start=1):
            parents[b, i] = parent
            tokens[b, i] = ids[b, depth - 1, rank]
            log_weights[b, i] = log_w
    return tree_from_parents(parents, tokens, max_depth=depth_limit, log_weights=log_weights)


def policy_pops(logp: np.ndarray, budget: int, policy) -> list[tuple[int, int, int, float]]:
    """(parent, depth, rank, log w) of one request's nodes in the policy's node order; logp [D, K]."""
    if isinstance(policy, PaperPolicy):
        return best_first_pops(logp, budget)
    if isinstance(policy, SpineFirstPolicy):
        return best_first_pops(logp, budget, spine_first=True)
    depth_limit = logp.shape[0]
    if budget == depth_limit:
        return _chain_pops(logp, budget)
    width = policy.width(budget, depth_limit)
    stop_below = float(logp[0, 0]) - math.log(max(budget, 1)) - policy.stop_margin
    popped = best_first_pops(logp[:, :width], budget, child_bonus=policy.depth_bonus, stop_below=stop_below)
    return breadth_first(popped)


def breadth_first(popped: list[tuple[int, int, int, float]]) -> list[tuple[int, int, int, float]]:
    """The same nodes relabelled breadth-first from the root: depth-major, each node's children
    contiguous, in the order of their parents' new indices, a parent's children in pop order."""
    children: list[list[int]] = [[] for _ in range(len(popped) + 1)]
    for node, (parent, _, _, _) in enumerate(popped, start=1):
        children[parent].append(node)
    order, new_index = [0], {0: 0}
    for node in order:  # grows while it is walked: a queue
        for child in children[node]:
            new_index[child] = len(order)
            order.append(child)
    return [(new_index[popped[old - 1][0]],) + popped[old - 1][1:] for old in order[1:]]


def check_draft_values(logp: np.ndarray) -> None:
    """Host log-probabilities [B, D, K]: finite or -inf, at most 0, each row descending."""
    check_finite("draft.logp", logp, allow_neg_inf=True)
    if (logp > 0).any():
        raise ValueError(f"draft.logp: log-probabilities must be <= 0 (got {float(logp.max())}); "
                         "pass draft_topk's output, not logits")
    if (logp[..., 1:] > logp[..., :-1]).any():
        raise ValueError("draft.logp: each row must be sorted in descending order")


def best_first_pops(logp: np.ndarray, budget: int, *, child_bonus: float = 0.0, spine_first: bool = False,
                    stop_below: float | None = None) -> list[tuple[int, int, int, float]]:
    """(parent, depth, rank, log w) of each node one request's heap pops, in pop order (docs/DESIGN.md §3).

    logp [D, K] is the request's draft; with the defaults this is the paper's heap, what the reference
    build and the serving worker's CPU build run per request. The options are the other policies':
    `child_bonus` added to every first child's weight, `spine_first` (top-1 chain entries pop before
    any other), `stop_below` (an entry off the spine lighter than this is dropped: no node, no pushes).
    """
    depth_limit, k = logp.shape
    pops: list[tuple[int, int, int, float]] = []
    if logp[0, 0] == -np.inf:
        return pops
    first = float(logp[0, 0])
    # (off the spine first?, key, rank tuple, parent, depth, rank, log w, on the spine)
    heap = [(False, -first, (0,), 0, 1, 0, first, True)]
    while heap and len(pops) < budget:
        _, _, ranks, parent, depth, rank, log_w, spine = heapq.heappop(heap)
        if stop_below is not None and not spine and log_w < stop_below:
            continue
        pops.append((parent, depth, rank, log_w))
        node = len(pops)
        if rank + 1 < k and logp[depth - 1, rank + 1] != -np.inf:
            sibling_w = log_w - float(logp[depth - 1, rank]) + float(logp[depth - 1, rank + 1])
            heapq.heappush(heap, (spine_first, -sibling_w, ranks[:-1] + (rank + 1,), parent, depth, rank + 1,
                                  sibling_w, False))
        if depth < depth_limit and logp[depth, 0] != -np.inf:
            child_w = log_w + float(logp[depth, 0])
            if child_bonus:
                child_w += child_bonus
            heapq.heappush(heap, (spine_first and not spine, -child_w, ranks + (0,), node, depth + 1, 0, child_w,
                                  spine))
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


def _check_build_args(draft, budget, root, policy, mode):
    """Metadata checks shared by every backend (no device read); returns (logp, ids, budget, root, policy)."""
    if not isinstance(draft, DraftTopK):
        raise ValueError(f"draft: expected a DraftTopK, got {type(draft).__name__}")
    policy = resolve_policy(policy)
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
    return logp, draft.ids, budget, root, policy


def _check_kernel_policy(policy, mode: str) -> None:
    if mode == "tree" and not isinstance(policy, PaperPolicy):
        raise ValueError(f"policy: the kernel builds the 'paper' policy (and the chain); {policy.name!r} "
                         "runs on the host (backend='numpy'), or in SGLang's layout (SGLangBuildLaunch)")


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
# The kernel (kernels/tree_build.cu). Inputs are used zero-copy (made contiguous only when they are
# not), outputs are allocated in the inputs' framework, and every launch goes to torch's current
# stream (CuPy's when torch is not in use), so nothing here waits for the GPU.

BUILD_KERNEL = "build_tree_v2"
# logp staged in shared memory: with the kernel's static shared memory (its frontier) <= 99 KB, the
# opt-in limit of the 99 KB parts (tests/test_tree_kernels.py checks the sum against ptxas' report)
DRAFT_CACHE_BYTES = 51 * 1024
TREE_OUTPUTS = ("tokens", "parents", "depths", "n_nodes", "mask", "first_child", "next_sibling", "log_weights")


class BuildLaunch:
    """One prepared tree build: checked, converted and allocated once, so a call costs only the launch.

    Calling it enqueues one CTA per request on torch's current stream, reading the draft and root
    it was prepared with (refill them in place between calls), and returns `out`. Passing `draft`
    or `root` checks that they are those same buffers. Nothing here synchronises.
    """

    def __init__(self, logp, ids, budget: int, root, mode: str, out: Tree):
        batch, depth_limit, topk = (int(n) for n in logp.shape)
        self.out = out
        logp, ids, root = cuda.contiguous(logp), cuda.contiguous(ids), cuda.contiguous(root)
        self._inputs = logp, ids, root  # kept alive: the arguments hold their addresses
        self._signature = cuda.buffer_signature(logp, ids, root)
        if mode == "chain":
            threads, cached, staged_f64 = 32, 1, False
        else:  # the warps past the first stage the draft and write the outputs
            threads = min(512, max(128, -(-budget // 64) * 32))
            readable = min(topk, budget + 2)
            staged_f64 = 8 * depth_limit * readable <= DRAFT_CACHE_BYTES
            cached = readable if staged_f64 else min(readable, DRAFT_CACHE_BYTES // (4 * depth_limit))
        device = cuda.device_index(logp)
        _allow_draft_cache(device)
        self._launch = cuda.PreparedLaunch(
            cuda.device_function("tree_build.cu", BUILD_KERNEL, device), (batch,), (threads,),
            (cuda.pointer(logp), cuda.pointer(ids), cuda.pointer(root), np.int32(dtype_name(root) == "int64"),
             np.int32(depth_limit), np.int32(topk), np.int32(budget), np.int32(out.capacity),
             np.int32(mode == "chain"), np.int32(cached), np.int32(staged_f64),
             *(cuda.pointer(getattr(out, name)) for name in TREE_OUTPUTS)),  # the kernel's order
            shared_mem=(8 if staged_f64 else 4) * depth_limit * cached, device=device)

    def __call__(self, draft: DraftTopK | None = None, root=None) -> Tree:
        if draft is not None or root is not None:
            logp, ids, prepared_root = self._inputs
            given = cuda.buffer_signature(draft.logp if draft is not None else logp,
                                          draft.ids if draft is not None else ids,
                                          root if root is not None else prepared_root)
            if given != self._signature:
                raise ValueError("draft, root: not the buffers this launch was prepared with "
                                 "(same addresses, shapes and dtypes)")
        self._launch()
        return self.out


def prepare_build_launch(draft: DraftTopK, budget: int, *, root=None, policy: str = "paper", mode: str = "tree",
                         out: Tree | None = None) -> BuildLaunch:
    """The kernel build of build_tree's arguments on device arrays, prepared once; `out` may be given
    (tests poison it)."""
    logp, ids, budget, root, policy = _check_build_args(draft, budget, root, policy, mode)
    _check_kernel_policy(policy, mode)
    _backend.resolve("cupy", ("cupy",), logp)
    if out is None:
        return BuildLaunch(logp, ids, budget, root, mode, _empty_tree(logp, budget, mode))
    expected = _empty_tree_spec(int(logp.shape[0]), tree_nodes(budget, mode=mode, depth=int(logp.shape[1])))
    for name, (shape, dtype) in expected.items():
        check_array(f"out.{name}", getattr(out, name), dtypes=dtype, shape=shape)
        if not cuda.is_contiguous(getattr(out, name)):
            raise ValueError(f"out.{name}: expected a C-contiguous array (the kernel writes it in place)")
    check_same_device(**{"draft.logp": logp, **{f"out.{name}": getattr(out, name) for name in expected}})
    return BuildLaunch(logp, ids, budget, root, mode, out)


def _empty_tree_spec(batch: int, capacity: int) -> dict[str, tuple[tuple, str]]:
    """Each Tree array's (shape, dtype) at this batch and capacity, in TREE_OUTPUTS order."""
    nodes = (batch, capacity)
    return {"tokens": (nodes, "int32"), "parents": (nodes, "int32"), "depths": (nodes, "int32"),
            "n_nodes": ((batch,), "int32"), "mask": ((batch, capacity, (capacity + 31) // 32), "uint32"),
            "first_child": (nodes, "int32"), "next_sibling": (nodes, "int32"), "log_weights": (nodes, "float64")}


def _empty_tree(like, budget: int, mode: str) -> Tree:
    """Uninitialised Tree outputs on the device of `like` (logp [B, D, K]), in its framework; the
    kernel writes every element."""
    batch, depth_limit = int(like.shape[0]), int(like.shape[1])
    spec = _empty_tree_spec(batch, tree_nodes(budget, mode=mode, depth=depth_limit))
    return Tree(**{name: cuda.device_empty(like, shape, dtype) for name, (shape, dtype) in spec.items()},
                max_depth=depth_limit)


@functools.lru_cache(maxsize=None)
def _allow_draft_cache(device: int) -> None:
    """Let the build kernel take more than 48 KB of dynamic shared memory (once per device)."""
    import cupy
    with cupy.cuda.Device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # CuPy is moving this attribute
        cuda.device_function("tree_build.cu", BUILD_KERNEL, device).max_dynamic_shared_size_bytes = DRAFT_CACHE_BYTES


# ----------------------------------------------------------------------------------------------
# The "sglang" policy (and PR #29907's paper heap in pop order) on the GPU, in SGLang's layout
# (kernels/tree_build.cu: build_tree_sglang, eagle_tree_format), for kdtree_lib.integrations.sglang.

SGLANG_BUILD_KERNEL = "build_tree_sglang"
EAGLE_FORMAT_KERNEL = "eagle_tree_format"
SGLANG_THREADS = 256  # KD_SGLANG_THREADS
SGLANG_OUTPUTS = ("node_tokens", "node_depths", "parents", "visibility", "sizes", "next_token", "next_sibling",
                  "retrive_index", "bad")


class SGLangBuildLaunch:
    """One prepared build in SGLang's layout, for one shape on one CUDA device (torch tensors).

    Inputs: logp float32 [B, D, K] and ids int32|int64 [B, D, K], contiguous (SGLang's top-k). `policy`:
    an SGLangPolicy (its width, depth bonus, early stop off the spine, breadth-first order, and the
    top-1 chain when budget == D: SGLang's build_ddtree_tree) or PaperPolicy (the paper's heap over
    min(budget, K) ranks, nodes in pop order: SGLang PR #29907's build_ddtree_tree_from_topk).
    Outputs (allocate()): node_tokens, node_depths int64 [B, budget], parents int64 [B, N], visibility
    bool [B, N, N], sizes int64 [B], next_token, next_sibling int64 [B, N] (the EAGLE first-child /
    next-sibling arrays, written only with links=True; with `index` too, retrive_index int64 [B, N], b * N + node:
    SGLang's build_eagle_tree_format at draft_token_num N, whole), bad int32 [B] (1: the request's draft held
    NaN or +-inf at rank 0, or, with finite_all, anywhere it is read; its tree is then the root
    alone). Calling it enqueues one CTA per request on torch's current stream; nothing here reads a
    device value or synchronises.
    """

    def __init__(self, batch: int, depth: int, topk: int, budget: int, device: int, *, policy, ids_int64: bool,
                 links: bool = True, index: bool = False, finite_all: bool = False):
        policy = resolve_policy(policy)
        if isinstance(policy, SGLangPolicy):
            chain = budget == depth
            width = 1 if chain else min(policy.width(budget, depth), topk)
            bonus, margin, stop, relabel = float(policy.depth_bonus), float(policy.stop_margin), True, True
        elif isinstance(policy, PaperPolicy):
            chain, width, bonus, margin, stop, relabel = False, topk, 0.0, 0.0, False, False
        else:
            raise ValueError(f"policy: SGLang's layout is built for the 'sglang' and 'paper' policies, got {policy.name!r}")
        self.batch, self.budget, self.links, self.index = batch, budget, links, links and index
        # a rank >= budget never pops (it needs budget siblings popped first), so it is never read
        self.width = min(width, budget)
        null = np.uint64(0)  # logp, ids and the outputs are each call's: set per call
        self._launch = cuda.PreparedLaunch(
            cuda.device_function("tree_build.cu", SGLANG_BUILD_KERNEL, device), (batch,), (SGLANG_THREADS,),
            (null, null, np.int32(ids_int64), np.int32(depth), np.int32(topk), np.int32(self.width), np.int32(budget),
             np.int32(chain), np.int32(relabel), np.int32(finite_all), np.float64(bonus),
             np.float64(math.log(max(budget, 1))), np.float64(margin), np.int32(stop)) + (null,) * len(SGLANG_OUTPUTS),
            device=device)
        self._first_output = len(self._launch.params) - len(SGLANG_OUTPUTS)
        self._draft = (0, 0)  # the draft's addresses in the parameters now

    def allocate(self, like) -> dict:
        """Uninitialised outputs on the device of `like` (the kernel writes every element)."""
        import torch
        batch, nodes = self.batch, self.budget + 1
        spec = {"node_tokens": ((batch, self.budget), torch.int64), "node_depths": ((batch, self.budget), torch.int64),
                "parents": ((batch, nodes), torch.int64), "visibility": ((batch, nodes, nodes), torch.bool),
                "sizes": ((batch,), torch.int64), "next_token": ((batch, nodes), torch.int64),
                "next_sibling": ((batch, nodes), torch.int64), "retrive_index": ((batch, nodes), torch.int64),
                "bad": ((batch,), torch.int32)}
        if not self.links:
            del spec["next_token"], spec["next_sibling"]
        if not self.index:
            del spec["retrive_index"]
        return {name: torch.empty(shape, dtype=dtype, device=like.device) for name, (shape, dtype) in spec.items()}

    def __call__(self, logp, ids, out: dict) -> dict:
        self.launch_at(logp.data_ptr(), ids.data_ptr(),
                       [out[name].data_ptr() if name in out else 0 for name in SGLANG_OUTPUTS])
        return out

    def launch_at(self, logp: int, ids: int, outputs) -> None:
        """Enqueue the build over device addresses (Python ints, data_ptr()): the draft's, then the
        outputs' in SGLANG_OUTPUTS order (0 for one not written). A per-call path: the caller vouches
        for the buffers (dtype, shape, contiguity, device); the draft's parameters are rewritten only
        when they moved (a prepared top-k writes into the same buffers every call)."""
        launch = self._launch
        if logp != self._draft[0] or ids != self._draft[1]:
            launch.set_addresses(0, (logp, ids))
            self._draft = (logp, ids)
        launch.set_addresses(self._first_output, outputs)
        launch()


class EagleFormatLaunch:
    """SGLang's build_eagle_tree_format on the GPU, prepared for one (batch, columns, width) shape:
    parents int64 [B, columns] and sizes int64 [B] (contiguous) -> retrive_index, retrive_next_token,
    retrive_next_sibling int64 [B, width]. A size is clamped to [0, min(width, columns)] on the device
    (SGLang's loop raises an IndexError past them); nothing is read back."""

    def __init__(self, batch: int, columns: int, width: int, device: int):
        if width > MAX_BUDGET + 1:
            raise ValueError(f"draft_token_num: at most {MAX_BUDGET + 1} nodes, got {width}")
        self.batch, self.width = batch, width
        null = np.uint64(0)  # parents, sizes and the outputs are each call's: set per call
        self._launch = cuda.PreparedLaunch(cuda.device_function("tree_build.cu", EAGLE_FORMAT_KERNEL, device),
                                           (batch,), (SGLANG_THREADS,),
                                           (null, np.int32(columns), null, np.int32(width), null, null, null),
                                           device=device)

    def __call__(self, parents, sizes):
        import torch
        index, next_token, next_sibling = (torch.empty((self.batch, self.width), dtype=torch.int64, device=parents.device)
                                           for _ in range(3))
        launch = self._launch
        for slot, array in ((0, parents), (2, sizes), (4, index), (5, next_token), (6, next_sibling)):
            launch.set(slot, cuda.pointer(array))
        launch()
        return index, next_token, next_sibling
