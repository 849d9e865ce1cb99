"""RMSNorm over the last axis: the torch formula (the model's, DeepSeek-V3's and Qwen3's) and one kernel launch.

    out = weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)

The formula is ~8 torch ops (float, pow, mean, add, rsqrt, mul, to, mul), and most norms of a layer read
a residual add (one more op): an eager decode step pays a host launch for each. kernels/rms_norm.cu does
a norm, or the add and the norm, in one launch with torch's rounding points (the squares and their sum
in fp32, the normalised row rounded to the dtype, then the product with the weight rounded again).

- `rms_norm_reference` / `rms_norm_add_reference`: the formula in torch, on any device and dtype; the
  model's RMSNorm runs it wherever the kernel does not (CPU, fp32, autograd).
- `rms_norm` / `rms_norm_add`: the kernel, for bf16 or fp16 CUDA tensors whose weight has their dtype;
  every argument checked first (ValueError naming it), outputs optionally the caller's buffers.
- `kernel_takes` / `launch_norm`: the unchecked pair the model's forward uses per call: a cheap test
  of the layout, then a prepared launch (made once per shape, see `_prepared`) with only the buffer
  addresses rewritten; nothing synchronises, so it runs inside a CUDA graph capture as well.

The kernel's fp32 sum of squares adds in its own order (a fixed order per row length, whatever the
number of rows), torch's in another: the rsqrt argument moves by a few fp32 ulps, which flips an output
rounding rarely, by one step (tests/test_rms_norm_kernel.py derives the bound). Inputs whose squares
are fp32 subnormals (|x| < ~1e-19) may also differ: CuPy's builds flush subnormals to zero.
"""
from __future__ import annotations

import functools
import math
import threading

import numpy as np

from . import cuda
from .backend import cuda_available

KERNEL_FILE = "rms_norm.cu"
KERNEL_DTYPES = {"bfloat16": "bf16", "float16": "f16"}  # torch dtype name -> kernel name suffix
VALUES = 8                # KD_NORM_VALUES: 16-bit values per 16-byte vector
HELD = (1, 2, 4, 8)       # vectors a thread holds in registers: the kernels' kVec
MAX_THREADS = 1024
MAX_DIM = VALUES * HELD[-1] * MAX_THREADS  # 65 536
ALIGNMENT = 16            # bytes: every row, the weight and the outputs (16-byte vector loads and stores)
MAX_ROWS = 2**31 - 1      # the grid's x axis


# ----------------------------------------------------------------------------------------------
# the formula in torch

def rms_norm_reference(x, weight, eps: float):
    """weight * (x.float() * rsqrt(mean(x.float()^2, -1) + eps)).to(x.dtype): torch's ops, any device."""
    import torch
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rms_norm_add_reference(x, residual, weight, eps: float):
    """(the norm of s, s) for s = x + residual, with torch's ops."""
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


# ----------------------------------------------------------------------------------------------
# the kernel: checked entry points

def rms_norm(x, weight, eps: float, *, out=None):
    """The kernel's RMSNorm of x [..., D] (bf16 or fp16, CUDA) by weight [D] (x's dtype): a tensor of
    x's shape, written into `out` when given (C-contiguous, x's shape and dtype, on x's device)."""
    _check(x, weight, eps, out=out)
    return launch_norm(x, None, weight, float(eps), out=out)[0]


def rms_norm_add(x, residual, weight, eps: float, *, out=None, summed=None):
    """(norm of s, s) for s = x + residual [..., D] (rounded to their dtype as torch's add), in one launch;
    `out`/`summed`: the caller's buffers for them (C-contiguous, x's shape and dtype, x's device)."""
    _check(x, weight, eps, out=out, residual=residual, summed=summed, fused=True)
    return launch_norm(x, residual, weight, float(eps), out=out, summed=summed)


