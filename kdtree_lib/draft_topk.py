"""The drafter's top-k log-probabilities per draft position: the DraftTopK of docs/DESIGN.md's contracts.

The official code computes `topk(logits) - logsumexp(logits)` in float32 with torch. With ties in the
draft a one-bit difference in a value reorders the tree, so the exact paths call those same torch ops:

- "numpy" (host inputs): torch's CPU ops, one request ([D, V]) at a time as the official code calls
  them (torch's CPU sum splits a single-row reduction across threads, so a row's value can depend on
  how many rows share the call); NumPy arrays out.
- "torch": torch's ops on the tensor's device, on the whole batch in one call (a GPU caller's cost).
  On a GPU these are torch's CUDA values for that batch shape; torch's CUDA reduction splits the
  vocabulary across blocks by the number of rows, so batch 1 ([1, D, V]) gives the official code's
  values exactly and larger batches may differ from it in the last bit of a row's normaliser.
- "cupy": the fused kernels of kernels/draft_topk.cu, one read of the logits. Up to k = FAST_MAX_K
  (128) v3 runs, one launch: many CTAs per row each read a slice of 4096-logit chunks from memory
  once and keep its (max, sum exp) and a superset of its top k; the last CTA of a row to finish
  selects the row's top k from them, in order, and subtracts log(sum) + max; above, v1 (one CTA per row). The selection is exact (the values are the
  logits themselves, ties by ascending token id); the normaliser is the kernel's own float32 sum,
  a few ulps from torch's (different summation order; tests/test_draft_topk.py derives the bound).
  Where that last-bit difference can change a tree: it shifts every log-probability of one draft
  position by nearly the same tiny amount (each value is rounded again), so the ranks within a
  position keep their order, and a tree can change only where two candidate nodes' log-weights lie
  within a few ulps of each other: nodes at different depths (their weights hold different positions'
  normalisers), or exact ties that torch's rounding and ours break differently. torch's own batched
  reduction differs from its per-request one in the same way. On the stand-in drafter's held-out
  logits no tree differed (tests/test_draft_topk.py counts them); "auto" still runs torch's exact
  formula, because the contract is the official code's tree on any input, tie-heavy ones included
  (docs/kernel-notes.md has the measurement behind that choice).
- "auto": "numpy" on the host, "torch" on a GPU.

Bad input (NaN, +inf, a row that is entirely -inf) raises a ValueError on the host paths. On a GPU a
value check would read the logits back and synchronise inside the decode step, so the device paths
check metadata only (a prepared launch once, when prepared); v3 writes a bad row's log-probabilities
as NaN and flags it in a device status word that `TopKLaunch.check_input()` reads off the hot path.
"""
from __future__ import annotations

import functools

import numpy as np

from . import backend as _backend
from . import cuda
from .checks import check_array, check_finite, check_positive_int, framework, is_on_gpu, to_numpy
from .contracts import MAX_TOPK, DraftTopK

LOGIT_DTYPES = ("float32", "float16", "bfloat16", "float64")
TOPK_THREADS = 1024  # KD_TOPK_THREADS in kernels/draft_topk.cu (v1)
SLICE_THREADS = 256  # KD_TOPK_SLICE_THREADS (v3)
SLICE = 4096         # KD_TOPK_SLICE: logits per v3 chunk
FAST_MAX_K = 128     # KD_TOPK_FAST_MAX_K: v3 up to this k, v1 above
MAX_CHUNKS = 4       # KD_TOPK_MAX_CHUNKS: SLICE-logit chunks per v3 slice
MAX_SLICES = 1024    # KD_TOPK_MAX_SLICES: v3's slices per row (the merging CTA holds their counts)
MAX_GRID_Y = 65_535  # v3's rows B*D run on the grid's y axis


def draft_topk(logits, k: int, *, backend: str = "auto") -> DraftTopK:
    """Log-softmax of the drafter's logits [B, D, V], top K = min(k, V) per position, rows descending."""
    check_array("logits", logits, dtypes=LOGIT_DTYPES, ndim=3)
    k = check_positive_int("k", k)
    if int(logits.shape[-1]) < 1:
        raise ValueError("logits: the vocabulary axis is empty")
    if int(logits.shape[1]) < 1:
        raise ValueError("logits: the draft depth D (axis 1) must be at least 1")
    if backend == "auto":
        backend = "torch" if is_on_gpu(logits) else "numpy"
    chosen = _backend.resolve(backend, ("numpy", "torch", "cupy"), logits)
    if chosen == "cupy":
        return prepare_draft_topk(cuda.contiguous(logits, "float32"), k, backend="cupy")()
    if chosen == "torch" and is_on_gpu(logits):
        return _torch_topk_on_device(logits, k)
    return _torch_topk_on_host(logits, k, torch_out=chosen == "torch" and framework(logits) == "torch")


