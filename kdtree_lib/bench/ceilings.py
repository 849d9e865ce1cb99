"""What the GPU can do at best, measured here: the ceilings a benchmark draws its roofline from.

- `copy_bandwidth`: bytes/s of a device-to-device copy, bytes read plus written;
- `matmul_rate`: FLOP/s of cuBLAS's bf16 matmul on a large square product;
- `mma_sync_rate`: FLOP/s of the portable verify kernel's MMA alone (kernels/probes.cu);
- `launch_floor_seconds`: the time of an empty launch (kernels/probes.cu), a floor under any call;
- `launch_host_costs`: the host's microseconds per launch, CuPy's call against cuda.PreparedLaunch
  (rows of topic "launch_host": `python -m kdtree_lib.bench.ceilings [--results-dir DIR]`).

Shared by the benchmarks like `timing` (it measures no kernel of the project), and timed the way they
time their calls: `timing.gpu_seconds`, L2 flushed before each repeat.
"""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from .. import cli
from ..paths import GIB
from . import command_parser
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
    device = cupy.cuda.Device().id
    blocks = 2 * cupy.cuda.Device().attributes["MultiProcessorCount"]
    sink = cupy.zeros(1, cupy.float32)
    launch = cuda.PreparedLaunch(cuda.device_function(PROBES_FILE, "mma_sync_ceiling", device), (blocks,), (256,),
                                 (cuda.pointer(sink), np.int32(iters)), device=device)
    seconds = gpu_seconds(launch, reps=5, flush_bytes=SMALL_FLUSH)
    return blocks * 8 * iters * 8 * FLOPS_PER_MMA / seconds


def launch_floor_seconds() -> float:
    """Median time of an empty kernel under gpu_seconds (events around the call, L2 flushed first): the
    fixed cost of one launch, which every kernel pays (a split verify call pays it for its merge too).
    Launched as every kernel of the project is, through cuda.PreparedLaunch (rows before it launched
    through CuPy's call, whose host cost could fall inside the events)."""
    import torch
    from .. import cuda
    device = torch.cuda.current_device()
    launch = cuda.PreparedLaunch(cuda.device_function(PROBES_FILE, "launch_floor", device), (1,), (32,), (),
                                 device=device)
    return gpu_seconds(launch, reps=30)


LAUNCH_HOST_TOPIC = "launch_host"
LAUNCH_BATCH = 200  # launches back to back: well under the device's queue, so the host never waits on it


def launch_host_costs(*, batches: int = 25) -> list[dict]:
    """Host microseconds per launch (median over `batches` of LAUNCH_BATCH back-to-back launches, the
    device drained between batches) of kernels/probes.cu's launch_floor (no parameters) and
    launch_params (8: six scalars, two pointers, doing nothing), on torch's current stream, two ways:
    "cupy_call" as the launchers called CuPy before cuda.PreparedLaunch (a CuPy Stream wrapped around
    torch's per launch, CuPy converting each argument) and "prepared" (cuda.PreparedLaunch); and, for
    scale, one small torch op (`add_` on one element: kernel "torch_add_", path "torch"), the unit an
    eager model step pays per op."""
    _check_positive("batches", batches)
    import torch
    from .. import cuda
    device = torch.cuda.current_device()
    torch.cuda.synchronize()
    floor = cuda.device_function(PROBES_FILE, "launch_floor", device)
    params = cuda.device_function(PROBES_FILE, "launch_params", device)
    args = (np.int32(1), np.uint32(2), np.int64(3), np.uint64(4), np.float32(5), np.float64(6), np.uint64(0),
            np.uint64(0))
    one = torch.zeros(1, device=f"cuda:{device}")
    cases = {("launch_floor", 0, "cupy_call"): lambda: floor((1,), (32,), (), stream=cuda.current_stream()),
             ("launch_floor", 0, "prepared"): cuda.PreparedLaunch(floor, (1,), (32,), (), device=device),
             ("launch_params", 8, "cupy_call"): lambda: params((1,), (32,), args, stream=cuda.current_stream()),
             ("launch_params", 8, "prepared"): cuda.PreparedLaunch(params, (1,), (32,), args, device=device),
             ("torch_add_", 1, "torch"): lambda: one.add_(1)}
    rows = []
    for (kernel, n_args, path), call in cases.items():
        times = []
        for _ in range(batches + 1):  # the first batch warms up
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(LAUNCH_BATCH):
                call()
            times.append((time.perf_counter() - start) / LAUNCH_BATCH)
        torch.cuda.synchronize()
        rows.append({"kernel": kernel, "args": n_args, "path": path, "launches": LAUNCH_BATCH, "batches": batches,
                     "host_us_per_launch": 1e6 * statistics.median(times[1:])})
    return rows


@cli.command
def main(argv=None) -> int:
    parser = command_parser(__spec__.name, "Host cost per launch: CuPy's call against cuda.PreparedLaunch.")
    args = parser.parse_args(argv)
    from .. import results
    cli.require_cuda()
    rows = launch_host_costs()
    for r in rows:
        print(f"{r['kernel']:14s} {r['args']} args  {r['path']:10s} {r['host_us_per_launch']:7.2f} us/launch (host)")
    results.append_rows(LAUNCH_HOST_TOPIC, rows, results_dir=args.results_dir)
    return 0


def measure_ceilings() -> dict:
    """All four, in the units of the benchmark rows: copy_tbps, matmul_tflops, mma_sync_tflops, launch_floor_us."""
    return {"copy_tbps": copy_bandwidth() / 1e12, "matmul_tflops": matmul_rate() / 1e12,
            "mma_sync_tflops": mma_sync_rate() / 1e12, "launch_floor_us": launch_floor_seconds() * 1e6}


def _check_positive(name: str, value) -> None:
    if not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")


if __name__ == "__main__":
    sys.exit(main())
