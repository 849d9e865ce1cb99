"""The memory plan: bytes per GPU of a tensor-parallel DDTree decode, by item, before anything loads
(the pair's: the target's and the drafter's weights and caches, so it lives beside pairs, not in model/).

    plan(config, tp, batch, context, budget, drafter) -> MemoryPlan
    plan(...).check()      raises MemoryPlanError, naming what does not fit and what would make it fit

Items (every figure is per GPU, computed from the configs, not measured):
    weights int4       the routed experts resident as INT4 at 4 + 16/group bits per weight (the
                       checkpoint's codes and bf16 group scales; the kernel's repacked layout keeps
                       4.5 bits at group 32), 1/tp of them per rank (width slices or whole experts)
    weights bf16       everything else, with kdtree_lib.model's split: q_b/kv_b/o_proj, dense and
                       shared MLPs, embedding and LM head 1/tp each; q_a/kv_a, norms and routers whole
    weights fp32       the routers' correction biases (kept in fp32) and the fp32 copy of each router's
                       weight that model.Router.weight_fp32 keeps beside the bf16 one (cast once, not per call)
    MLA cache          [B, L, 576] bf16 per layer, whole on every rank (one latent per token, no heads
                       to split), L = the decoder's capacity for `context` tokens and one tree
    drafter            the DFlash weights in bf16: whole ("replicated") or their attention and MLP
                       1/tp ("sharded", dflash.DEFAULT_DRAFTER_PLACEMENT, as the decode places it)
    drafter cache      its context keys/values [B, G, L, d] bf16 per layer (1/tp of G when sharded)
    workspace          verify logits (fp32 [B, N, V] gathered, its rank's slice, a softmax at T > 0),
                       draft logits (fp32 [B, D, V] gathered and sliced), a prefill chunk's
                       activations and features, and RUNTIME_RESERVE for the CUDA context, NCCL
                       and cuBLAS buffers and allocator slack (an assumption, not a measurement)

The box (docs/DESIGN.md §9): 8 GPUs of BOX_GPU_BYTES; with the SGLang service running about 87 GB of each
is taken, so `free` is what is left.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .checks import check_positive_int
from .contracts import CAPACITY_ROUND, cache_capacity as _cache_capacity
from .dflash import DEFAULT_DRAFTER_PLACEMENT, DRAFTER_PLACEMENTS, DFlashDrafter
from .model.config import ModelConfig
from .model.model import Experts, Router, Transformer
from .model.tp import TensorParallel
from .paths import BF16_BYTES, FP32_BYTES

GIB = 2 ** 30
BOX_GPU_BYTES = 97_887 * 2 ** 20       # an RTX PRO 6000 Blackwell as nvidia-smi reports it (96 GB)
RUNTIME_RESERVE = 2 * GIB              # CUDA context, NCCL and cuBLAS buffers, allocator slack (assumed)
PREFILL_ACTIVATION_COPIES = 8          # [B, C, D] buffers alive at once in a layer (residual, norms, outputs)


class MemoryPlanError(ValueError):
    """The plan does not fit: the message has the table and what would make it fit."""


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU by item for one (config, tp, batch, context, budget, drafter) decode."""
    tp: int
    batch: int
    context: int
    budget: int
    capacity: int                      # cache slots per request
    items: dict[str, int]              # item -> bytes per GPU
    gpu_bytes: int                     # what one GPU has for this run
    advice: list[str] = field(default_factory=list)  # what would make it fit (empty when it fits)

    @property
    def total(self) -> int:
        return sum(self.items.values())

    @property
    def weights(self) -> int:
        """The target's weights, every dtype."""
        return sum(size for item, size in self.items.items() if item.startswith("weights"))

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_bytes

    def table(self) -> str:
        """The plan as lines of GiB per GPU (what is printed before loading)."""
        lines = [f"memory plan per GPU: TP={self.tp}, batch {self.batch}, context {self.context}, "
                 f"budget {self.budget} (cache capacity {self.capacity})"]
        lines += [f"  {item:<16} {size / GIB:8.2f} GiB" for item, size in self.items.items()]
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines.append(f"  {'total':<16} {self.total / GIB:8.2f} GiB of {self.gpu_bytes / GIB:.2f} GiB: {verdict}")
        lines += [f"  to fit: {line}" for line in self.advice]
        return "\n".join(lines)

    def check(self) -> "MemoryPlan":
        """The plan itself when it fits; else MemoryPlanError with the table and the advice."""
        if not self.fits:
            raise MemoryPlanError(f"batch/context/tp: {self.total / GIB:.2f} GiB per GPU needed, "
                                  f"{self.gpu_bytes / GIB:.2f} GiB available\n{self.table()}")
        return self