def torch_topk_logprobs(logits, k: int):
    """The official formula on a torch tensor, on its device, in one call: (log-probabilities float32
    [..., k], token ids int64 [..., k]) = topk(logits.float()) - logsumexp(logits.float())."""
    import torch
    x = logits.float()
    values, ids = torch.topk(x, k, dim=-1)
    return values - torch.logsumexp(x, dim=-1, keepdim=True), ids


def _torch_topk_on_host(logits, k: int, *, torch_out: bool) -> DraftTopK:
    """The official formula with torch's CPU ops, per request; values checked first."""
    import torch
    x = torch.from_numpy(np.ascontiguousarray(to_numpy(logits))).float()
    check_finite("logits", x.numpy(), allow_neg_inf=True)
    if bool((x.amax(dim=-1) == float("-inf")).any()):
        raise ValueError("logits: a row is entirely -inf (no token has any probability)")
    top = min(k, int(x.shape[-1]))
    logp = torch.empty(x.shape[:-1] + (top,), dtype=torch.float32)
    ids = torch.empty(x.shape[:-1] + (top,), dtype=torch.int64)
    for b, request in enumerate(x):  # [D, V], as the official code calls the ops
        logp[b], ids[b] = torch_topk_logprobs(request, top)
    ids = ids.to(torch.int32)
    if torch_out:
        return DraftTopK(logp=logp, ids=ids)
    return DraftTopK(logp=logp.numpy(), ids=ids.numpy())


def _torch_topk_on_device(logits, k: int) -> DraftTopK:
    """The official formula with torch's CUDA ops on the whole batch; CuPy arrays are viewed zero-copy."""
    import torch
    x = logits if framework(logits) == "torch" else torch.as_tensor(logits, device=f"cuda:{logits.device.id}")
    logp, ids = torch_topk_logprobs(x, min(k, int(x.shape[-1])))
    ids = ids.to(torch.int32)
    if framework(logits) == "cupy":
        import cupy
        return DraftTopK(logp=cupy.asarray(logp), ids=cupy.asarray(ids))
    return DraftTopK(logp=logp, ids=ids)


class _PreparedTopK:
    """What both prepared top-k launches share: the logits buffer they read, checked when handed back."""

    def __init__(self, logits, out: DraftTopK):
        self.logits, self.out = logits, out
        self._signature = cuda.buffer_signature(logits)

    def _check(self, logits) -> None:
        if logits is not None and cuda.buffer_signature(logits) != self._signature:
            raise ValueError("logits: not the buffer this launch was prepared with (same address, shape and dtype)")


