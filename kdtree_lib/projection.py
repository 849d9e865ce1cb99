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

from dataclasses import asdict, dataclass

from .paths import BF16_BYTES


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
        step = step_costs(config, hardware, batch=batch, nodes=budget + 1, context=context,
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
                            context=int(row["context"]), moe_layer=_as_bool(row["moe_layer"]), **layer_options)
        for name in ratios:
            ratios[name].append(ideal[name] / float(row[f"{name}_seconds"]))
    return Efficiency(**{name: _median(values) for name, values in ratios.items()})


def assumptions(hardware: Hardware, efficiency: Efficiency, **extra) -> list[str]:
    """Printable lines: every constant the projection rests on."""
    lines = [f"{key} = {value}" for key, value in asdict(hardware).items()]
    lines += [f"efficiency.{key} = {value:.3f}" for key, value in asdict(efficiency).items()]
    lines += [f"{key} = {value}" for key, value in extra.items()]
    return lines


def _roofline(num_bytes: float, flops: float, hardware: Hardware) -> float:
    return max(num_bytes / hardware.memory_bandwidth, flops / hardware.matmul_flops)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else 0.5 * (ordered[middle - 1] + ordered[middle])


def _as_bool(value) -> bool:
    return value in (True, 1, "1", "True", "true")
