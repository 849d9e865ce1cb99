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
- "cupy": the fused kernel of kernels/draft_topk.cu, one read of the logits. Its selection is exact
  (the values are the logits themselves, ties ordered by ascending token id); its normaliser is its
  own float32 sum, a few ulps from torch's. Not bit-exact, so "auto" never picks it.
- "auto": "numpy" on the host, "torch" on a GPU.

Bad input (NaN, +inf, a row that is entirely -inf) raises a ValueError on the host paths; on a GPU a
value check would read the logits back and synchronise, so device paths check metadata only and a bad
row comes out as NaN log-probabilities.
"""
from __future__ import annotations

import numpy as np

from . import backend as _backend
from . import cuda
from .checks import check_array, check_finite, check_positive_int, framework, is_on_gpu, to_numpy
from .contracts import MAX_TOPK, DraftTopK

LOGIT_DTYPES = ("float32", "float16", "bfloat16", "float64")
TOPK_THREADS = 1024  # KD_TOPK_THREADS in kernels/draft_topk.cu


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
    """One prepared fused top-k: checked, converted and allocated once, so a call costs only the launch.

    Calling it enqueues the kernel on torch's current stream over the logits it was prepared with
    (refill them in place between calls) and returns `out`; passing `logits` checks that it is that
    same buffer. Nothing here synchronises, so it can run back to back or inside a CUDA graph.
    """

    def __init__(self, logits, k: int, out: DraftTopK):
        super().__init__(logits, out)
        batch, depth, vocab = (int(n) for n in logits.shape)
        vectorized = vocab % 4 == 0 and int(cuda.pointer(logits)) % 16 == 0  # float4 loads need aligned rows
        self._function = cuda.device_function("draft_topk.cu", "draft_topk_vec4" if vectorized else "draft_topk_vec1",
                                              cuda.device_index(logits))
        self._grid = (batch * depth,)
        self._args = (cuda.pointer(logits), np.int32(vocab), np.int32(out.logp.shape[-1]),
                      cuda.pointer(out.logp), cuda.pointer(out.ids))

    def __call__(self, logits=None) -> DraftTopK:
        self._check(logits)
        if self._grid[0]:
            self._function(self._grid, (TOPK_THREADS,), self._args, stream=cuda.current_stream())
        return self.out


class ExactTopKLaunch(_PreparedTopK):
    """draft_topk's exact path on the GPU (torch's topk - logsumexp for the batch) into fixed buffers:
    the same values, with no allocation per call, so it can be replayed in a CUDA graph beside the build.

    Calling it enqueues torch's ops on the current stream over the logits it was prepared with and
    returns `out`; passing `logits` checks that it is that same buffer.
    """

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