class TopKLaunch(_PreparedTopK):
    """One prepared fused top-k: checked, converted and allocated once, so a call costs only the launches.

    `path` says which kernel runs: "fused_v3" (k <= FAST_MAX_K: one launch of many CTAs per row, slices
    of `chunks` x SLICE logits, the last CTA of each row merging it) or "fused_v1" (larger k: one CTA per
    row). Calling it enqueues the kernel on torch's current stream over the logits it was prepared with (refill them in place
    between calls) and returns `out`; passing `logits` checks that it is that same buffer. Nothing
    here synchronises, so it can run back to back or inside a CUDA graph (v3 leaves its per-row
    tickets at zero after every launch). Values are not read back:
    v3 writes a row holding NaN, +inf or only -inf as NaN log-probabilities and flags it in a device
    status word, which `check_input` reads (one synchronisation, for callers off the hot path).
    """

    def __init__(self, logits, k: int, out: DraftTopK, *, chunks: int | None = None):
        super().__init__(logits, out)
        batch, depth, vocab = (int(n) for n in logits.shape)
        rows = batch * depth
        device = self._device = cuda.device_index(logits)
        vectorized = vocab % 4 == 0 and int(cuda.pointer(logits)) % 16 == 0  # float4 loads need aligned rows
        self.alignment = 16 if vectorized else 4  # bytes: what launch_over needs of another buffer
        self._shape_dtype = (tuple(logits.shape), str(logits.dtype))
        suffix = "vec4" if vectorized else "vec1"
        self.status = _device_zeros(logits, (1,))
        self.chunks = chunks or slice_chunks(rows, vocab, _multiprocessors(device))  # chunks: a study's override
        if not 1 <= self.chunks <= MAX_CHUNKS:
            raise ValueError(f"chunks: expected 1..{MAX_CHUNKS}, got {self.chunks}")
        slices = -(-vocab // (SLICE * self.chunks))
        if k <= FAST_MAX_K and rows <= MAX_GRID_Y and slices <= MAX_SLICES:
            self.path, self.version = "fused_v3", 3
            cap = candidate_room(k)
            self._keys = cuda.device_empty(logits, (rows, slices, cap), "int64")
            self._counts = cuda.device_empty(logits, (rows, slices), "int32")
            self._states = cuda.device_empty(logits, (rows, slices, 4), "float32")
            self._row_flags = _device_zeros(logits, (rows,))
            self._tickets = _device_zeros(logits, (rows,))
            self._launches = [] if rows == 0 else [
                cuda.PreparedLaunch(
                    cuda.device_function("draft_topk.cu", f"draft_topk_fused_{suffix}", device), (slices, rows),
                    (SLICE_THREADS,),
                    (cuda.pointer(logits), np.int32(vocab), np.int32(k), np.int32(self.chunks), np.int32(slices),
                     np.int32(cap), cuda.pointer(self._keys), cuda.pointer(self._counts), cuda.pointer(self._states),
                     cuda.pointer(self._row_flags), cuda.pointer(self._tickets), cuda.pointer(self.status),
                     cuda.pointer(out.logp), cuda.pointer(out.ids)), device=device)]
        else:
            self.path, self.version = "fused_v1", 1
            self._launches = [] if rows == 0 else [
                cuda.PreparedLaunch(cuda.device_function("draft_topk.cu", f"draft_topk_{suffix}", device), (rows,),
                                    (TOPK_THREADS,), (cuda.pointer(logits), np.int32(vocab), np.int32(k),
                                                      cuda.pointer(out.logp), cuda.pointer(out.ids)), device=device)]

    def __call__(self, logits=None) -> DraftTopK:
        if self._signature is None:
            raise ValueError("logits: this launch runs over the buffer each launch_over names (it keeps none)")
        self._check(logits)
        return self._enqueue()

    def _enqueue(self) -> DraftTopK:
        for launch in self._launches:
            launch()
        return self.out

    def launch_over(self, logits) -> DraftTopK:
        """Enqueue the launches over `logits`, for a caller whose logits move between calls (SGLang's
        worker hands the drop-in a new tensor each step). `logits` must fit as the prepared buffer did
        (float32, C-contiguous, the same shape and device, its address a multiple of `alignment`): a
        ValueError naming it otherwise (metadata only). The launch keeps no reference to it, nor from
        then on to the buffer it was prepared with (a prepared shape would otherwise hold a logits
        tensor alive): every later call goes through launch_over."""
        logits_shape, logits_dtype = self._shape_dtype
        address = int(cuda.pointer(logits))
        if (tuple(logits.shape) != logits_shape or str(logits.dtype) != logits_dtype or not cuda.is_contiguous(logits)
                or cuda.device_index(logits) != self._device or address % self.alignment):
            raise ValueError(f"logits: expected a C-contiguous {logits_dtype} buffer of shape {logits_shape} on the "
                             f"launch's device, {self.alignment}-byte aligned, got {tuple(logits.shape)} {logits.dtype}")
        if self._launches:
            self._launches[0].set(0, address)  # v1's and v3's first parameter is the logits
        self.logits = self._signature = None
        return self._enqueue()

    def check_input(self) -> None:
        """Raise a ValueError naming `logits` if any call since the last check met NaN, +inf or a row
        that is entirely -inf (v3 only: v1 does not flag). Reads the device status: synchronises."""
        flags = int(to_numpy(self.status)[0])
        if flags:
            self.status.fill_(0) if framework(self.status) == "torch" else self.status.fill(0)
            found = [what for bit, what in ((1, "NaN"), (2, "+inf"), (4, "a row that is entirely -inf")) if flags & bit]
            raise ValueError(f"logits: contains {' and '.join(found)} (those draft positions came out as NaN)")


def slice_chunks(rows: int, vocab: int, multiprocessors: int) -> int:
    """SLICE-logit chunks per v3 slice: at least 3, and up to 4 once one chunk per CTA would fill two
    waves of 4 resident CTAs per multiprocessor. Fewer chunks mean more CTAs reading at once but more
    candidates for the row's merging CTA (about 1.1 k per slice) and one more fixed cost per CTA;
    on the H200 at e2fc428 (v3 before its merge was cheapened), D=7 in a CUDA graph, chunks 1/2/3/4 took
    B=1: 14.1/12.8/13.7/14.7 us (k=8) and 26.8/18.9/17.2/17.9 (k=64); B=8: 36.9/29.0/27.3/27.7 and
    52.3/38.7/33.4/33.6; B=64: 211/161/155/151 and 261/194/176/165 (docs/kernel-notes.md has the study
    at the committed kernel). Not 8: at 8948252 (v2), B=64 k=64 took 228.1 us with 8 chunks against
    170.7 with 4, its re-reads then missing L2."""
    return max(3, min(MAX_CHUNKS, rows * -(-vocab // SLICE) // (8 * multiprocessors)))


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: int) -> int:
    import cupy
    return int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])


def candidate_room(k: int) -> int:
    """Candidates a v3 slice may keep (>= 2k; a slice with more logits >= its bound selects exactly)."""
    return max(32, 2 * k)


def _device_zeros(like, shape: tuple):
    """int32 zeros on the device of `like`, in its framework."""
    zeros = cuda.device_empty(like, shape, "int32")
    zeros.zero_() if framework(zeros) == "torch" else zeros.fill(0)
    return zeros


class ExactTopKLaunch(_PreparedTopK):
    """draft_topk's exact path on the GPU (torch's topk - logsumexp for the batch) into fixed buffers:
    the same values, with no allocation per call, so it can be replayed in a CUDA graph beside the build.

    Calling it enqueues torch's ops on the current stream over the logits it was prepared with and
    returns `out`; passing `logits` checks that it is that same buffer.
    """

    path, version = "exact", ""

    def __init__(self, logits, k: int, out: DraftTopK):
        import torch
        super().__init__(logits, out)
        self.k = k
        self._x = logits if framework(logits) == "torch" else torch.as_tensor(logits, device=f"cuda:{logits.device.id}")
        self._logp = out.logp if framework(out.logp) == "torch" else torch.as_tensor(out.logp, device=self._x.device)
        self._ids = out.ids if framework(out.ids) == "torch" else torch.as_tensor(out.ids, device=self._x.device)
        self._values = torch.empty(self._logp.shape, dtype=torch.float32, device=self._x.device)
        self._indices = torch.empty(self._logp.shape, dtype=torch.int64, device=self._x.device)
        self._log_z = torch.empty(self._logp.shape[:-1] + (1,), dtype=torch.float32, device=self._x.device)

    def __call__(self, logits=None) -> DraftTopK:
        import torch
        self._check(logits)
        torch.topk(self._x, self.k, dim=-1, out=(self._values, self._indices))
        torch.logsumexp(self._x, dim=-1, keepdim=True, out=self._log_z)
        torch.sub(self._values, self._log_z, out=self._logp)
        self._ids.copy_(self._indices)
        return self.out


def prepare_draft_topk(logits, k: int, *, backend: str = "auto", out: DraftTopK | None = None):
    """A prepared draft top-k for C-contiguous float32 device logits [B, D, V], read in place by every
    call: backend "torch" (or "auto") the exact path (ExactTopKLaunch), "cupy" the fused kernel
    (TopKLaunch); `out` may be given (tests poison it)."""
    check_array("logits", logits, dtypes="float32", ndim=3)
    k = check_positive_int("k", k)
    if backend not in ("auto", "torch", "cupy"):
        raise ValueError(f"backend: a prepared launch is 'torch' (exact, the default) or 'cupy' (fused), got {backend!r}")
    batch, depth, vocab = (int(n) for n in logits.shape)
    if vocab < 1:
        raise ValueError("logits: the vocabulary axis is empty")
    top = min(k, vocab)
    if backend == "cupy" and top > MAX_TOPK:
        raise ValueError(f"k: the GPU top-k keeps at most {MAX_TOPK} per position, got {k}")
    _backend.resolve("cupy", ("cupy",), logits)
    if not cuda.is_contiguous(logits):
        raise ValueError("logits: a prepared launch reads the buffer in place and needs it C-contiguous")
    if out is None:
        out = DraftTopK(logp=cuda.device_empty(logits, (batch, depth, top), "float32"),
                        ids=cuda.device_empty(logits, (batch, depth, top), "int32"))
    check_array("out.logp", out.logp, dtypes="float32", shape=(batch, depth, top))
    check_array("out.ids", out.ids, dtypes="int32", shape=(batch, depth, top))
    return TopKLaunch(logits, top, out) if backend == "cupy" else ExactTopKLaunch(logits, top, out)