def _check(x, weight, eps, *, out, residual=None, summed=None, fused: bool = False) -> None:
    """Every argument's metadata; the device last, so the checks before it run on CPU tensors too."""
    import torch
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a torch tensor, got {type(x).__name__}")
    dtype = str(x.dtype).removeprefix("torch.")
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"x: expected one of {tuple(KERNEL_DTYPES)}, got {dtype}")
    if x.ndim < 1:
        raise ValueError("x: expected at least one axis (the normalised one), got a scalar")
    dim = int(x.shape[-1])
    if not (dim % VALUES == 0 and 0 < dim <= MAX_DIM):
        raise ValueError(f"x: the last axis must be a positive multiple of {VALUES} up to {MAX_DIM}, got {dim}")
    if _rows(x) > MAX_ROWS:
        raise ValueError(f"x: at most {MAX_ROWS} rows, got {_rows(x)}")
    _check_rows("x", x)
    if fused:
        _check_like("residual", residual, x)
        _check_rows("residual", residual)
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (dim,):
        raise ValueError(f"weight: expected a tensor of shape ({dim},), got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight: expected {x.dtype} on {x.device} (x's), got {weight.dtype} on {weight.device}")
    if not weight.is_contiguous() or weight.data_ptr() % ALIGNMENT:
        raise ValueError(f"weight: expected a contiguous tensor whose address is a multiple of {ALIGNMENT} bytes")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps: expected a finite number >= 0, got {eps!r}")
    _check_output("out", out, x)
    if fused:
        _check_output("summed", summed, x)
    if not x.is_cuda:
        raise ValueError(f"x: expected a CUDA tensor (the kernel runs on the GPU), got one on {x.device}")
    if not cuda_available():
        raise ValueError("x: the kernel needs CuPy and a CUDA device, and CuPy found none")


def _check_like(name: str, tensor, x) -> None:
    import torch
    if not isinstance(tensor, torch.Tensor) or tensor.shape != x.shape or tensor.dtype != x.dtype \
            or tensor.device != x.device:
        got = (f"{tuple(tensor.shape)} {tensor.dtype} on {tensor.device}" if isinstance(tensor, torch.Tensor)
               else type(tensor).__name__)
        raise ValueError(f"{name}: expected x's shape, dtype and device ({tuple(x.shape)} {x.dtype} on {x.device}), "
                         f"got {got}")


def _check_rows(name: str, tensor) -> None:
    stride = row_stride(tensor)
    if stride is None:
        raise ValueError(f"{name}: each row (last axis) must be contiguous and the rows evenly spaced, got strides "
                         f"{tuple(tensor.stride())} for shape {tuple(tensor.shape)}")
    if tensor.data_ptr() % ALIGNMENT or (stride * tensor.element_size()) % ALIGNMENT:
        raise ValueError(f"{name}: every row must start at a multiple of {ALIGNMENT} bytes (address "
                         f"{tensor.data_ptr()}, row stride {stride} elements)")


def _check_output(name: str, buffer, x) -> None:
    if buffer is None:
        return
    _check_like(name, buffer, x)
    if not buffer.is_contiguous() or buffer.data_ptr() % ALIGNMENT:
        raise ValueError(f"{name}: expected a C-contiguous buffer whose address is a multiple of {ALIGNMENT} bytes")


# ----------------------------------------------------------------------------------------------
# the kernel: the per-call path (no checks beyond kernel_takes)

def kernel_takes(x, weight) -> bool:
    """Whether the kernel can run on x and weight as they are (metadata only): CUDA, bf16/fp16 with the
    weight in the same dtype, a last axis of a multiple of 8 values up to MAX_DIM, evenly spaced
    16-byte aligned rows, a contiguous aligned weight, and CuPy present."""
    if not x.is_cuda or x.dtype != weight.dtype or str(x.dtype).removeprefix("torch.") not in KERNEL_DTYPES:
        return False
    dim = x.shape[-1] if x.ndim else 0
    if not (0 < dim <= MAX_DIM and dim % VALUES == 0) or weight.ndim != 1 or weight.shape[0] != dim:
        return False
    stride = row_stride(x)
    return (stride is not None and stride % VALUES == 0 and x.data_ptr() % ALIGNMENT == 0
            and weight.is_contiguous() and weight.data_ptr() % ALIGNMENT == 0 and x.device == weight.device
            and _rows(x) <= MAX_ROWS and cuda_available())