def plan(config: ModelConfig, tp: int, batch: int, context: int, budget: int, drafter=None, *,
         gpu_bytes: int = BOX_GPU_BYTES, drafter_placement: str = DEFAULT_DRAFTER_PLACEMENT, temperature: float = 0.0,
         prefill_chunk: int = 256) -> MemoryPlan:
    """Bytes per GPU of a decode of `batch` requests of up to `context` tokens (prompt + new) with
    trees of `budget` nodes; drafter: its DFlashConfig (None: autoregressive, no drafter)."""
    tp, batch = check_positive_int("tp", tp), check_positive_int("batch", batch)
    context, budget = check_positive_int("context", context), check_positive_int("budget", budget)
    if drafter_placement not in DRAFTER_PLACEMENTS:
        raise ValueError(f"drafter_placement: expected one of {DRAFTER_PLACEMENTS}, got {drafter_placement!r}")
    sizing = _Sizing(config, tp, budget, drafter, target_weight_bytes(config, tp), int(gpu_bytes), temperature,
                     prefill_chunk)
    result = sizing.plan(batch, context, drafter_placement)
    if result.fits:
        return result
    return MemoryPlan(**{**result.__dict__, "advice": sizing.advice(result, drafter_placement)})


def cache_capacity(context: int, budget: int, drafter) -> int:
    """The decoder's cache slots for `context` tokens (contracts.cache_capacity) with a tree of
    `budget` nodes, or the root alone without a drafter."""
    depth = drafter.draft_depth if drafter is not None else 0
    return _cache_capacity(context, budget + 1 if drafter is not None else 1, depth)


@dataclass(frozen=True)
class _Sizing:
    """What a plan does not vary when the advice tries other batches, contexts or placements."""
    config: ModelConfig
    tp: int
    budget: int
    drafter: object
    weights: dict[str, int]
    gpu_bytes: int
    temperature: float
    prefill_chunk: int

    def plan(self, batch: int, context: int, placement: str) -> MemoryPlan:
        config, drafter, tp = self.config, self.drafter, self.tp
        capacity = cache_capacity(context, self.budget, drafter)
        items = dict(self.weights)
        items["MLA cache"] = config.num_hidden_layers * batch * capacity * config.cache_dim * BF16_BYTES
        if drafter is not None:
            items["drafter"] = drafter_weight_bytes(drafter, tp, placement)
            kv_heads = drafter.num_key_value_heads // (tp if placement == "sharded" else 1)
            items["drafter cache"] = (2 * drafter.num_hidden_layers * batch * capacity * kv_heads * drafter.head_dim
                                      * BF16_BYTES)
        items["workspace"] = workspace_bytes(config, tp, batch, self.budget, drafter, self.temperature,
                                             self.prefill_chunk)
        return MemoryPlan(tp=tp, batch=batch, context=context, budget=self.budget, capacity=capacity, items=items,
                          gpu_bytes=self.gpu_bytes)

    def advice(self, result: MemoryPlan, placement: str) -> list[str]:
        """What would make a plan that does not fit fit: each knob alone."""
        batch, context = result.batch, result.context
        advice = []
        caches = result.items["MLA cache"] + result.items.get("drafter cache", 0)
        fixed = result.total - caches
        if fixed > result.gpu_bytes:
            advice.append(f"the weights, drafter and workspace alone take {fixed / GIB:.2f} GiB: a higher TP "
                          "degree, or more free memory per GPU (stop what else runs on it)")
        if self.drafter is not None and placement == "replicated":
            sharded = self.plan(batch, context, "sharded")
            if sharded.fits:
                advice.append(f"a TP-sharded drafter ({sharded.total / GIB:.2f} GiB per GPU; drafter_placement='sharded')")
        smaller = next((b for b in range(batch - 1, 0, -1) if self.plan(b, context, placement).fits), None)
        if smaller:
            advice.append(f"batch {smaller} at context {context}")
        per_slot = caches / (batch * result.capacity)
        slots = int((result.gpu_bytes - fixed) / (batch * per_slot)) // CAPACITY_ROUND * CAPACITY_ROUND
        shorter = slots - (result.capacity - context)
        if shorter >= 1 and self.plan(batch, shorter, placement).fits:
            advice.append(f"context {shorter} at batch {batch}")
        return advice or [f"nothing at TP={self.tp} alone: {math.ceil(result.total / result.gpu_bytes)}x the memory"]


