"""What the GPU can do at best, measured here: the ceilings a benchmark draws its roofline from.

- `copy_bandwidth`: bytes/s of a device-to-device copy, bytes read plus written;
- `matmul_rate`: FLOP/s of cuBLAS's bf16 matmul on a large square product;
- `mma_sync_rate`: FLOP/s of the portable verify kernel's MMA alone (kernels/probes.cu);
- `launch_floor_seconds`: the time of an empty launch (kernels/probes.cu), a floor under any call.

Shared by the benchmarks like `timing` (it measures no kernel of the project), and timed the way they
time their calls: `timing.gpu_seconds`, L2 flushed before each repeat.
"""
from __future__ import annotations

import numpy as np

from ..paths import GIB
from .timing import gpu_seconds

PROBES_FILE = "probes.cu"
COPY_BYTES = 2 * GIB
MATMUL_SIZE = 8192
SMALL_FLUSH = 1 << 20  # the probes' working sets dwarf L2 (copy, matmul) or live in registers (mma)
FLOPS_PER_MMA = 2 * 16 * 8 * 16  # one m16n8k16


def copy_bandwidth(n_bytes: int = COPY_BYTES) -> float:
    """Bytes/s of copying n_bytes on the device, counting bytes read plus written."""
    _check_positive("n_bytes", n_bytes)
    import torch
    source = torch.empty(n_bytes, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    return 2 * n_bytes / gpu_seconds(lambda: target.copy_(source), reps=10, flush_bytes=SMALL_FLUSH)


def matmul_rate(size: int = MATMUL_SIZE) -> float:
    """FLOP/s of torch.mm (cuBLAS) on two bf16 size x size matrices."""
    _check_positive("size", size)
    import torch
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    return 2 * size ** 3 / gpu_seconds(lambda: torch.mm(a, b), reps=10, flush_bytes=SMALL_FLUSH)


def mma_sync_rate(iters: int = 8192) -> float:
    """FLOP/s of kernels/probes.cu's mma_sync_ceiling: 8 warps x 8 chains a block, 2 blocks per SM."""
    _check_positive("iters", iters)
    import cupy
    from .. import cuda
    kernel = cuda.get_function(PROBES_FILE, "mma_sync_ceiling")
    blocks = 2 * cupy.cuda.Device().attributes["MultiProcessorCount"]
    sink = cupy.zeros(1, cupy.float32)
    seconds = gpu_seconds(lambda: kernel((blocks,), (256,), (sink, np.int32(iters)), stream=cuda.current_stream()),
                          reps=5, flush_bytes=SMALL_FLUSH)
    return blocks * 8 * iters * 8 * FLOPS_PER_MMA / seconds


def launch_floor_seconds() -> float:
    """Median time of an empty kernel under gpu_seconds (events around the call, L2 flushed first): the
    fixed cost of one launch, which every kernel pays (a split verify call pays it for its merge too)."""
    from .. import cuda
    kernel = cuda.get_function(PROBES_FILE, "launch_floor")
    return gpu_seconds(lambda: kernel((1,), (32,), (), stream=cuda.current_stream()), reps=30)


def measure_ceilings() -> dict:
    """All four, in the units of the benchmark rows: copy_tbps, matmul_tflops, mma_sync_tflops, launch_floor_us."""
    return {"copy_tbps": copy_bandwidth() / 1e12, "matmul_tflops": matmul_rate() / 1e12,
            "mma_sync_tflops": mma_sync_rate() / 1e12, "launch_floor_us": launch_floor_seconds() * 1e6}


def _check_positive(name: str, value) -> None:
    if not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
