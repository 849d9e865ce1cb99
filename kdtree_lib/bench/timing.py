"""The one way to time a call: CUDA events on torch's stream, warm-up first, medians of repeats.

Three clocks, for three questions:
- `gpu_seconds`: one call's GPU time as a cold call sees it (L2 flushed before each repeat, where the
  working set would otherwise stay cached between repeats and flatter the kernel);
- `graph_seconds`: GPU time per call when calls run back to back in a CUDA graph, as a decode step
  replays them (launch overhead amortised, caches as warm as the step leaves them);
- `host_seconds`: wall time per eager call, synchronised once at the end: what a Python caller pays
  to issue it (validation, allocation, launch).
Segments of a larger step use `Clock` and `time_segments`, which work on a CPU run too.
All return seconds.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import numpy as np

FLUSHES = ("write", "read", "none")
L2_FLUSH_BYTES = 256 << 20  # larger than any L2 of the parts we time (H200 60 MB, RTX PRO 6000 128 MB)


def gpu_seconds(fn: Callable, *, reps: int = 10, warmup: int = 1, flush: str = "write",
                flush_bytes: int = L2_FLUSH_BYTES) -> float:
    """Median seconds of fn() over reps, each after flushing L2.

    flush: "write" zeroes a large buffer (triton's do_bench; L2 is left full of dirty lines that the
    timed call may pay to write back), "read" sums it (L2 left holding clean lines), "none" keeps L2
    warm.
    """
    import torch
    if flush not in FLUSHES:
        raise ValueError(f"flush: expected one of {FLUSHES}, got {flush!r}")
    reps = _positive("reps", reps)
    buffer = torch.empty(flush_bytes if flush != "none" else 0, dtype=torch.int8, device="cuda")
    evict = {"write": buffer.zero_, "read": lambda: buffer.view(torch.int32).sum(), "none": lambda: None}[flush]
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        evict()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3


def graph_seconds(fn: Callable, *, calls: int = 20, trials: int = 5) -> tuple[float, str]:
    """GPU seconds per call of fn(): a CUDA graph of `calls` calls, replayed `trials` times (median).

    Returns (seconds, method): method is "cuda_graph", or "stream" when fn cannot be captured (then
    back-to-back launches on the stream are timed: capture is an optimisation of the measurement,
    never a reason to skip it).
    """
    import torch
    calls, trials = _positive("calls", calls), _positive("trials", trials)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # lazy initialisation (compiles, allocations) must not be captured
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        replay, method = graph.replay, "cuda_graph"
    except Exception:
        torch.cuda.synchronize()
        replay, method = (lambda: [fn() for _ in range(calls)]), "stream"
    replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(trials):
        start.record()
        replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(samples), method


def host_seconds(fn: Callable, *, calls: int = 50) -> float:
    """Host wall seconds per eager call of fn() over back-to-back calls, synchronised once at the end."""
    import torch
    calls = _positive("calls", calls)
    fn()
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - begin) / calls


def wall_seconds(fn: Callable, *, min_seconds: float = 0.1, max_reps: int = 20) -> float:
    """Median host wall seconds of fn(), which returns with its work finished (a CPU call, or one that
    synchronises). A first call slower than min_seconds is the only measurement."""
    times = []
    started = time.perf_counter()
    while len(times) < max_reps:
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
        if time.perf_counter() - started >= min_seconds:
            break
    return statistics.median(times)


class Clock:
    """Marks on the GPU's clock (CUDA events) or, on a CPU run (synchronous), the host's."""

    def __init__(self, device):
        self.cuda = getattr(device, "type", str(device)) == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        import torch
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start

    def sync(self) -> None:
        if self.cuda:
            import torch
            torch.cuda.synchronize()


def time_segments(runs: list[Callable], clock: Clock, *, repeats: int, warmup: int) -> np.ndarray:
    """seconds [repeats, len(runs)]: the runs one after another, a clock mark between each."""
    for _ in range(warmup):
        for run in runs:
            run()
    trials = []
    for _ in range(repeats):
        marks = [clock.mark()]
        for run in runs:
            run()
            marks.append(clock.mark())
        trials.append(marks)
    clock.sync()
    return np.array([[clock.seconds(a, b) for a, b in zip(marks, marks[1:])] for marks in trials])


def _positive(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return int(value)
