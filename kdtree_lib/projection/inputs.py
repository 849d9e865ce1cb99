"""The box's inputs, each a value with the rows it came from, or a loud ASSUMPTION naming its parameter."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from .. import results
from .calibration import fit_kernel_time, fit_residuals
from .physics import Refusal, Unphysical, check_efficiency, check_rows, row_label, rows_label
from .roofline import Efficiency, Hardware, KernelTime
from .rows import BOX_MOE_PROVIDER, PORTABLE_VERIFY_CONFIGS, box_build_rows, box_topk_rows, portable_verify_rows


@dataclass(frozen=True)
class Input:
    """One number the projection rests on and where it came from: measured rows, or an ASSUMPTION."""
    name: str
    value: float
    source: str
    measured: bool

    def line(self) -> str:
        return f"{self.name} = {self.value:.4g}  [{'measured' if self.measured else 'ASSUMPTION'}: {self.source}]"


def assumed(name: str, value: float, parameter: str, why: str) -> Input:
    """An input no measured row gives: the value of `parameter`, labelled as the assumption it is."""
    return Input(name, float(value), f"parameter {parameter}: {why}", False)


def rows_source(file: str, rows: list[dict], what: str) -> str:
    """'<file>, <what>: <n> rows of <device> at commit <c>, <date>' for printing."""
    stamps = sorted({(str(r.get("device")), str(r.get("commit")), str(r.get("date"))[:10]) for r in rows})
    runs = "; ".join(f"{device} at commit {commit}, {date}" for device, commit, date in stamps[:3])
    return f"{file}, {what}: {len(rows)} rows of {runs}" + (" ..." if len(stamps) > 3 else "")


@dataclass(frozen=True)
class KernelInputs:
    """A kernel's fitted time, its printable Inputs, the rows it was fitted on and the rows refused."""
    time: KernelTime
    inputs: list[Input]
    rows: list[dict]
    refused: list[Refusal]
    residuals: tuple[float, ...] = ()   # model / measured − 1 of each row of `rows`
    size_key: str = "batch"              # the rows' column that sets the kernel's work per request group

    def lines_at(self, sizes=None) -> list[str]:
        """Per size (values of size_key; None: every measured one): the rows the fit used there (or at the
        nearest measured size), the model's range against them and the row it misses most, with its
        stamp; then every refused row."""
        name = self.inputs[0].name.split(".")[0] if self.inputs else "kernel"
        if not self.rows:
            return [f"{name}: no rows; the parameter's ASSUMPTION is used"]
        measured_sizes = sorted({int(float(r[self.size_key])) for r in self.rows})
        lines = []
        for size in (measured_sizes if sizes is None else sizes):
            at = min(measured_sizes, key=lambda b: (abs(math.log2(b / size)), -b))
            picked = [(r, e) for r, e in zip(self.rows, self.residuals) if int(float(r[self.size_key])) == at]
            worst_row, worst = max(picked, key=lambda p: abs(p[1]))
            where = f"{self.size_key}={size}" + ("" if at == size else f" (nearest measured {self.size_key}={at})")
            lines.append(f"{name} {where}: {len(picked)} rows, model {min(e for _, e in picked):+.0%} .. "
                         f"{max(e for _, e in picked):+.0%} of measured; furthest {row_label(worst_row)} "
                         f"{float(worst_row['time_us']):.1f} us, model {worst:+.0%}")
        return lines + [r.line() for r in self.refused]