def target_weight_bytes(config: ModelConfig, tp: int) -> dict[str, int]:
    """{"weights int4", "weights bf16", "weights fp32"}: one rank's share of the target (the model
    built on the meta device with this TP degree; the routed experts counted at INT4)."""
    with torch.device("meta"):
        model = Transformer(config, TensorParallel(rank=0, size=tp))
    experts = {name for name, module in model.named_modules() if isinstance(module, Experts)}
    routers = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, Router)}
    expert_weights = bf16 = fp32 = 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name.rsplit(".", 1)[0] in experts:
            expert_weights += tensor.numel()
        elif name.endswith("e_score_correction_bias"):
            fp32 += tensor.numel() * FP32_BYTES
        else:
            bf16 += tensor.numel() * BF16_BYTES
            if name in routers:  # Router.weight_fp32 keeps an fp32 copy beside it
                fp32 += tensor.numel() * FP32_BYTES
    quant = config.quantization
    int4 = expert_weights * (quant.num_bits + 16 / quant.group_size) / 8 if quant else 0
    bf16 += 0 if quant else expert_weights * BF16_BYTES
    return {"weights int4": int(int4), "weights bf16": bf16, "weights fp32": fp32}


def drafter_weight_bytes(drafter, tp: int, placement: str = DEFAULT_DRAFTER_PLACEMENT) -> int:
    """The DFlash drafter's bf16 weights on one rank: whole, or attention and MLP 1/tp ("sharded")."""
    with torch.device("meta"):
        model = DFlashDrafter(drafter)
    total = 0
    for name, tensor in model.named_parameters():
        split = placement == "sharded" and (".self_attn." in name or ".mlp." in name) and "_norm" not in name
        total += tensor.numel() * BF16_BYTES // (tp if split else 1)
    return total


def workspace_bytes(config: ModelConfig, tp: int, batch: int, budget: int, drafter, temperature: float,
                    prefill_chunk: int) -> int:
    """Logit buffers of a verify and a draft, one prefill chunk's activations, RUNTIME_RESERVE."""
    vocab, hidden = config.vocab_size, config.hidden_size
    nodes = budget + 1 if drafter is not None else 1
    verify = batch * nodes * vocab * FP32_BYTES * (1 + 1 / tp + (1 if temperature > 0 else 0))
    draft = batch * drafter.draft_depth * vocab * FP32_BYTES * (1 + 1 / tp) if drafter is not None else 0
    features = len(drafter.target_layer_ids) if drafter is not None else 0
    chunk = batch * prefill_chunk * hidden * BF16_BYTES * (PREFILL_ACTIVATION_COPIES + features)
    return int(verify + draft + chunk + RUNTIME_RESERVE)
