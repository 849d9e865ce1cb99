"""A roofline cost model of one tensor-parallel DDTree verify step, and the speedup it implies.

Per layer and per rank, each component's time is max(bytes / bandwidth, FLOPs / matmul rate)
divided by the fraction of that roofline the component reaches (its efficiency, calibrated from
measured H200 rows). Components: attention (MLA projections and the absorbed tree attention over
the latent cache, which every rank holds whole), moe (router, the routed experts the step's tokens
touch, the shared expert; or the dense MLP of the first layers), allreduce (two per layer) and rest
(lm_head and fixed per-step costs such as the drafter and the tree kernels). The speedup over
autoregressive decoding at a budget is tokens per round over step time, against one token per AR
step. Every number that is an assumption is a field of `Hardware` or an argument, so a notebook
can print them beside the plot.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Callable

import numpy as np

from . import results
from .contracts import tree_nodes
from .dflash import DRAFTER_PLACEMENTS
from .paths import BF16_BYTES

if TYPE_CHECKING:
    from .dflash import DFlashConfig
    from .model import ModelConfig


@dataclass(frozen=True)
class Hardware:
    """What one GPU of the box reaches, and how its GPUs talk."""
    name: str
    memory_bandwidth: float          # bytes/s, a measured device-to-device copy
    matmul_flops: float              # dense bf16 FLOP/s reached on large products
    gpus: int                        # tensor-parallel degree
    allreduce_latency: float         # s, one small all-reduce
    allreduce_bus_bandwidth: float   # bytes/s, nccl-tests' bus bandwidth convention


CT200 = Hardware(name="8x RTX PRO 6000 Blackwell (PCIe)", memory_bandwidth=1.5e12, matmul_flops=500e12,
                 gpus=8, allreduce_latency=24e-6, allreduce_bus_bandwidth=40e9)


@dataclass(frozen=True)
class Efficiency:
    """Fraction of the roofline each component reaches (1.0 = at the roofline). The tree attention
    over the cache and the routed experts may be fitted on their own kernels' rows (KernelTime:
    fixed seconds per call + bytes / (bandwidth · efficiency) + FLOPs / (rate · flops efficiency));
    None keeps them inside attention and moe."""
    attention: float = 1.0
    moe: float = 1.0
    rest: float = 1.0
    tree_attention: float | None = None         # of the verify kernel's bytes
    tree_attention_flops: float | None = None   # of its FLOPs (None: its time does not follow them)
    tree_attention_fixed: float | None = None   # s per call
    experts: float | None = None                # of the INT4 MoE kernel's bytes
    experts_flops: float | None = None
    experts_fixed: float | None = None


def expected_distinct_experts(tokens: int, n_experts: int, experts_per_token: int,
                              correlation: float = 0.0) -> float:
    """Expected number of distinct experts touched by `tokens` tokens routed top-k.

    Uniform independent routing gives E·(1 − (1 − k/E)^T). Tokens of one tree share context and
    route alike; `correlation` in [0, 1) shrinks the number of independent tokens to
    1 + (T − 1)(1 − correlation), fitted from a router's measured counts.
    """
    if tokens <= 0:
        return 0.0
    independent = 1 + (tokens - 1) * (1 - correlation)
    return n_experts * (1 - (1 - experts_per_token / n_experts) ** independent)


def layer_costs(config, hardware: Hardware, *, batch: int, nodes: int, context: int, moe_layer: bool,
                expert_bits: float = 16, correlation: float = 0.0,
                efficiency: Efficiency = Efficiency()) -> dict[str, float]:
    """Seconds per rank for one layer of a verify step of `batch` trees of `nodes` nodes."""
    c, g = config, hardware.gpus
    tokens = batch * nodes
    heads = c.num_attention_heads / g
    latent = c.kv_lora_rank + c.qk_rope_head_dim
    attention_params = (c.hidden_size * c.q_lora_rank                                     # q_a (replicated)
                        + c.q_lora_rank * heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)  # q_b
                        + c.hidden_size * latent                                          # kv_a (replicated)
                        + heads * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank    # W_UK, W_UV
                        + heads * c.v_head_dim * c.hidden_size)                           # o_proj
    keys = context + nodes
    projections = (attention_params * BF16_BYTES, 2 * tokens * attention_params)
    tree_attention = (batch * keys * latent * BF16_BYTES, 2 * tokens * heads * keys * (latent + c.kv_lora_rank))
    attention = _split_roofline(projections, tree_attention, hardware, efficiency.attention,
                                KernelTime.of(efficiency, "tree_attention"))
    if moe_layer:
        expert_params = 3 * c.hidden_size * c.moe_intermediate_size / g
        touched = expected_distinct_experts(tokens, c.n_routed_experts, c.num_experts_per_tok, correlation)
        routed = (touched * expert_params * expert_bits / 8, 2 * tokens * expert_params * c.num_experts_per_tok)
        shared_and_router = (c.n_shared_experts * expert_params * BF16_BYTES + c.hidden_size * c.n_routed_experts * BF16_BYTES,
                             2 * tokens * expert_params * c.n_shared_experts)
        moe = _split_roofline(shared_and_router, routed, hardware, efficiency.moe, KernelTime.of(efficiency, "experts"))
    else:
        dense_params = 3 * c.hidden_size * c.intermediate_size / g
        moe = _roofline(dense_params * BF16_BYTES, 2 * tokens * dense_params, hardware) / efficiency.moe
    return {"attention": attention, "moe": moe,
            "allreduce": 2 * allreduce_time(tokens * c.hidden_size * BF16_BYTES, hardware)}


@dataclass(frozen=True)
class KernelTime:
    """A kernel's time: fixed + bytes / (bandwidth · bytes_efficiency) [+ FLOPs / (rate · flops_efficiency)].
    The terms add (a fit, not a roofline's max): a bytes efficiency above 1 means reads overlap compute."""
    fixed: float
    bytes_efficiency: float
    flops_efficiency: float | None = None

    @classmethod
    def of(cls, efficiency: Efficiency, name: str) -> KernelTime | None:
        """The kernel `name` ("tree_attention", "experts") of an Efficiency, None when not fitted."""
        if getattr(efficiency, name) is None:
            return None
        return cls(getattr(efficiency, f"{name}_fixed") or 0.0, getattr(efficiency, name),
                   getattr(efficiency, f"{name}_flops"))

    def time(self, bytes_seconds, flops_seconds=0.0):
        """From a call's bytes / bandwidth and FLOPs / matmul rate (scalars or arrays)."""
        compute = np.asarray(flops_seconds) / self.flops_efficiency if self.flops_efficiency else 0.0
        return self.fixed + np.asarray(bytes_seconds) / self.bytes_efficiency + compute

    def seconds(self, num_bytes: float, flops: float, hardware: Hardware) -> float:
        return float(self.time(num_bytes / hardware.memory_bandwidth, flops / hardware.matmul_flops))


def _split_roofline(rest: tuple[float, float], kernel: tuple[float, float], hardware: Hardware, rest_efficiency: float,
                    kernel_time: KernelTime | None) -> float:
    """Seconds of (bytes, FLOPs) pairs: one roofline over both at rest_efficiency when the kernel has
    no fitted time, else the rest's roofline plus the kernel's KernelTime."""
    if kernel_time is None:
        return _roofline(rest[0] + kernel[0], rest[1] + kernel[1], hardware) / rest_efficiency
    return _roofline(*rest, hardware) / rest_efficiency + kernel_time.seconds(*kernel, hardware)


def allreduce_time(message_bytes: float, hardware: Hardware) -> float:
    """Ring all-reduce: latency plus 2(g−1)/g of the message over the bus bandwidth."""
    g = hardware.gpus
    if g == 1:
        return 0.0
    return hardware.allreduce_latency + 2 * (g - 1) / g * message_bytes / hardware.allreduce_bus_bandwidth


def step_costs(config, hardware: Hardware, *, batch: int, nodes: int, context: int,
               fixed_seconds: float = 0.0, **layer_options) -> dict[str, float]:
    """Seconds per verify step of the whole model, split into attention, moe, allreduce, rest, total."""
    totals = {"attention": 0.0, "moe": 0.0, "allreduce": 0.0}
    for layer in range(config.num_hidden_layers):
        costs = layer_costs(config, hardware, batch=batch, nodes=nodes, context=context,
                            moe_layer=layer >= config.first_k_dense_replace, **layer_options)
        for name in totals:
            totals[name] += costs[name]
    efficiency = layer_options.get("efficiency", Efficiency())
    head_params = config.vocab_size * config.hidden_size / hardware.gpus
    head = _roofline(head_params * BF16_BYTES, 2 * batch * nodes * head_params, hardware) / efficiency.rest
    totals["rest"] = head + fixed_seconds
    totals["total"] = sum(totals.values())
    return totals


def projected_speedup(config, hardware: Hardware, acceptance: dict[int, float], *, batch: int,
                      context: int, draft_seconds: float = 0.0, **layer_options) -> list[dict]:
    """Per budget: step time, tokens/s and speedup over AR, given mean acceptance per budget.

    `acceptance` maps a budget to the mean tokens per round (root included, as AcceptResult
    counts it); the tree has budget + 1 nodes; AR commits one token per step of one node.
    """
    ar = step_costs(config, hardware, batch=batch, nodes=1, context=context, **layer_options)["total"]
    rows = []
    for budget, tokens_per_round in sorted(acceptance.items()):
        step = step_costs(config, hardware, batch=batch, nodes=tree_nodes(budget), context=context,
                          fixed_seconds=draft_seconds, **layer_options)
        rows.append({"budget": budget, "acceptance": tokens_per_round, "step_seconds": step["total"],
                     "tokens_per_second": batch * tokens_per_round / step["total"],
                     "ar_tokens_per_second": batch / ar, "speedup": tokens_per_round * ar / step["total"],
                     **{f"{k}_seconds": v for k, v in step.items() if k != "total"}})
    return rows


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
    return Efficiency(**{name: float(np.median(values)) for name, values in ratios.items()})


def assumptions(hardware: Hardware, efficiency: Efficiency, **extra) -> list[str]:
    """Printable lines: every constant the projection rests on."""
    lines = [f"{key} = {_with_unit(key, value)}" for key, value in asdict(hardware).items()]
    lines += [f"efficiency.{key} = {value:.3g}" for key, value in asdict(efficiency).items() if value is not None]
    lines += [f"{key} = {value}" for key, value in extra.items()]
    return lines


HARDWARE_UNITS = {"memory_bandwidth": (1e12, "TB/s"), "matmul_flops": (1e12, "TFLOP/s"),
                  "allreduce_latency": (1e-6, "us"), "allreduce_bus_bandwidth": (1e9, "GB/s")}


def _with_unit(key: str, value) -> str:
    """A Hardware field as people read it: 1.5e12 bytes/s is "1.5 TB/s"."""
    if key not in HARDWARE_UNITS:
        return str(value)
    scale, unit = HARDWARE_UNITS[key]
    return f"{value / scale:g} {unit}"


def _roofline(num_bytes: float, flops: float, hardware: Hardware) -> float:
    return max(num_bytes / hardware.memory_bandwidth, flops / hardware.matmul_flops)


# ----------------------------------------------------------------------------------------------
# calibration on measured verify-step rows (kdtree_lib.bench.tp_step), and the CT200 model

COMPONENTS = ("attention", "moe", "allreduce", "rest")
TREE_KERNEL_COLUMNS = ("draft_topk_seconds", "tree_build_seconds", "accept_compact_seconds")


def latest_rows(rows: list[dict]) -> list[dict]:
    """The verify-step rows (scopes layer and step) of the newest run that has them, and the draft
    rows of the newest run that has them (a --drafter-only run refreshes those alone)."""
    return (results.latest_run([r for r in rows if r.get("scope") != "draft"])
            + results.latest_run([r for r in rows if r.get("scope") == "draft"]))


def moe_layer_split(rows: list[dict], batch: int, context: int, graph: bool) -> dict[int, np.ndarray]:
    """nodes -> mean over the MoE layer rows of (attention, moe, allreduce, rest) seconds."""
    split: dict[int, list[list[float]]] = {}
    for r in results.select(rows, scope="layer", moe_layer=True, graph=graph, batch=batch, context=context):
        split.setdefault(int(r["nodes"]), []).append([float(r[f"{c}_seconds"]) for c in COMPONENTS])
    return {n: np.mean(v, axis=0) for n, v in sorted(split.items())}


def touched_vs_uniform(rows: list[dict], config) -> tuple[np.ndarray, np.ndarray, float]:
    """(tokens B·N, experts touched, largest relative gap to uniform independent routing) of the
    eager MoE layer rows (routing does not depend on graphs)."""
    moe_rows = results.select(rows, scope="layer", moe_layer=True, graph=False)
    tokens = np.array([int(r["batch"]) * int(r["nodes"]) for r in moe_rows])
    touched = np.array([float(r["experts_touched"]) for r in moe_rows])
    expected = np.array([expected_distinct_experts(int(t), config.n_routed_experts, config.num_experts_per_tok)
                         for t in tokens])
    return tokens, touched, float(np.max(np.abs(touched - expected) / expected))


def whole_model_rows(rows: list[dict], config: ModelConfig) -> list[dict]:
    """Seconds per verify round of the whole model, per (tp, graph, batch, nodes, context): the
    dense layer rows times first_k_dense_replace and the mean MoE layer row times the MoE layers
    (per component), plus the head and, for a tree (N > 1), the drafter and the tree kernels."""
    groups: dict[tuple, dict[str, list[dict]]] = {}
    drafts: dict[tuple, list[dict]] = {}
    for row in rows:
        where = (int(row["tp"]), int(row["batch"]), int(row["nodes"]), int(row["context"]))
        if row["scope"] == "draft":
            drafts.setdefault(where, []).append(row)
        else:
            groups.setdefault((results.matches(row["graph"], True), *where), {}).setdefault(row["scope"], []).append(row)
    out = []
    for (graph, tp, batch, nodes, context), scoped in sorted(groups.items()):
        layers = scoped.get("layer", [])
        dense = [r for r in layers if not results.matches(r["moe_layer"], True)]
        moe = [r for r in layers if results.matches(r["moe_layer"], True)]
        if not dense or not moe or "step" not in scoped:
            continue
        counts = {config.first_k_dense_replace: dense, len(config.moe_layers): moe}
        row = {"tp": tp, "graph": graph, "batch": batch, "nodes": nodes, "context": context}
        for name in COMPONENTS:
            row[name] = sum(count * float(np.mean([float(r[f"{name}_seconds"]) for r in picked]))
                            for count, picked in counts.items())
        row["head"] = float(np.mean([float(r["head_seconds"]) for r in scoped["step"]]))
        draft = drafts.get((tp, batch, nodes, context), [])
        row["draft"] = float(np.mean([draft_round_seconds(r, graph=graph) for r in draft])) if draft else 0.0
        row["total"] = sum(row[name] for name in (*COMPONENTS, "head", "draft"))
        out.append(row)
    return out


def select_rows(rows: list[dict], scope: str, *, tp: int | None = None, graph: bool | None = None) -> list[dict]:
    """Rows of one scope; of TP degree `tp` (default: the largest present) and graph flag."""
    picked = [r for r in rows if r.get("scope") == scope]
    if not picked:
        return []
    tp = max(int(r["tp"]) for r in picked) if tp is None else tp
    return [r for r in picked if int(r["tp"]) == tp and (graph is None or results.matches(r.get("graph"), graph))]


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


def calibrate_on_rows(rows: list[dict], config: ModelConfig, *, tp: int | None = None,
                      graph: bool = True) -> tuple[Efficiency, Hardware, list[dict]]:
    """projection.calibrate on the layer rows of one TP degree (random weights route uniformly, so
    correlation 0 and bf16 experts), and the head's efficiency from the step rows' head_seconds:
    (efficiency, the measured hardware, the layer rows used)."""
    layers = select_rows(rows, "layer", tp=tp, graph=graph)
    if not layers:
        raise ValueError(f"rows: no layer rows with tp={tp}, graph={graph}")
    hardware = measured_hardware(layers, tp=int(layers[0]["tp"]))
    efficiency = calibrate(layers, config, hardware, expert_bits=16, correlation=0.0)
    heads = [step_costs(config, hardware, batch=int(r["batch"]), nodes=int(r["nodes"]), context=int(r["context"]))
             ["rest"] / float(r["head_seconds"]) for r in select_rows(rows, "step", tp=hardware.gpus, graph=graph)
             if r.get("head_seconds") not in (None, "")]
    return (replace(efficiency, rest=float(np.median(heads))) if heads else efficiency), hardware, layers


def drafter_seconds(config: DFlashConfig, hardware: Hardware, *, batch: int, context: int, new_tokens: int = 5,
                    shards: int = 1, head_shards: int | None = None, efficiency: float = 1.0) -> float:
    """One drafter forward: its weights (layers split over `shards` GPUs, the target's LM head over
    `head_shards`) and its context cache read once, the FLOPs of the block and the new tokens, at
    the roofline divided by `efficiency`; with shards > 1 also two all-reduces per layer and the
    head's all-gather (latency-bound messages)."""
    c = config
    head_shards = shards if head_shards is None else head_shards
    per_layer = (c.hidden_size * c.head_dim * 2 * (c.num_attention_heads + c.num_key_value_heads)
                 + 3 * c.hidden_size * c.intermediate_size)
    body = c.num_hidden_layers * per_layer + c.feature_size * c.hidden_size
    head = c.vocab_size * c.hidden_size
    tokens = batch * (c.block_size + new_tokens)
    cache_bytes = batch * context * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * BF16_BYTES / shards
    attention_flops = 4 * batch * c.block_size * c.num_attention_heads * c.head_dim * context * c.num_hidden_layers
    weight_bytes = (body / shards + head / head_shards) * BF16_BYTES
    flops = 2 * tokens * body / shards + 2 * batch * (c.block_size - 1) * head / head_shards + attention_flops / shards
    seconds = _roofline(weight_bytes + cache_bytes, flops, hardware) / efficiency
    if shards > 1:
        group = replace(hardware, gpus=shards)
        seconds += (2 * c.num_hidden_layers + 1) * allreduce_time(tokens * c.hidden_size * BF16_BYTES, group)
    return seconds


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
    return float(np.median(ratios))


def draft_round_seconds(row: dict, *, graph: bool) -> float:
    """What a draft row adds to a round: the drafter forward (its CUDA-graph time in a graph round,
    where measured) and the tree kernels."""
    drafter = (row.get("drafter_graph_seconds") if graph else None) or row.get("drafter_seconds")
    return float(drafter or 0.0) + sum(float(row[n]) for n in TREE_KERNEL_COLUMNS if row.get(n) not in (None, ""))


def tree_kernel_seconds(rows: list[dict], batch: int) -> float:
    """Median over budgets of draft top-k + tree build + accept/compaction, for `batch` (0 if absent)."""
    sums = [sum(float(r[n]) for n in TREE_KERNEL_COLUMNS) for r in rows
            if int(r["batch"]) == batch and all(r.get(n) not in (None, "") for n in TREE_KERNEL_COLUMNS)]
    return float(np.median(sums)) if sums else 0.0


def acceptance_curve(rows: list[dict], *, column: str = "mean_acceptance", **filters) -> dict[int, float]:
    """Mean tokens per round per budget (root included) from acceptance rows, e.g.
    data/results/acceptance.csv: the mean of `column` over the rows of each budget matching filters."""
    picked = results.select(rows, **filters)
    if not picked or column not in picked[0] or "budget" not in picked[0]:
        raise ValueError(f"rows: expected rows with 'budget' and {column!r} matching {filters}")
    curve: dict[int, list[float]] = {}
    for row in picked:
        curve.setdefault(int(float(row["budget"])), []).append(float(row[column]))
    return {budget: float(np.mean(values)) for budget, values in sorted(curve.items())}


def draft_round_cost(drafter: DFlashConfig, hardware: Hardware, draft_rows: list[dict], *, shards: int,
                     efficiency: float, kernel_scale: float) -> Callable[[int, int], float]:
    """seconds(batch, context) a DDTree round adds on `hardware`: the drafter's forward (its roofline
    over `efficiency`, layers over `shards` GPUs) and the measured tree kernels times kernel_scale."""
    def seconds(batch: int, context: int) -> float:
        return (drafter_seconds(drafter, hardware, batch=batch, context=context, shards=shards, efficiency=efficiency)
                + tree_kernel_seconds(draft_rows, batch) * kernel_scale)
    return seconds


def ct200_projection(config: ModelConfig, acceptance: dict[int, float], *, efficiency: Efficiency,
                     hardware: Hardware = CT200, batches=(1, 8), contexts=(4096,), expert_bits: float = 4.5,
                     correlation: float | dict[int, float] = 0.0,
                     draft_seconds: float | Callable[[int, int], float] = 0.0) -> list[dict]:
    """Per (context, batch, budget): step time, tokens/s and speedup over AR on `hardware`
    (projection.projected_speedup). correlation may be per batch ({batch: c}); draft_seconds a
    constant or draft_seconds(batch, context): what a DDTree round adds (drafter, tree kernels)."""
    rows = []
    for context in contexts:
        for batch in batches:
            corr = correlation[batch] if isinstance(correlation, dict) else correlation
            draft = draft_seconds(batch, context) if callable(draft_seconds) else draft_seconds
            for row in projected_speedup(config, hardware, acceptance, batch=batch, context=context,
                                         draft_seconds=draft, expert_bits=expert_bits, correlation=corr,
                                         efficiency=efficiency):
                rows.append({"context": context, "batch": batch, "correlation": corr, "draft_seconds": draft, **row})
    return rows


def best_budgets(rows: list[dict]) -> dict[tuple[int, int], dict]:
    """(context, batch) -> the projection row with the most tokens/s."""
    best: dict[tuple[int, int], dict] = {}
    for row in rows:
        key = (row["context"], row["batch"])
        if key not in best or row["tokens_per_second"] > best[key]["tokens_per_second"]:
            best[key] = row
    return best


# ----------------------------------------------------------------------------------------------
# the box's inputs: each a value with the rows it came from, or a loud ASSUMPTION naming its parameter

PORTABLE_VERIFY_CONFIGS = {16: "rows16_keys32_stages2", 32: "rows32_keys32_stages2"}  # the 99 KB variants, by CTA rows
BOX_MOE_PROVIDER = "kernel_99kb"      # kdtree_lib.bench.moe_int4: the plan for 99 KB of shared memory (sm_120)
SERVICE_OBSERVED = {8: 4.5, 16: 5.3, 32: 6.4}  # the live service's mean acceptance (DESIGN.md §7: 8 ≈ 4.5, 16–32: 5.3–6.4)
OVERLAPS = (0.0, 0.25, 0.5, 0.75, 0.9)  # routing correlation swept: uniform to strongly correlated


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


def fit_kernel_time(bytes_seconds, measured_seconds, flops_seconds=None) -> KernelTime:
    """The KernelTime that best reproduces measured times (least squares in relative error, every
    term ≥ 0) from each call's bytes / bandwidth and, when given, FLOPs / matmul rate."""
    measured = np.asarray(measured_seconds, float)
    columns = [np.ones_like(measured), np.asarray(bytes_seconds, float)]
    if flops_seconds is not None:
        columns.append(np.asarray(flops_seconds, float))
    if measured.size < len(columns) or any(c.shape != measured.shape for c in columns) or np.any(measured <= 0):
        raise ValueError(f"measured_seconds: expected at least {len(columns)} positive times, one per call")
    design = np.stack(columns, axis=1) / measured[:, None]
    best = None
    for used in ([0, 1, 2], [1, 2], [0, 1], [1])[(0 if flops_seconds is not None else 2):]:
        coefficients, *_ = np.linalg.lstsq(design[:, used], np.ones_like(measured), rcond=None)
        if np.all(coefficients >= 0) and coefficients[used.index(1)] > 0:
            error = float(np.sum((design[:, used] @ coefficients - 1) ** 2))
            if best is None or error < best[0]:
                best = (error, dict(zip(used, coefficients)))
    if best is None:
        raise ValueError("measured_seconds: the times do not grow with the bytes; no kernel time fits")
    fitted = best[1]
    return KernelTime(float(fitted.get(0, 0.0)), float(1 / fitted[1]),
                      float(1 / fitted[2]) if fitted.get(2, 0.0) > 0 else None)


def fit_residuals(time: KernelTime, bytes_seconds, measured_seconds, flops_seconds=None) -> np.ndarray:
    """model / measured − 1 for each call."""
    flops = 0.0 if flops_seconds is None else np.asarray(flops_seconds, float)
    return time.time(np.asarray(bytes_seconds, float), flops) / np.asarray(measured_seconds, float) - 1


def kernel_fit(name: str, file: str, rows: list[dict], *, bytes_seconds, measured, flops_seconds=None, what: str,
               assumed_time: KernelTime, parameter: str) -> tuple[KernelTime, list[Input], list[dict]]:
    """(KernelTime, its Inputs, the rows used) fitted on rows (functions of a row, in seconds), or the
    parameter's assumption when fewer rows than terms exist."""
    terms = ([bytes_seconds(r) for r in rows], [measured(r) for r in rows],
             None if flops_seconds is None else [flops_seconds(r) for r in rows])
    try:
        fitted = fit_kernel_time(*terms)
        residuals = fit_residuals(fitted, *terms)
        source = rows_source(file, rows, f"{what}, fitted as fixed + bytes + FLOPs terms (model within "
                                          f"{residuals.min():+.0%} .. {residuals.max():+.0%} of every row)")
        measured_here = True
    except ValueError:
        if rows:
            raise
        fitted, source, measured_here = assumed_time, f"parameter {parameter}: no {what} rows in {file} yet", False
        rows = []
    values = {"fixed_seconds": fitted.fixed, "bytes_efficiency": fitted.bytes_efficiency,
              "flops_efficiency": fitted.flops_efficiency}
    inputs = [Input(f"{name}.{key}", value, source, measured_here) for key, value in values.items() if value is not None]
    return fitted, inputs, rows


def portable_verify_rows(rows: list[dict], *, heads: int) -> list[dict]:
    """The verify_attn rows of the portable (99 KB) kernel at `heads` heads per rank, the variant the
    sm_120 plan picks for each shape (CTA of 32 rows from 32 rows up), of the newest run that has them."""
    def picked(row) -> bool:
        size = 32 if int(row["rows"]) >= 32 else 16
        return row.get("config") == PORTABLE_VERIFY_CONFIGS[size] and results.matches(row.get("heads"), heads)
    return results.latest_run([r for r in rows if r.get("provider") in ("kernel", "kernel_variant") and picked(r)])


def verify_kernel_inputs(rows: list[dict], *, heads: int,
                         assumed_time: KernelTime) -> tuple[KernelTime, list[Input], list[dict]]:
    """The portable verify kernel's time model from data/results/verify_attn.csv rows (its bytes and
    FLOPs over the run's measured ceilings), or `assumed_time` (the caller's parameter
    assumed_verify_time, labelled as an ASSUMPTION) when there are no such rows."""
    return kernel_fit("verify_attention", "data/results/verify_attn.csv", portable_verify_rows(rows, heads=heads),
                      bytes_seconds=lambda r: float(r["bytes"]) / (float(r["copy_tbps"]) * 1e12),
                      flops_seconds=lambda r: float(r["flops"]) / (float(r["matmul_tflops"]) * 1e12),
                      measured=lambda r: float(r["time_us"]) * 1e-6, assumed_time=assumed_time,
                      what=f"portable kernel ({'/'.join(PORTABLE_VERIFY_CONFIGS.values())}), {heads} heads",
                      parameter="assumed_verify_time")


def moe_kernel_inputs(rows: list[dict], *, tp: int,
                      assumed_time: KernelTime) -> tuple[KernelTime, list[Input], list[dict]]:
    """The INT4 MoE kernel's time model on the box's 99 KB plan from data/results/moe_int4.csv rows
    of the TP=tp slice (touched bytes over the run's copy bandwidth), or `assumed_time` (the caller's
    parameter assumed_moe_time, labelled): that file does not exist until bench.moe_int4 runs on a GPU."""
    picked = results.latest_run(results.select(rows, provider=BOX_MOE_PROVIDER, tp=tp))
    return kernel_fit("int4_experts", "data/results/moe_int4.csv", picked,
                      bytes_seconds=lambda r: float(r["bytes"]) / (float(r["copy_tbps"]) * 1e12),
                      measured=lambda r: float(r["time_us"]) * 1e-6, assumed_time=assumed_time,
                      what=f"{BOX_MOE_PROVIDER}, TP={tp}", parameter="assumed_moe_time")


def box_efficiency(efficiency: Efficiency, verify: KernelTime, experts: KernelTime) -> Efficiency:
    """`efficiency` (the rest, from the verify-step rows) with the box's two kernels' own times."""
    return replace(efficiency, tree_attention=verify.bytes_efficiency, tree_attention_flops=verify.flops_efficiency,
                   tree_attention_fixed=verify.fixed, experts=experts.bytes_efficiency,
                   experts_flops=experts.flops_efficiency, experts_fixed=experts.fixed)


def real_drafter_config(config: ModelConfig) -> DFlashConfig:
    """Kimi-K2.6-DFlash as published (DESIGN.md §4): 6 Qwen3 layers at hidden 7168, 64 heads / 8 KV
    heads / head_dim 128, MLP 18432, block 8, target layers 1, 12, 24, 35, 47, 58 (about 6.5 GiB bf16)."""
    from .dflash import DFlashConfig
    return DFlashConfig(hidden_size=7168, intermediate_size=18432, num_hidden_layers=6, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=128, vocab_size=config.vocab_size, block_size=8,
                        mask_token_id=163838, target_layer_ids=(1, 12, 24, 35, 47, 58), rms_norm_eps=1e-5,
                        rope_theta=50000.0)


def drafter_shards(placement: str, tp: int) -> int:
    """GPUs the drafter's layers are split over: 1 replicated, tp sharded (dflash.load_drafter's
    placements; decode.generate_tp shards it by default at TP > 1)."""
    if placement not in DRAFTER_PLACEMENTS:
        raise ValueError(f"placement: expected one of {DRAFTER_PLACEMENTS}, got {placement!r}")
    return 1 if placement == "replicated" else tp


def drafter_costs(drafter: DFlashConfig, hardware: Hardware, *, efficiency: float,
                  placements=DRAFTER_PLACEMENTS) -> dict[str, Callable[[int, int], float]]:
    """placement -> seconds(batch, context) of one drafter forward on `hardware` (projection.drafter_seconds):
    its layers over drafter_shards(placement, hardware.gpus) GPUs, the target's LM head over all of them,
    at `efficiency` of the roofline."""
    def cost(shards: int) -> Callable[[int, int], float]:
        def seconds(batch: int, context: int) -> float:
            return drafter_seconds(drafter, hardware, batch=batch, context=context, shards=shards,
                                   head_shards=hardware.gpus, efficiency=efficiency)
        return seconds
    return {placement: cost(drafter_shards(placement, hardware.gpus)) for placement in placements}


def round_seconds_of_nodes(config: ModelConfig, hardware: Hardware, *, context: int, correlation: float,
                           efficiency: Efficiency, expert_bits: float, drafter: Callable[[int, int], float],
                           tree_stage: Callable[[int, int], Input]) -> Callable[[int], float]:
    """seconds(n): one batch-1 round of a tree of n nodes (root included) at `context`: the verify step
    (projection.step_costs) plus the drafter's forward drafter(1, context) and the tree stage at budget
    max(n − 1, 1); what projection.stop_rule_comparison and latency_aware_budgets take."""
    def seconds(nodes: int) -> float:
        extra = drafter(1, context) + tree_stage(1, max(nodes - 1, 1)).value
        return step_costs(config, hardware, batch=1, nodes=nodes, context=context, expert_bits=expert_bits,
                          correlation=correlation, efficiency=efficiency, fixed_seconds=extra)["total"]
    return seconds


def nearest_overlap(overlaps, marked: float) -> float:
    """The overlap of `overlaps` nearest `marked` (the stand-in's fitted correlation); the first of equals."""
    overlaps = list(overlaps)
    if not overlaps:
        raise ValueError("overlaps: expected at least one")
    return overlaps[int(np.argmin([abs(c - marked) for c in overlaps]))]


def nearest_row(rows: list[dict], **target) -> dict:
    """The row nearest `target` (column -> number) in summed |log2| distance; the newest of equals."""
    if not rows:
        raise ValueError(f"rows: none to pick the nearest to {target} from")
    def distance(row) -> float:
        return sum(abs(math.log2(float(row[k]) / v)) for k, v in target.items())
    return min(reversed(rows), key=distance)


def tree_stage_cost(build_rows: list[dict], accept_rows: list[dict], *, depth: int, assumed_seconds: float,
                    scale: float = 1.0) -> Callable[[int, int], Input]:
    """Input(batch, budget): the tree stage of a round measured on the GPU kernels, times `scale`:
    draft top-k over the vocabulary (data/results/tree_build.csv stage draft_topk), the build (stage
    build, CUDA graph, at `depth`), accept + 61-layer compaction (tree_accept.csv), each the newest
    run's row nearest in batch and budget; without rows, `assumed_seconds` (the caller's parameter
    assumed_tree_stage_seconds, labelled)."""
    topk = results.latest_run(results.select(build_rows, stage="draft_topk", method="kernel"))
    build = results.latest_run(results.select(build_rows, stage="build", method="kernel", timing="cuda_graph", depth=depth))
    walk = results.latest_run(results.select(accept_rows, method="accept_compact_kernel"))

    def seconds(batch: int, budget: int) -> Input:
        if not (topk and build and walk):
            return assumed("tree_stage_seconds", assumed_seconds, "assumed_tree_stage_seconds",
                           "no draft_topk/build/accept_compact kernel rows in tree_build.csv / tree_accept.csv")
        picked = [nearest_row(topk, batch=batch, topk=max(budget, 1)), nearest_row(build, batch=batch, budget=budget),
                  nearest_row(walk, batch=batch, budget=budget)]
        where = "; ".join(f"{r.get('stage', r.get('method'))} B={r['batch']} budget={r.get('budget') or r.get('topk')}"
                          f" {r['device']} {r['commit']}" for r in picked)
        return Input("tree_stage_seconds", scale * sum(float(r["time_us"]) * 1e-6 for r in picked),
                     f"tree_build.csv + tree_accept.csv nearest rows ({where}) x {scale:.2f}", True)
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


# ----------------------------------------------------------------------------------------------
# acceptance curves from three sources, and the table

@dataclass(frozen=True)
class AcceptanceSource:
    """Tokens per round (root included) per budget, and the DFlash chain's, from one source."""
    name: str
    curve: dict[int, float]
    chain: Input
    source: str
    measured: bool


def measured_acceptance(name: str, file: str, rows: list[dict], *, depth: int, **filters) -> AcceptanceSource | None:
    """The oracle tree curve (T = 0) of the biggest measurement in `rows` (read from `file`, e.g.
    data/results/acceptance.csv or a kit's box_acceptance.csv) matching filters, and its chain at
    depth `depth` (measured where the file has chain rows); None without tree rows."""
    from .acceptance import largest_measurement
    tree = largest_measurement(rows, source="oracle", mode="tree", temperature=0, **filters)
    if not tree:
        return None
    curve = acceptance_curve(tree)
    what = f"oracle rows {filters}" if filters else "oracle rows"
    chain_rows = [r for r in largest_measurement(rows, source="oracle", mode="chain", temperature=0, **filters)
                  if int(float(r["budget"])) >= depth]
    if chain_rows:
        chain = Input("chain_acceptance", acceptance_curve(chain_rows)[min(int(float(r["budget"])) for r in chain_rows)],
                      rows_source(file, chain_rows, "oracle chain rows"), True)
    else:
        chain = _chain_assumption(curve, depth)
    return AcceptanceSource(name, curve, chain, rows_source(file, tree, what), True)


def service_acceptance(observed: dict[int, float] = SERVICE_OBSERVED, *, depth: int = 7) -> AcceptanceSource:
    """The live service's observed acceptance (DESIGN.md §7), budgets it ran only: not a measurement here;
    its chain (depth drafts) is not observed either."""
    curve = {int(b): float(a) for b, a in sorted(observed.items())}
    return AcceptanceSource("service", curve, _chain_assumption(curve, depth),
                            "parameter service_acceptance: the live service's observations as DESIGN.md "
                            "§7 quotes them (budget 8 ≈ 4.5, 16–32: 5.3–6.4), read as 16 → 5.3, 32 → 6.4", False)


def _chain_assumption(curve: dict[int, float], depth: int) -> Input:
    """Without chain rows: the tree's acceptance at the smallest budget of at least `depth` nodes."""
    budget = min((b for b in curve if b >= depth), default=max(curve))
    return assumed("chain_acceptance", curve[budget], "chain_acceptance",
                   f"no chain rows: the tree's acceptance at budget {budget} (a chain of {depth} drafts accepts at most "
                   "about what a tree of as many nodes does; generous to the chain)")


def round_rows(config: ModelConfig, hardware: Hardware, source: AcceptanceSource, *, batch: int, context: int,
               correlation: float, efficiency: Efficiency, expert_bits: float, chain_budget: int,
               drafter: Callable[[int, int], float], tree_stage: Callable[[int, int], Input]) -> list[dict]:
    """Per budget of `source`: the round's time (verify step + drafter + tree stage), tokens/s and the
    speedups over AR and over the DFlash chain (chain_budget drafts, the same drafter and stage)."""
    options = dict(expert_bits=expert_bits, correlation=correlation, efficiency=efficiency)
    ar = step_costs(config, hardware, batch=batch, nodes=1, context=context, **options)["total"]

    def round_seconds(budget: int) -> dict:
        extra = drafter(batch, context) + tree_stage(batch, budget).value
        return step_costs(config, hardware, batch=batch, nodes=tree_nodes(budget), context=context,
                          fixed_seconds=extra, **options)
    chain_rate = source.chain.value / round_seconds(chain_budget)["total"]
    rows = []
    for budget, accepted in sorted(source.curve.items()):
        step = round_seconds(budget)
        rate = accepted / step["total"]
        rows.append({"source": source.name, "correlation": correlation, "context": context, "batch": batch,
                     "budget": budget, "acceptance": accepted, "round_seconds": step["total"],
                     "tokens_per_second": batch * rate, "ar_tokens_per_second": batch / ar,
                     "chain_tokens_per_second": batch * chain_rate, "speedup_vs_ar": rate * ar,
                     "speedup_vs_chain": rate / chain_rate,
                     **{f"{k}_seconds": v for k, v in step.items() if k != "total"}})
    return rows


def projection_table(config: ModelConfig, sources: list[AcceptanceSource], overlaps, *, hardware: Hardware = CT200,
                     batches=(1, 8), contexts=(4096, 32768), **round_options) -> list[dict]:
    """round_rows for every acceptance source × overlap × context × batch (round_options: round_rows')."""
    return [row for source in sources for correlation in overlaps for context in contexts for batch in batches
            for row in round_rows(config, hardware, source, batch=batch, context=context, correlation=correlation,
                                  **round_options)]


def best_table(rows: list[dict]) -> list[dict]:
    """Per (source, correlation, context, batch): the row of the budget with the most tokens/s."""
    best: dict[tuple, dict] = {}
    for row in rows:
        key = (row["source"], row["correlation"], row["context"], row["batch"])
        if key not in best or row["tokens_per_second"] > best[key]["tokens_per_second"]:
            best[key] = row
    return list(best.values())


def speedup_band(rows: list[dict], key: str = "speedup_vs_ar") -> dict[tuple[int, int], dict]:
    """(context, batch) -> {budget: (lowest, highest) `key` over every source × overlap with that budget}."""
    band: dict[tuple[int, int], dict[int, list[float]]] = {}
    for row in rows:
        band.setdefault((row["context"], row["batch"]), {}).setdefault(row["budget"], []).append(row[key])
    return {where: {b: (min(v), max(v)) for b, v in sorted(budgets.items())} for where, budgets in band.items()}


# ----------------------------------------------------------------------------------------------
# budget choice by cost: a latency-aware stop against the best fixed budget

def latency_aware_budgets(log_weights, seconds_of_nodes: Callable[[int], float], max_budget: int) -> np.ndarray:
    """int [T]: per tree (log_weights [T, N] of best-first trees, pop order, root first, padding −inf)
    the budget at which the latency-aware stop halts. With n nodes kept (root included) a round is
    expected to commit A = 1 + Σ w of the drafts kept (w = exp(log w), the drafter's path probability,
    DDTree's expected acceptance) in seconds_of_nodes(n); the next node (weight w) is added only while
    (A + w) / T(n + 1) > A / T(n), i.e. its marginal acceptance beats the marginal verify cost."""
    weights = np.exp(np.asarray(log_weights, np.float64)[:, 1:max_budget + 1])               # (T, budget)
    cost = np.array([seconds_of_nodes(n) for n in range(1, weights.shape[1] + 2)])           # T(1) .. T(budget + 1)
    expected = 1 + np.concatenate([np.zeros((len(weights), 1)), np.cumsum(weights, axis=1)[:, :-1]], axis=1)
    keep = weights * cost[:-1] > expected * (cost[1:] - cost[:-1])                           # (T, budget)
    return np.where(keep.all(axis=1), weights.shape[1], np.argmin(keep, axis=1))


def stop_rule_comparison(records, seconds_of_nodes: Callable[[int], float], budgets, *, backend: str = "auto") -> dict:
    """Tokens per second of oracle records (acceptance.record_oracle, T = 0, batch 1) under each fixed
    budget and under the latency-aware stop (its budgets rounded down to the nearest of `budgets`,
    so one build per budget): {"fixed": {budget: tokens/s}, "latency_aware": tokens/s,
    "latency_aware_mean_budget": ..., "best_fixed_budget": ..., "beats_best_fixed": bool}."""
    from .acceptance import accepted_at_every_position, round_lengths
    seconds_of_nodes = functools.lru_cache(maxsize=None)(seconds_of_nodes)
    grid = np.array(sorted(budgets))
    fixed = {int(b): [0, 0.0] for b in grid}
    adaptive, adaptive_budgets = [0, 0.0], []
    for record in records:
        stop = latency_aware_budgets(tree_log_weights(record, int(grid[-1]), backend=backend), seconds_of_nodes,
                                     int(grid[-1]))
        on_grid = grid[np.maximum(np.searchsorted(grid, stop, side="right") - 1, 0)]
        accepted = {int(b): accepted_at_every_position(record, int(b), backend=backend) for b in grid}
        for b, per_position in accepted.items():
            lengths = round_lengths(per_position)
            fixed[b][0] += sum(lengths)
            fixed[b][1] += len(lengths) * seconds_of_nodes(tree_nodes(b))
        lengths = round_lengths(np.array([accepted[int(b)][t] for t, b in enumerate(on_grid)]))
        chosen = on_grid[np.cumsum([0, *lengths[:-1]])]
        adaptive[0] += sum(lengths)
        adaptive[1] += sum(seconds_of_nodes(tree_nodes(int(b))) for b in chosen)
        adaptive_budgets += chosen.tolist()
    rates = {b: tokens / seconds for b, (tokens, seconds) in fixed.items()}
    best = max(rates, key=rates.get)
    rate = adaptive[0] / adaptive[1]
    return {"fixed": rates, "latency_aware": rate, "latency_aware_mean_budget": float(np.mean(adaptive_budgets)),
            "best_fixed_budget": best, "beats_best_fixed": bool(rate > rates[best])}


def tree_log_weights(record, budget: int, *, backend: str = "auto") -> np.ndarray:
    """float64 [T, budget + 1]: the log weights of the best-first tree at every recorded position."""
    from .checks import to_numpy
    from .tree_build import build_tree
    positions = record.draft.logp.shape[0]
    return to_numpy(build_tree(record.draft, budget, root=record.tokens[:positions], backend=backend).log_weights)