def kernel_fit(name: str, file: str, rows: list[dict], *, bytes_seconds, measured, flops_seconds=None, what: str,
               assumed_time: KernelTime, parameter: str, size_key: str = "batch") -> KernelInputs:
    """The KernelTime fitted on rows (bytes_seconds, flops_seconds, measured: functions of a row, in
    seconds), or the parameter's assumption when there are no rows. Rows faster than their roofline are
    refused first (physics.check_rows); a fit or an assumption with an efficiency above 1 raises Unphysical
    naming the rows (or the parameter) that produced it."""
    kept, refused = check_rows(file, rows, measured=measured, bytes_seconds=bytes_seconds, flops_seconds=flops_seconds)
    terms = ([bytes_seconds(r) for r in kept], [measured(r) for r in kept],
             None if flops_seconds is None else [flops_seconds(r) for r in kept])
    if kept:
        fitted = fit_kernel_time(*terms)
        residuals = fit_residuals(fitted, *terms)
        source = rows_source(file, kept, f"{what}, fitted as fixed + max(bytes, FLOPs) roofline terms (model within "
                                         f"{residuals.min():+.0%} .. {residuals.max():+.0%} of every row"
                                         + (f"; {len(refused)} rows refused" if refused else "") + ")")
        check_efficiency(fitted, source=f"the fit on {file} rows {rows_label(kept)}")
        measured_here = True
    elif refused:
        raise Unphysical(f"rows: every {what} row of {file} is faster than its roofline; first: {refused[0].line()}")
    else:
        fitted, source, measured_here = assumed_time, f"parameter {parameter}: no {what} rows in {file} yet", False
        check_efficiency(fitted, source=f"parameter {parameter}")
    values = {"fixed_seconds": fitted.fixed, "bytes_efficiency": fitted.bytes_efficiency,
              "flops_efficiency": fitted.flops_efficiency}
    inputs = [Input(f"{name}.{key}", value, source, measured_here) for key, value in values.items() if value is not None]
    return KernelInputs(fitted, inputs, kept, refused, tuple(float(e) for e in residuals) if kept else (), size_key)


def _tbps_seconds(column: str, rate_column: str) -> Callable[[dict], float]:
    """A row's `column` (bytes or FLOPs) over its run's measured ceiling `rate_column` (in T/s): its roofline seconds."""
    return lambda r: float(r[column]) / (float(r[rate_column]) * 1e12)


def verify_kernel_inputs(rows: list[dict], *, heads: int, assumed_time: KernelTime) -> KernelInputs:
    """The portable verify kernel's time model from data/results/verify_attn.csv rows (its bytes and
    FLOPs over the run's measured ceilings), or `assumed_time` (the caller's parameter
    assumed_verify_time, labelled as an ASSUMPTION) when there are no such rows."""
    return kernel_fit("verify_attention", "data/results/verify_attn.csv", portable_verify_rows(rows, heads=heads),
                      bytes_seconds=_tbps_seconds("bytes", "copy_tbps"), flops_seconds=_tbps_seconds("flops", "matmul_tflops"),
                      measured=lambda r: float(r["time_us"]) * 1e-6, assumed_time=assumed_time,
                      what=f"portable kernel ({'/'.join(PORTABLE_VERIFY_CONFIGS.values())}), {heads} heads",
                      parameter="assumed_verify_time")


def moe_kernel_inputs(rows: list[dict], *, tp: int, assumed_time: KernelTime) -> KernelInputs:
    """The INT4 MoE kernel's time model on the box's 99 KB plan from data/results/moe_int4.csv rows
    of the TP=tp slice (touched bytes over the run's copy bandwidth), or `assumed_time` (the caller's
    parameter assumed_moe_time, labelled): that file does not exist until bench.moe_int4 runs on a GPU."""
    picked = results.latest_run(results.select(rows, provider=BOX_MOE_PROVIDER, tp=tp))
    return kernel_fit("int4_experts", "data/results/moe_int4.csv", picked,
                      bytes_seconds=_tbps_seconds("bytes", "copy_tbps"),
                      measured=lambda r: float(r["time_us"]) * 1e-6, assumed_time=assumed_time,
                      what=f"{BOX_MOE_PROVIDER}, TP={tp}", parameter="assumed_moe_time", size_key="tokens")


def box_efficiency(efficiency: Efficiency, verify: KernelTime, experts: KernelTime) -> Efficiency:
    """`efficiency` (the rest, from the verify-step rows) with the box's two kernels' own times."""
    return replace(efficiency, tree_attention=verify.bytes_efficiency, tree_attention_flops=verify.flops_efficiency,
                   tree_attention_fixed=verify.fixed, experts=experts.bytes_efficiency,
                   experts_flops=experts.flops_efficiency, experts_fixed=experts.fixed)


