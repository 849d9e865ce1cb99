"""The roofline cost model of one tensor-parallel DDTree verify step, and of the drafter's forward.

Per layer and per rank, each component's time is max(bytes / bandwidth, FLOPs / matmul rate)
divided by the fraction of that roofline the component reaches (its efficiency, calibrated from
measured H200 rows). Components: attention (MLA projections and the absorbed tree attention over
the latent cache, which every rank holds whole), moe (router, the routed experts the step's tokens
touch, the shared expert; or the dense MLP of the first layers), allreduce (two per layer) and rest
(lm_head and fixed per-step costs such as the drafter and the tree kernels). Every number that is an
assumption is a field of `Hardware` or an argument, so a notebook can print them beside the plot.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..contracts import tree_nodes
from ..dflash import DRAFTER_PLACEMENTS
from ..paths import BF16_BYTES

if TYPE_CHECKING:
    from ..dflash import DFlashConfig
    from ..model import ModelConfig


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
    fixed seconds per call + max(bytes / (bandwidth · efficiency), FLOPs / (rate · flops efficiency)));
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
    """A kernel's time: fixed + max(bytes / (bandwidth · bytes_efficiency), FLOPs / (rate · flops_efficiency)),
    a roofline with an efficiency per ceiling and a fixed launch cost; each efficiency in (0, 1], so the
    time is never below the roofline (physics.check_efficiency refuses anything else)."""
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
        return self.fixed + np.maximum(np.asarray(bytes_seconds) / self.bytes_efficiency, compute)

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


def real_drafter_config(config: ModelConfig) -> DFlashConfig:
    """Kimi-K2.6-DFlash as published (DESIGN.md §4): 6 Qwen3 layers at hidden 7168, 64 heads / 8 KV
    heads / head_dim 128, MLP 18432, block 8, target layers 1, 12, 24, 35, 47, 58 (about 6.5 GiB bf16)."""
    from ..dflash import DFlashConfig
    return DFlashConfig(hidden_size=7168, intermediate_size=18432, num_hidden_layers=6, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=128, vocab_size=config.vocab_size, block_size=8,
                        mask_token_id=163838, target_layer_ids=(1, 12, 24, 35, 47, 58), rms_norm_eps=1e-5,
                        rope_theta=50000.0)


def drafter_shards(placement: str, tp: int) -> int:
    """GPUs the drafter's layers are split over: 1 replicated, tp sharded (dflash.load_drafter's
    placements; decode_tp.generate_tp shards it by default at TP > 1)."""
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