def row_stride(x) -> int | None:
    """Elements from one row (the last axis) of x to the next when every row is contiguous and the
    rows are evenly spaced (a contiguous tensor, or a slice of the last axis such as MLA's latent);
    None otherwise. One row or none: the row length."""
    shape, strides = x.shape, x.stride()
    if x.ndim == 0 or (strides[-1] != 1 and shape[-1] > 1):
        return None
    stride = expected = None
    for size, step in zip(reversed(shape[:-1]), reversed(strides[:-1])):
        if size == 1:
            continue
        if stride is None:
            stride = step
        elif step != expected:
            return None
        expected = step * size
    return int(shape[-1]) if stride is None else int(stride)


def launch_norm(x, residual, weight, eps: float, *, out=None, summed=None):
    """Enqueue the kernel on torch's current stream: (out, None) for a norm, (out, summed) for an add
    and norm (residual not None). x, residual and weight must pass kernel_takes (residual with x's
    shape); out/summed: C-contiguous aligned buffers of x's shape, or None to allocate them."""
    import torch
    dim = int(x.shape[-1])
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    kernel, threads = kernel_choice(str(x.dtype).removeprefix("torch."), dim, fused=residual is not None)
    launch = _prepared(kernel, x.device.index, _rows(x), threads, dim, eps, threading.get_ident())
    launch.set(0, x.data_ptr())
    launch.set(1, row_stride(x))
    if residual is None:
        launch.set(2, weight.data_ptr())
        launch.set(6, out.data_ptr())
    else:
        if summed is None:
            summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        launch.set(2, residual.data_ptr())
        launch.set(3, row_stride(residual))
        launch.set(4, weight.data_ptr())
        launch.set(8, out.data_ptr())
        launch.set(9, summed.data_ptr())
    launch()
    return out, summed


@functools.lru_cache(maxsize=None)
def kernel_choice(dtype: str, dim: int, *, fused: bool) -> tuple[str, int]:
    """(kernel name, threads per CTA) for rows of `dim` values: the fewest vectors per thread (HELD)
    that fit the row in MAX_THREADS threads, then the fewest whole warps that hold it."""
    vectors = dim // VALUES
    held = next(k for k in HELD if -(-vectors // k) <= MAX_THREADS)
    needed = -(-vectors // held)  # threads that hold the row
    threads = 32 * -(-needed // 32)
    prefix = "rms_norm_add" if fused else "rms_norm"
    return f"{prefix}_{KERNEL_DTYPES[dtype]}_held{held}", threads


@functools.lru_cache(maxsize=4096)
def _prepared(kernel: str, device: int, rows: int, threads: int, dim: int, eps: float, thread: int):
    """One launch per (kernel, device, rows, row length, eps) and calling thread (a launch's parameter
    buffer is rewritten per call, so threads never share one); the buffers' slots are filled per call."""
    null, stride = np.uint64(0), np.int64(0)
    # torch's CUDA mean multiplies the sum by fp32(rows / (rows * dim)): fp32(1/dim) below 2^24 elements
    scalars = (np.int32(dim), np.float32(1) / np.float32(dim), np.float32(eps))
    if kernel.startswith("rms_norm_add"):
        args = (null, stride, null, stride, null) + scalars + (null, null)
    else:
        args = (null, stride, null) + scalars + (null,)
    return cuda.PreparedLaunch(cuda.device_function(KERNEL_FILE, kernel, device), (rows,), (threads,), args,
                               device=device, name=kernel)


def _rows(x) -> int:
    return math.prod(x.shape[:-1])