def row_seconds_by_batch(rows: list[dict], batch: int, *, size_key: str, size: int) -> tuple[float, str]:
    """(seconds, how) of a kernel at `batch` from rows of several batches: the rows at the measured size
    nearest `size` (column size_key, log distance); at a measured batch its row, between two measured
    batches the linear interpolation of their rows (these kernels' time grows with the batch's bytes),
    outside them the nearest batch's row, said so."""
    sizes = sorted({int(float(r[size_key])) for r in rows})
    nearest = min(sizes, key=lambda s: (abs(math.log2(s / max(size, 1))), -s))
    times: dict[int, list[float]] = {}
    for r in rows:
        if int(float(r[size_key])) == nearest:
            times.setdefault(int(r["batch"]), []).append(float(r["time_us"]) * 1e-6)
    at_size = {b: float(np.median(t)) for b, t in times.items()}  # the median of a run's rows of one shape
    batches = sorted(at_size)
    label = f"{size_key}={nearest}"
    if batch in at_size:
        return at_size[batch], f"B={batch} {label}"
    below, above = [b for b in batches if b < batch], [b for b in batches if b > batch]
    if below and above:
        lo, hi = below[-1], above[0]
        weight = (batch - lo) / (hi - lo)
        return ((1 - weight) * at_size[lo] + weight * at_size[hi],
                f"B={batch} interpolated between B={lo} and B={hi} {label}")
    edge = below[-1] if below else above[0]
    return at_size[edge], f"B={edge} {label} (nearest measured batch to B={batch}, outside the measured range)"


def tree_stage_cost(build_rows: list[dict], accept_rows: list[dict], *, depth: int, assumed_seconds: float,
                    scale: float = 1.0) -> Callable[[int, int], Input]:
    """Input(batch, budget): the tree stage of a round measured on the kernels the box runs, times `scale`:
    draft top-k over the vocabulary (rows.box_topk_rows of data/results/tree_build.csv), the build (its
    newest kernel version, CUDA graph, at `depth`), accept + 61-layer compaction (tree_accept.csv), each
    from its newest run, taken at the request's batch (row_seconds_by_batch) and the budget nearest;
    draft top-k rows faster than their roofline are refused (physics.check_rows). Without rows,
    `assumed_seconds` (the caller's parameter assumed_tree_stage_seconds, labelled)."""
    topk, refused = check_rows("data/results/tree_build.csv", box_topk_rows(build_rows),
                               measured=lambda r: float(r["time_us"]) * 1e-6,
                               bytes_seconds=lambda r: float(r.get("roofline_us") or 0.0) * 1e-6)
    build = box_build_rows(build_rows, depth=depth)
    walk = results.latest_run(results.select(accept_rows, method="accept_compact_kernel"))
    parts = (("draft_topk", topk, "topk"), ("build", build, "budget"), ("accept_compact", walk, "budget"))

    def seconds(batch: int, budget: int) -> Input:
        if not (topk and build and walk):
            return assumed("tree_stage_seconds", assumed_seconds, "assumed_tree_stage_seconds",
                           "no draft_topk/build/accept_compact kernel rows in tree_build.csv / tree_accept.csv")
        total, where = 0.0, []
        for name, rows, size_key in parts:
            value, how = row_seconds_by_batch(rows, batch, size_key=size_key, size=max(budget, 1))
            total += value
            where.append(f"{name} {how}: {value * 1e6:.1f} us ({rows[0]['device']}, {rows[0]['commit']}, "
                         f"{str(rows[0]['date'])[:10]})")
        refusals = f"; {len(refused)} draft_topk rows refused" if refused else ""
        return Input("tree_stage_seconds", scale * total,
                     f"tree_build.csv + tree_accept.csv: {'; '.join(where)}{refusals}; x {scale:.2f}", True)
    seconds.refused = refused
    return seconds


def hardware_inputs(hardware: Hardware) -> list[Input]:
    """The box's bandwidth and matmul rate as the projection takes them: constants, not measured there."""
    why = f"{hardware.name}: the projection's constant, not measured on the box"
    return [assumed("memory_bandwidth", hardware.memory_bandwidth, "hardware.memory_bandwidth", why),
            assumed("matmul_flops", hardware.matmul_flops, "hardware.matmul_flops", why)]


def allreduce_inputs(hardware: Hardware) -> list[Input]:
    """The all-reduce model's two constants, labelled: parameters with PCIe defaults (CT200's)."""
    why = ("ring over PCIe without NVLink; default = a small NCCL all-reduce's latency and nccl-tests' bus "
           "bandwidth of 8 PCIe Gen5 GPUs (not measured on the box)")
    return [assumed("allreduce_latency", hardware.allreduce_latency, "allreduce_latency", why),
            assumed("allreduce_bus_bandwidth", hardware.allreduce_bus_bandwidth, "allreduce_bus_bandwidth", why)]

