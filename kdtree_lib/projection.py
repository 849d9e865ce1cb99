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

import math
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Callable

import numpy as np

from . import results
from .contracts import tree_nodes
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
    """Fraction of the roofline each component reaches (1.0 = at the roofline)."""
    attention: float = 1.0
    moe: float = 1.0
    rest: float = 1.0


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
    attention_bytes = attention_params * BF16_BYTES + batch * keys * latent * BF16_BYTES
    attention_flops = 2 * tokens * attention_params + 2 * tokens * heads * keys * (latent + c.kv_lora_rank)
    if moe_layer:
        expert_params = 3 * c.hidden_size * c.moe_intermediate_size / g
        touched = expected_distinct_experts(tokens, c.n_routed_experts, c.num_experts_per_tok, correlation)
        moe_bytes = (touched * expert_params * expert_bits / 8
                     + c.n_shared_experts * expert_params * BF16_BYTES
                     + c.hidden_size * c.n_routed_experts * BF16_BYTES)
        moe_flops = 2 * tokens * expert_params * (c.num_experts_per_tok + c.n_shared_experts)
    else:
        dense_params = 3 * c.hidden_size * c.intermediate_size / g
        moe_bytes, moe_flops = dense_params * BF16_BYTES, 2 * tokens * dense_params
    return {"attention": _roofline(attention_bytes, attention_flops, hardware) / efficiency.attention,
            "moe": _roofline(moe_bytes, moe_flops, hardware) / efficiency.moe,
            "allreduce": 2 * allreduce_time(tokens * c.hidden_size * BF16_BYTES, hardware)}


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
    lines = [f"{key} = {value}" for key, value in asdict(hardware).items()]
    lines += [f"efficiency.{key} = {value:.3f}" for key, value in asdict(efficiency).items()]
    lines += [f"{key} = {value}" for key, value in extra.items()]
    return lines


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
