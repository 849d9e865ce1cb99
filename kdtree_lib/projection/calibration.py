"""Calibration: the efficiencies and kernel times that make the roofline model reproduce measured rows."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from .. import results
from .physics import check_efficiency, check_fraction, row_label
from .roofline import Efficiency, Hardware, KernelTime, drafter_seconds, layer_costs, step_costs
from .rows import select_rows

if TYPE_CHECKING:
    from ..dflash import DFlashConfig
    from ..model import ModelConfig


def calibrate(measured: list[dict], config, hardware: Hardware, **layer_options) -> Efficiency:
    """Efficiencies that make the model reproduce measured per-layer times (median over rows).

    Each row holds batch, nodes, context, moe_layer and measured attention_seconds and
    moe_seconds of one layer on `hardware` (e.g. the H200 runs of notebook 12).
    """
    if not measured:
        raise ValueError("measured: expected at least one row of per-layer timings")
    ratios: dict[str, list[float]] = {"attention": [], "moe": []}
    for row in measured:
        ideal = layer_costs(config, hardware, batch=int(row["batch"]), nodes=int(row["nodes"]),
                            context=int(row["context"]), moe_layer=results.matches(row["moe_layer"], True), **layer_options)
        for name in ratios:
            ratios[name].append(ideal[name] / float(row[f"{name}_seconds"]))
    fitted = Efficiency(**{name: float(np.median(values)) for name, values in ratios.items()})
    return check_efficiency(fitted, source=f"the median over {len(measured)} layer rows, first {row_label(measured[0])}")


def measured_hardware(rows: list[dict], *, tp: int) -> Hardware:
    """The GPU the rows ran on as a projection.Hardware: its measured copy bandwidth and bf16
    matmul rate (medians), `tp` GPUs (its all-reduce numbers are not used by calibration)."""
    bandwidth = [float(r["copy_bandwidth"]) for r in rows if r.get("copy_bandwidth") not in (None, "")]
    flops = [float(r["matmul_flops"]) for r in rows if r.get("matmul_flops") not in (None, "")]
    if not bandwidth or not flops:
        raise ValueError("rows: expected copy_bandwidth and matmul_flops columns (a GPU run)")
    return Hardware(name=rows[0].get("device", "GPU"), memory_bandwidth=float(np.median(bandwidth)),
                    matmul_flops=float(np.median(flops)), gpus=tp, allreduce_latency=0.0,
                    allreduce_bus_bandwidth=math.inf)


def rows_expert_bits(rows: list[dict]) -> float:
    """Bits per routed-expert weight the rows ran with (their expert_bits column: 4.5 INT4-resident, 16 bf16);
    16 for rows written before the column. Rows of several widths are a ValueError (select one run)."""
    bits = {float(r["expert_bits"]) for r in rows if r.get("expert_bits") not in (None, "")}
    if len(bits) > 1:
        raise ValueError(f"rows: layer rows of several expert_bits {sorted(bits)}; expected one run's")
    return bits.pop() if bits else 16.0


def calibrate_on_rows(rows: list[dict], config: ModelConfig, *, tp: int | None = None,
                      graph: bool = True) -> tuple[Efficiency, Hardware, list[dict]]:
    """projection.calibrate on the layer rows of one TP degree (random weights route uniformly, so
    correlation 0; the experts' width as the rows ran them, rows_expert_bits), and the head's efficiency
    from the step rows' head_seconds: (efficiency, the measured hardware, the layer rows used)."""
    layers = select_rows(rows, "layer", tp=tp, graph=graph)
    if not layers:
        raise ValueError(f"rows: no layer rows with tp={tp}, graph={graph}")
    hardware = measured_hardware(layers, tp=int(layers[0]["tp"]))
    efficiency = calibrate(layers, config, hardware, expert_bits=rows_expert_bits(layers), correlation=0.0)
    heads = [step_costs(config, hardware, batch=int(r["batch"]), nodes=int(r["nodes"]), context=int(r["context"]))
             ["rest"] / float(r["head_seconds"]) for r in select_rows(rows, "step", tp=hardware.gpus, graph=graph)
             if r.get("head_seconds") not in (None, "")]
    if heads:
        efficiency = replace(efficiency, rest=check_fraction("efficiency.rest", float(np.median(heads)),
                                                             source=f"head_seconds of the step rows, TP={hardware.gpus}"))
    return efficiency, hardware, layers


def drafter_efficiency(rows: list[dict], config: DFlashConfig, hardware: Hardware, *, new_tokens: int = 5) -> float:
    """Roofline / measured drafter time (median over rows): its layers replicated, LM head over tp.
    The CUDA-graph time where a row has one (what a graph-captured decode pays), else the eager one."""
    def measured(row) -> float:
        return float(row.get("drafter_graph_seconds") or row["drafter_seconds"])
    ratios = [drafter_seconds(config, hardware, batch=int(r["batch"]), context=int(r["context"]),
                              new_tokens=new_tokens, head_shards=int(r["tp"])) / measured(r)
              for r in rows if r.get("drafter_seconds") not in (None, "")]
    if not ratios:
        raise ValueError("rows: no drafter_seconds measured")
    measured_rows = [r for r in rows if r.get("drafter_seconds") not in (None, "")]
    return check_fraction("drafter efficiency", float(np.median(ratios)),
                          source=f"the median over {len(ratios)} drafter rows, first {row_label(measured_rows[0])}")


FLOPS_TO_BYTES_GRID = np.geomspace(1e-3, 1e3, 601)  # (bytes efficiency / FLOPs efficiency) tried by fit_kernel_time


def fit_kernel_time(bytes_seconds, measured_seconds, flops_seconds=None) -> KernelTime:
    """The KernelTime (fixed + max(bytes term, FLOPs term)) that best reproduces measured times: least
    squares in relative error with fixed >= 0, over a grid of the two efficiencies' ratio (for each
    ratio the rest is linear). Inputs are each call's bytes / bandwidth and, when given, FLOPs / matmul rate."""
    measured = np.asarray(measured_seconds, float)
    bytes_s = np.asarray(bytes_seconds, float)
    flops_s = None if flops_seconds is None else np.asarray(flops_seconds, float)
    terms = 2 if flops_s is None else 3
    if (measured.size < terms or bytes_s.shape != measured.shape or (flops_s is not None and flops_s.shape != measured.shape)
            or np.any(measured <= 0)):
        raise ValueError(f"measured_seconds: expected at least {terms} positive times, one per call")
    best = None
    for ratio in ([None] if flops_s is None else FLOPS_TO_BYTES_GRID):
        roof = bytes_s if ratio is None else np.maximum(bytes_s, flops_s * ratio)
        design = np.stack([np.ones_like(measured), roof], axis=1) / measured[:, None]
        for used in ([0, 1], [1]):
            coefficients, *_ = np.linalg.lstsq(design[:, used], np.ones_like(measured), rcond=None)
            if np.all(coefficients >= 0) and coefficients[-1] > 0:
                error = float(np.sum((design[:, used] @ coefficients - 1) ** 2))
                if best is None or error < best[0]:
                    best = (error, ratio, dict(zip(used, coefficients)))
    if best is None:
        raise ValueError("measured_seconds: the times do not grow with the bytes; no kernel time fits")
    _, ratio, fitted = best
    slope = fitted[1]
    return KernelTime(float(fitted.get(0, 0.0)), float(1 / slope), None if ratio is None else float(1 / (slope * ratio)))


def fit_residuals(time: KernelTime, bytes_seconds, measured_seconds, flops_seconds=None) -> np.ndarray:
    """model / measured − 1 for each call."""
    flops = 0.0 if flops_seconds is None else np.asarray(flops_seconds, float)
    return time.time(np.asarray(bytes_seconds, float), flops) / np.asarray(measured_seconds, float) - 1



def calibration_fit(rows: list[dict], config: ModelConfig, hardware: Hardware, efficiency: Efficiency,
                    **layer_options) -> dict[str, dict[str, float]]:
    """How well the calibrated model reproduces the layer rows it was calibrated on, per component:
    {"residual_low", "residual_high"}: model / measured − 1 at each shape (the median of its rows), and
    "spread": the largest (max − min) / median among rows of one shape (layers and repeats), the rows' own noise.
    The experts' width is the rows' own (rows_expert_bits) unless layer_options gives expert_bits."""
    layer_options = {"expert_bits": rows_expert_bits(rows), **layer_options}
    shapes: dict[tuple, list[dict]] = {}
    for row in rows:
        shapes.setdefault((int(row["batch"]), int(row["nodes"]), int(row["context"]),
                           results.matches(row["moe_layer"], True)), []).append(row)
    out = {}
    for name in ("attention", "moe"):
        residuals, spreads = [], []
        for (batch, nodes, context, moe_layer), picked in shapes.items():
            measured = np.array([float(r[f"{name}_seconds"]) for r in picked])
            model = layer_costs(config, hardware, batch=batch, nodes=nodes, context=context, moe_layer=moe_layer,
                                efficiency=efficiency, **layer_options)[name]
            residuals.append(model / float(np.median(measured)) - 1)
            spreads.append(float((measured.max() - measured.min()) / np.median(measured)))
        out[name] = {"residual_low": min(residuals), "residual_high": max(residuals), "spread": max(spreads)}
    return out
