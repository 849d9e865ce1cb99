"""The target: Kimi K2.6 (DeepSeek-V3 architecture), multi-head latent attention + mixture of experts.

    tokens -> embed_tokens -> [RMSNorm -> MLA -> +] -> [RMSNorm -> MoE (dense SwiGLU in the first
    layers) -> +] x num_hidden_layers -> norm -> lm_head -> logits

Every forward is a verify step over a Tree (docs/DESIGN.md §3): the T new tokens are the tree's nodes,
node i's cache entry goes to slot lengths[b] + i, its position is lengths[b] + depth, and it
attends to the committed cache and to its ancestors. A prefill is the same step over a chain.

MLA keeps one 576-wide latent entry per token and layer (the absorbed cache); attention runs in
one of two forms over it:
    "naive"    : expand per-head keys/values with kv_b_proj, softmax(q·k) v  (the transformers form)
    "absorbed" : fold W_UK into the query and W_UV into the output, attend in the 512-wide latent
                 space with kdtree_lib.verify_attn (the torch reference, or the kernel on a GPU)

Tensor parallel (tp.py): heads, MLP widths, expert widths (or experts) and the vocabulary are
split over ranks; a module's `tp_dim` says which dimension of its weight is split.
Shapes: B requests, T new tokens, L cache slots, D hidden, H heads on this rank, V vocabulary.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import backend as _backend
from ..checks import dtype_name
from ..moe import Int4Experts, layout_shapes, moe_forward, prepare_moe_launch, repack
from ..rms_norm import kernel_takes, launch_norm, rms_norm_add_reference, rms_norm_reference
from ..tree_accept import compact_cache
from ..contracts import Tree, pack_mask
from ..verify_attn import (KERNEL_DTYPES, LATENT_DIM, ROPE_DIM, absorb_query, attend_latent, key_mask,
                           prepare_verify_launch, project_output, verify_attention)
from .config import ModelConfig
from .tp import TensorParallel

ATTENTION_PATHS = ("naive", "absorbed")
MOE_PARALLEL = ("tp", "ep")
PREFILL_LOGITS = ("all", "last", "none")
PREFILL_CHUNK = 256     # prompt tokens per prefill forward: its attention mask is [B, C, max(lengths) + C]
LATENT_NORM_EPS = 1e-6  # q_a/kv_a layernorms use the RMSNorm default, not rms_norm_eps (as DeepSeek-V3)


def linear(in_features: int, out_features: int, tp_dim: int | None = None) -> nn.Linear:
    """A bias-free linear layer; tp_dim 0 = column-parallel (rows split), 1 = row-parallel."""
    layer = nn.Linear(in_features, out_features, bias=False)
    layer.tp_dim = tp_dim
    return layer


class RMSNorm(nn.Module):
    """weight * normalised x (kdtree_lib.rms_norm's formula): one kernel launch for bf16/fp16 CUDA rows
    outside autograd, torch's ops otherwise (CPU results are those ops' exactly)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if self._kernel_runs(x):
            return launch_norm(x, None, self.weight, self.eps)[0]
        return rms_norm_reference(x, self.weight, self.eps)

    def add_forward(self, x, residual):
        """(norm of s, s) for s = x + residual: the residual add a layer's norm reads, in the same launch."""
        if self._kernel_runs(x, residual) and residual.shape == x.shape and kernel_takes(residual, self.weight):
            return launch_norm(x, residual, self.weight, self.eps)
        return rms_norm_add_reference(x, residual, self.weight, self.eps)

    def _kernel_runs(self, *inputs) -> bool:
        if torch.is_grad_enabled() and any(t.requires_grad for t in (*inputs, self.weight)):
            return False  # the kernel has no backward
        return inputs[0].is_cuda and kernel_takes(inputs[0], self.weight)


# ----------------------------------------------------------------------------------------------
# rotary position embedding (YaRN)

def yarn_inv_freq(dim: int, base: float, factor: float = 1.0, original_max_position: int = 4096,
                  beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True) -> torch.Tensor:
    """inv_freq float32 [dim/2]: YaRN's blend of interpolated (/ factor) and original frequencies,
    ramped between the dimensions that rotate beta_fast and beta_slow times over the original
    context (transformers' _compute_yarn_parameters); plain RoPE when factor <= 1."""
    steps = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu")  # cpu even when built on meta
    original = 1.0 / base ** (steps / dim)
    if factor <= 1:
        return original

    def correction_dim(rotations):  # the dimension whose wavelength fits `rotations` times
        return dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((steps / 2 - low) / max(high - low, 1e-3)).clamp(0, 1)
    return original / factor * ramp + original * (1 - ramp)


def yarn_mscale(factor: float, scale: float = 1.0) -> float:
    """YaRN's temperature term 0.1 * scale * ln(factor) + 1 (1 without scaling)."""
    return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0


def rope_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """inv_freq float32 [rope/2] and the cos/sin scale (YaRN's attention factor, as transformers)."""
    factor = config.rope_factor
    inv_freq = yarn_inv_freq(config.qk_rope_head_dim, config.rope_theta, factor, config.rope_original_max_position,
                             config.rope_beta_fast, config.rope_beta_slow, config.rope_truncate)
    if factor <= 1:
        return inv_freq, 1.0
    if config.rope_mscale and config.rope_mscale_all_dim:
        return inv_freq, yarn_mscale(factor, config.rope_mscale) / yarn_mscale(factor, config.rope_mscale_all_dim)
    return inv_freq, yarn_mscale(factor)


def rope_index(rope: int, interleave: bool) -> torch.Tensor:
    """int64 [2 rope]: where `rotate` reads a target key or query [..., rope] from, as [x1 | x2 | x2 | x1]
    with x1, x2 the first and second elements of the rotated pairs: (0,1), (2,3), ... in interleaved
    checkpoints, else the two halves. The output holds the rotated pairs as [first halves | second
    halves], for queries and keys alike, so their dot products are right."""
    first = torch.arange(0, rope, 2 if interleave else 1, device="cpu")[:rope // 2]  # cpu even when built on meta
    second = first + (1 if interleave else rope // 2)
    return torch.cat([first, second, second, first])


def rope_table(cos, sin, scale: float, dtype) -> torch.Tensor:
    """rotate's table for rope_index's gather, [..., 2 rope] = [cos | cos | -sin | sin] x scale in
    `dtype`, from float32 cos/sin [..., rope/2]: made once per step for all layers."""
    table = torch.cat([cos, cos, -sin, sin], dim=-1)
    return (table if scale == 1 else table * scale).to(dtype)  # x * 1 is x: the multiply is skipped


def rotate(x, table, index, out=None):
    """RoPE in three ops: x [..., n] gathered at `index` [2n], times `table` [..., 2n] (broadcast), and
    the two halves of the products added (into `out` when given: a prepared launch's query buffer, or
    a strided view that lays the result out as its reader wants it).

    Output element i is terms[i] + terms[n + i]: the tables place each output's cosine term in the
    first half and its sine term, sign included, in the second, so every element is the textbook
    formula's products and sum, bit for bit (x1 cos - x2 sin = x1 cos + x2 (-sin) exactly)."""
    n = x.shape[-1]
    terms = x.index_select(-1, index) * table
    return torch.add(terms[..., :n], terms[..., n:], out=out)


def made_once(owner, name: str, key, make):
    """owner's tensor `name`, made by make() and kept while `key` holds (a step's constant: offsets,
    a cast weight), so a step does not launch it again. While a CUDA graph captures, make()'s kernel
    is only recorded, so what it returns is not kept (the warm-up steps before a capture keep theirs)."""
    held = owner.__dict__.get(name)
    if held is not None and held[0] == key:
        return held[1]
    value = make()
    if not (value.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        owner.__dict__[name] = (key, value)
    return value


def arange_on(owner, count: int, device) -> torch.Tensor:
    """int64 arange(count) on `device`, made once per owner and count (made_once)."""
    return made_once(owner, f"_arange_{count}", torch.device(device),
                     lambda: torch.arange(count, device=device))


# ----------------------------------------------------------------------------------------------
# one verify step's bookkeeping, shared by all layers

@dataclass
class Step:
    """Where this forward's T new tokens go in the cache and what they may attend to."""
    tree: Tree            # on the model's device; a chain for a prefill
    lengths: torch.Tensor  # int32 [B]: committed tokens, visible to every new token
    slots: torch.Tensor    # int64 [B, T]: cache slot of new token t = lengths + t
    rope: torch.Tensor     # [B, T, 2 rope]: rotate's table at positions lengths + depth (rope_table, once per step)
    rope_index: torch.Tensor  # int64 [2 rope]: rotate's gather (rope_index, made once per model)
    visible: int           # slots any token may see: max(lengths) + T
    mask: torch.Tensor | None  # bool [B, T, visible]: for the naive path and the absorbed torch reference
                               # (once per step, on the device), None where the kernel attends
    rows: torch.Tensor | None = None  # int64 [B, 1]: each request's row, for the cache writes (once per step)
    prepared: "PreparedVerify | None" = None  # the step's launches, made once (Transformer.prepare_verify)


@dataclass
class KVCache:
    """The absorbed MLA cache: per layer kv [B, L_max, 576] = [c_kv | k_rope], and lengths int32 [B]."""
    kv: list[torch.Tensor]
    lengths: torch.Tensor

    @property
    def capacity(self) -> int:
        return int(self.kv[0].shape[1])

    def accept(self, result) -> None:
        """Keep the accepted tree nodes (an AcceptResult): move them to the committed end (lengths
        updated in place: a prepared step or a captured graph reads this buffer)."""
        self.lengths.copy_(compact_cache(self.kv, self.lengths, result))


@dataclass
class TargetOutput:
    logits: torch.Tensor | None   # float32 [B, T, V] (a prefill's: [B, 1, V] with logits="last", None with "none")
    features: torch.Tensor | None  # [B, T, len(feature_layers) * D]: the requested layers' outputs


@dataclass
class PrefillChunk:
    """One forward of a chunked prefill: prompt columns [start, start + T), already committed."""
    start: int
    hidden: torch.Tensor           # [B, T, D]: the last layer's output (before the final norm)
    features: torch.Tensor | None  # [B, T, F] at the requested layers
    committed: torch.Tensor        # int32 [B]: each request's tokens of this chunk now in the cache


def chain_tree(tokens: torch.Tensor) -> Tree:
    """The chain tokens[:, 0] -> tokens[:, 1] -> ... as a Tree on tokens' device, built directly
    (tree_from_parents walks nodes on the host and holds a dense [N, N] ancestor matrix)."""
    batch, width = tokens.shape
    device = tokens.device
    column = torch.arange(width, dtype=torch.int32, device=device).expand(batch, -1)
    mask = torch.as_tensor(pack_mask(np.tri(width, dtype=bool)), device=device)          # (C, ceil(C/32))
    return Tree(tokens=tokens.to(torch.int32), parents=column - 1, depths=column,
                n_nodes=torch.full((batch,), width, dtype=torch.int32, device=device),
                mask=mask.expand(batch, -1, -1),
                first_child=torch.where(column + 1 < width, column + 1, -1), next_sibling=torch.full_like(column, -1),
                log_weights=torch.zeros(batch, width, dtype=torch.float64, device=device), max_depth=width - 1)


# ----------------------------------------------------------------------------------------------
# attention

class Attention(nn.Module):
    """Multi-head latent attention. q_a/kv_a are replicated, q_b/kv_b split by head, o_proj by
    its input (row-parallel): forward returns this rank's partial sum of the output."""

    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        c = config
        tp.split(c.num_attention_heads, "num_attention_heads")
        self.heads = c.num_attention_heads // tp.size
        self.nope, self.rope, self.v_dim, self.latent = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        self.scale = c.softmax_scale
        self.q_a_proj = linear(c.hidden_size, c.q_lora_rank)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS)
        self.q_b_proj = linear(c.q_lora_rank, self.heads * c.qk_head_dim, tp_dim=0)
        self.kv_a_proj_with_mqa = linear(c.hidden_size, c.cache_dim)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = linear(c.kv_lora_rank, self.heads * (self.nope + self.v_dim), tp_dim=0)
        self.o_proj = linear(self.heads * self.v_dim, c.hidden_size, tp_dim=1)

    def forward(self, x, step: Step, kv, *, path: str, backend: str, layer: int | None = None):
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, self.heads, -1)  # (B, T, H, 192)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)                            # (B, T, H, 128|64)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.latent, self.rope], dim=-1)  # (B, T, 512|64)
        prepared = step.prepared if step.prepared is not None and step.prepared.attention[layer] is not None else None
        q_rope = rotate(q_rope, step.rope[:, :, None], step.rope_index,
                        out=None if prepared is None else prepared.q_rope)  # straight into the launch's buffer
        k_rope = rotate(k_rope, step.rope, step.rope_index)
        entries = torch.cat([self.kv_a_layernorm(c_kv), k_rope], dim=-1)                   # (B, T, 576)
        rows = torch.arange(B, device=x.device)[:, None] if step.rows is None else step.rows
        kv[rows, step.slots] = entries.to(kv.dtype)
        if prepared is not None:
            o = self.attend_prepared(q_nope, q_rope, prepared, layer)
        else:
            attend = self.attend_absorbed if path == "absorbed" else self.attend_naive
            o = attend(q_nope, q_rope, kv, step, backend)                                   # (B, T, H, 128)
        return self.o_proj(o.flatten(2))                                                    # (B, T, D) partial

    def attend_naive(self, q_nope, q_rope, kv, step: Step, backend):
        """Per-head keys and values expanded from the cache, as transformers computes them."""
        B, L = kv.shape[0], step.visible
        c_kv, k_rope = kv[:, :L].split([self.latent, self.rope], dim=-1)                   # (B, L, 512|64)
        k_nope, v = self.kv_b_proj(c_kv).view(B, L, self.heads, -1).split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope[:, :, None].expand(-1, -1, self.heads, -1)], dim=-1)  # (B, L, H, 192)
        q = torch.cat([q_nope, q_rope], dim=-1)                                              # (B, T, H, 192)
        scores = torch.einsum("bthd,blhd->bhtl", q, k) * self.scale                          # (B, H, T, L)
        scores = scores.masked_fill(~step.mask[:, None], float("-inf"))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.einsum("bhtl,blhd->bthd", probs, v)                                     # (B, T, H, 128)

    def _absorption(self):
        w_uk, w_uv = self.kv_b_proj.weight.view(self.heads, -1, self.latent).split([self.nope, self.v_dim], dim=1)
        return w_uk, w_uv

    def attend_prepared(self, q_nope, q_rope, prepared: "PreparedVerify", layer: int):
        """The absorbed attention through the step's prepared kernel launch for this layer: the
        queries go into the launch's buffers (the copy a kernel call makes of a strided query anyway)."""
        w_uk, w_uv = self._absorption()
        prepared.q_latent.copy_(absorb_query(q_nope, w_uk))
        if q_rope is not prepared.q_rope:  # forward rotates it there already
            prepared.q_rope.copy_(q_rope)
        o_latent, _ = prepared.attention[layer]()
        return project_output(o_latent, w_uv)

    def attend_absorbed(self, q_nope, q_rope, kv, step: Step, backend):
        """Attention in the latent space: q·W_UK against c_kv, then W_UV on the latent output."""
        w_uk, w_uv = self._absorption()
        q_latent = absorb_query(q_nope, w_uk)                                                # (B, T, H, 512)
        if step.mask is not None:  # the torch reference over the step's key mask
            o_latent, _ = attend_latent(q_latent, q_rope, kv[:, :step.visible], step.mask, self.scale)
        else:
            o_latent, _ = verify_attention(q_latent, q_rope.contiguous(), kv, step.lengths, step.tree,
                                           scale=self.scale, backend=backend)               # (B, T, H, 512)
        return project_output(o_latent, w_uv)                                                # (B, T, H, 128)


# ----------------------------------------------------------------------------------------------
# feed-forward: dense SwiGLU and the mixture of experts

class MLP(nn.Module):
    """SwiGLU; gate/up column-parallel, down row-parallel: returns this rank's partial sum."""

    def __init__(self, hidden: int, width: int, tp: TensorParallel, what: str):
        super().__init__()
        tp.split(width, what)
        local = width // tp.size
        self.gate_proj = linear(hidden, local, tp_dim=0)
        self.up_proj = linear(hidden, local, tp_dim=0)
        self.down_proj = linear(local, hidden, tp_dim=1)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Sigmoid scores; top-k chosen on score + correction bias within the best groups (noaux_tc);
    weights are the chosen scores, normalized, times routed_scaling_factor."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))

    def forward(self, x):                                              # x (N, D)
        c = self.config
        scores = F.linear(x.float(), self.weight_fp32()).sigmoid()     # (N, E) fp32
        choice = scores + self.e_score_correction_bias
        if c.topk_group < c.n_group:
            groups = choice.view(len(x), c.n_group, -1)                # (N, G, E/G)
            group_scores = groups.topk(2, dim=-1).values.sum(-1)       # (N, G)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(c.topk_group, dim=-1).indices, True)
            choice = groups.masked_fill(~keep[..., None], float("-inf")).view(len(x), -1)
        ids = choice.topk(c.num_experts_per_tok, dim=-1, sorted=False).indices  # (N, k)
        weights = scores.gather(1, ids)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor, ids

    def weight_fp32(self) -> torch.Tensor:
        """The weight in float32 (the router's scores are fp32): cast once and kept until the weight
        changes (a load, a move or a cast: its address, version or dtype), not once per call."""
        weight = self.weight
        if weight.dtype == torch.float32 or weight.is_inference():  # an inference tensor has no version to watch
            return weight.float()
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
        return made_once(self, "_weight_fp32", key, weight.float)

    def _apply(self, fn, recurse=True):
        """Keep the correction bias in fp32 when the model is cast (as transformers does)."""
        bias = self._buffers.pop("e_score_correction_bias")
        super()._apply(fn, recurse)
        moved = fn(bias)
        self._buffers["e_score_correction_bias"] = moved if moved.dtype == bias.dtype else bias.to(moved.device)
        return self


INT4_BUFFERS = ("gate_up_codes", "gate_up_scales", "down_codes", "down_scales")


class Experts(nn.Module):
    """The routed experts' SwiGLU weights, stacked. moe_parallel "tp": every expert, a 1/tp slice
    of its width; "ep": 1/tp of the experts, whole. Either way forward returns a partial sum.

    Float stacks (gate_up_proj, down_proj) by default; after keep_int4(), INT4 buffers in the MoE
    kernel's layout (kdtree_lib.moe.Int4Experts, 4.5 bits per weight) that forward runs through
    moe_forward: the kernel for bf16 CUDA tokens, the dequantizing reference elsewhere."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, moe_parallel: str):
        super().__init__()
        experts, width = config.n_routed_experts, config.moe_intermediate_size
        if moe_parallel == "tp":
            first, last = 0, experts
            self.width_range = tp.split(width, "moe_intermediate_size")
        else:
            first, last = tp.split(experts, "n_routed_experts")
            self.width_range = (0, width)
        self.expert_ids = range(first, last)
        self.total_experts, self.hidden = experts, config.hidden_size
        self.width = self.width_range[1] - self.width_range[0]
        self.int4 = False
        self.gate_up_proj = nn.Parameter(torch.empty(len(self.expert_ids), 2 * self.width, config.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(len(self.expert_ids), config.hidden_size, self.width))

    def keep_int4(self) -> None:
        """Hold the experts INT4 instead of as float stacks. Call it on a model built on the meta
        device (checkpoint.empty_target does), so no float stack is ever allocated."""
        device = self.gate_up_proj.device
        del self.gate_up_proj, self.down_proj
        for name, (rows, inputs) in (("gate_up", (2 * self.width, self.hidden)), ("down", (self.hidden, self.width))):
            codes, scales = layout_shapes(len(self.expert_ids), rows, inputs)
            self.register_buffer(f"{name}_codes", torch.empty(codes, dtype=torch.int32, device=device))
            self.register_buffer(f"{name}_scales", torch.empty(scales, dtype=torch.bfloat16, device=device))
        self.int4 = True

    def int4_experts(self) -> Int4Experts:
        """This rank's INT4 experts as moe_forward takes them (views of the buffers), checked once and
        kept until the buffers move (a new device or dtype: _apply)."""
        buffers = tuple(getattr(self, name) for name in INT4_BUFFERS)
        held = getattr(self, "_int4_view", None)
        if held is None or any(a is not b for a, b in zip(held[0], buffers)):
            experts = Int4Experts(*buffers, hidden=self.hidden, width=self.width,
                                  first_expert=self.expert_ids.start, total_experts=self.total_experts)
            self._int4_view = held = (buffers, experts)
        return held[1]

    @torch.no_grad()
    def load_int4(self, local: int, gate_up_packed, gate_up_scale, down_packed, down_scale) -> None:
        """Local expert `local` from the checkpoint's packed layout, repacked into the buffers (on their
        device: the permutation's transient byte-per-code tensors are one expert's)."""
        device = self.gate_up_codes.device
        for name, packed, scale in (("gate_up", gate_up_packed, gate_up_scale), ("down", down_packed, down_scale)):
            codes, scales = repack(packed[None].to(device), scale[None].to(device))
            getattr(self, f"{name}_codes")[local].copy_(codes[0])
            getattr(self, f"{name}_scales")[local].copy_(scales[0])

    def _apply(self, fn, recurse=True):
        """INT4 codes and bf16 scales move with the model but keep their dtypes when it is cast."""
        if not self.int4:
            return super()._apply(fn, recurse)
        kept = {name: self._buffers.pop(name) for name in INT4_BUFFERS}
        super()._apply(fn, recurse)
        for name, tensor in kept.items():
            moved = fn(tensor)
            self._buffers[name] = moved if moved.dtype == tensor.dtype else tensor.to(moved.device)
        return self

    def forward(self, x, ids, weights, launch: "PreparedMoe | None" = None):  # x (N, D), ids/weights (N, k)
        """Weighted sum of each token's experts (this rank's share): INT4 through a prepared kernel
        launch (a decode step's) or moe_forward; float stacks by one grouped GEMM per projection in
        bf16 where torch has it, else a loop over the experts hit."""
        if launch is not None:
            return launch(x, ids, weights)
        if self.int4:
            return moe_forward(x, ids, weights, self.int4_experts(), routed=True)
        if x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
            return self.grouped(x, ids, weights)
        return self.looped(x, ids, weights)

    def looped(self, x, ids, weights):
        out = torch.zeros_like(x)
        first = self.expert_ids.start
        for expert in torch.unique(ids).tolist():
            if expert not in self.expert_ids:
                continue
            token, slot = torch.where(ids == expert)
            gate, up = F.linear(x[token], self.gate_up_proj[expert - first]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert - first])             # (n, D)
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out

    def grouped(self, x, ids, weights):
        """Fixed shapes and no host synchronisation (a CUDA graph captures it): every (token, slot)
        assignment is sorted by expert, other ranks' experts last, and those rows are dropped. ids are
        the router's, expert ids in [0, total_experts): where this rank holds every expert, all are its own."""
        experts = len(self.expert_ids)
        mine = None
        if experts == self.total_experts:
            key = ids.flatten()                                            # (N*k,)
        else:
            local = ids - self.expert_ids.start                            # (N, k)
            mine = (local >= 0) & (local < experts)
            key = torch.where(mine, local, experts).flatten()              # (N*k,) other ranks' experts sort last
        by_expert, order = key.sort(stable=True)
        token = order // ids.shape[1]                                      # assignment n*k + j is token n
        ends = torch.searchsorted(by_expert, arange_on(self, experts, x.device), right=True, out_int32=True)
        gate, up = torch._grouped_mm(x[token], self.gate_up_proj.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=ends)  # (N*k, D)
        if mine is not None:                                               # rows past ends[-1] are not computed
            y = torch.where(mine.flatten()[order, None], y, 0)
        return combine_slots(y, order, weights, x.dtype)


def combine_slots(y, order, weights, dtype):
    """out[t] = sum over slots s of weights[t, s] * y[t, s] in fp32, then one rounding to dtype: the INT4
    kernel's moe_combine. y holds the (token, slot) rows in expert order (row i is assignment order[i]).
    Why not index_add_ into the output: on CUDA it adds with atomics in whatever order they land, so a
    greedy decode did not repeat itself run to run (H200, 2026-12-02: 2 of 8 AR texts equal; 8 of 8 under
    torch's deterministic algorithms); here every sum runs in slot order."""
    slots = y.new_empty(y.shape).index_copy_(0, order, y)                 # back in assignment order n*k + j
    return (slots.view(*weights.shape, -1).float() * weights[..., None]).sum(1).to(dtype)


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, moe_parallel: str):
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config, tp, moe_parallel)
        self.shared_experts = MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                                  tp, "moe_intermediate_size * n_shared_experts")

    def forward(self, x, launch: "PreparedMoe | None" = None):          # x (B, T, D)
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.gate(flat)
        return (self.experts(flat, ids, weights, launch) + self.shared_experts(flat)).view_as(x)


# ----------------------------------------------------------------------------------------------
# the model

class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel, moe_parallel: str):
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = (MoE(config, tp, moe_parallel) if config.is_moe_layer(layer)
                    else MLP(config.hidden_size, config.intermediate_size, tp, "intermediate_size"))

    def pieces(self, step: Step, kv, *, path: str, backend: str, layer: int | None = None, given: str = "x",
               out: str = "x") -> list[tuple[str, str, "Callable[[dict], None]"]]:
        """The layer as (component, part, run(state)) pieces over a state dict, reading the residual
        stream from state[given] and writing it to state[out]: forward runs them in order; a
        benchmark times them one by one (bench.tp_step: marks between them, one graph each)."""
        tp, launch = self.tp, None if step.prepared is None else step.prepared.moe[layer]

        def norm_in(state):
            state["h"] = self.input_layernorm(state[given])

        def attend(state):
            state["a"] = self.self_attn(state["h"], step, kv, path=path, backend=backend, layer=layer)

        def add_attention(state):  # r = x + a, h = norm(r)
            state["h"], state["r"] = self.post_attention_layernorm.add_forward(state["a"], state[given])

        def add_mlp(state):
            state[out] = state["r"] + state["m"].view_as(state["r"])

        if isinstance(self.mlp, MoE):
            moe = self.mlp

            def route(state):
                state["flat"] = state["h"].flatten(0, 1)
                state["weights"], state["ids"] = moe.gate(state["flat"])

            def experts(state):
                state["m"] = moe.experts(state["flat"], state["ids"], state["weights"], launch)

            def shared(state):
                state["m"] = state["m"] + moe.shared_experts(state["flat"])
            mlp = [("moe", "router", route), ("moe", "experts", experts), ("moe", "shared", shared)]
        else:
            def dense(state):
                state["m"] = self.mlp(state["h"])
            mlp = [("moe", "dense_mlp", dense)]
        reduce_attention = [("allreduce", "allreduce", lambda state: tp.all_reduce(state["a"]))] if tp.size > 1 else []
        reduce_mlp = [("allreduce", "allreduce", lambda state: tp.all_reduce(state["m"]))] if tp.size > 1 else []
        return [("rest", "norm", norm_in), ("attention", "attention", attend), *reduce_attention,
                ("rest", "residual", add_attention), *mlp, *reduce_mlp, ("rest", "residual", add_mlp)]

    def forward(self, x, step: Step, kv, *, path: str, backend: str, layer: int | None = None):
        state = {"x": x}
        for _, _, run in self.pieces(step, kv, path=path, backend=backend, layer=layer):
            run(state)
        return state["x"]


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r V/tp, (r+1) V/tp); ids elsewhere embed to zero before the all-reduce."""

    def __init__(self, vocab: int, dim: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.start, stop = tp.split(vocab, "vocab_size")
        self.weight = nn.Parameter(torch.empty(stop - self.start, dim))
        self.tp_dim = 0

    def forward(self, ids):                                            # ids int32 or int64
        local = ids if self.start == 0 else ids - self.start
        clamped = local.clamp(0, len(self.weight) - 1)
        x = F.embedding(clamped, self.weight)
        return self.tp.all_reduce(x * (clamped == local)[..., None])  # rows outside this rank's: zero


class Transformer(nn.Module):
    """The target model. Build with load_target (checkpoint.py), or directly for a random model."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = TensorParallel(), *,
                 moe_parallel: str = "tp", attention: str = "absorbed", attention_backend: str = "auto"):
        super().__init__()
        if moe_parallel not in MOE_PARALLEL:
            raise ValueError(f"moe_parallel: expected one of {MOE_PARALLEL}, got {moe_parallel!r}")
        self.config, self.tp = config, tp
        self.attention, self.attention_backend = attention, attention_backend
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(Block(config, i, tp, moe_parallel) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = linear(config.hidden_size, len(self.embed_tokens.weight), tp_dim=0)
        self.inv_freq, self.rope_scale = rope_frequencies(config)
        self.rope_index = rope_index(config.qk_rope_head_dim, config.rope_interleave)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty absorbed cache for `batch` requests of up to `capacity` tokens (prompt + tree)."""
        dtype, device = self.embed_tokens.weight.dtype, self.device
        kv = [torch.zeros(batch, capacity, self.config.cache_dim, dtype=dtype, device=device)
              for _ in self.layers]
        return KVCache(kv=kv, lengths=torch.zeros(batch, dtype=torch.int32, device=device))

    @torch.no_grad()
    def prefill(self, tokens, cache: KVCache, *, n_valid=None, feature_layers=(), logits: str = "all",
                chunk: int = PREFILL_CHUNK) -> TargetOutput:
        """Run prompt tokens [B, T] after each request's committed tokens and commit them, `chunk`
        tokens per forward (prefill_chunks).

        n_valid [B] (default T) commits only each request's first n_valid tokens (right padding).
        logits: "all" [B, T, V]; "last" [B, 1, V] at each request's last committed token (the LM
        head and the vocabulary gather run on those rows only); "none".
        """
        if logits not in PREFILL_LOGITS:
            raise ValueError(f"logits: expected one of {PREFILL_LOGITS}, got {logits!r}")
        tokens = torch.as_tensor(tokens)
        batch = tokens.shape[0]
        n_valid = torch.as_tensor(tokens.shape[1] if n_valid is None else n_valid, device=self.device)
        last_row = (n_valid.expand(batch) - 1).long()                                       # (B,)
        rows, features, last = [], [], None
        for part in self.prefill_chunks(tokens, cache, n_valid=n_valid, feature_layers=feature_layers, chunk=chunk):
            if logits == "all":
                rows.append(self.logits(part.hidden))
            elif logits == "last":
                inside = (last_row - part.start).clamp(0, part.hidden.shape[1] - 1)
                here = part.hidden[torch.arange(batch, device=self.device), inside]           # (B, D)
                found = ((last_row >= part.start) & (last_row < part.start + part.hidden.shape[1]))[:, None]
                last = here if last is None else torch.where(found, here, last)
            if feature_layers:
                features.append(part.features)
        out = {"all": lambda: torch.cat(rows, dim=1), "last": lambda: self.logits(last[:, None]),
               "none": lambda: None}[logits]()
        return TargetOutput(logits=out, features=torch.cat(features, dim=1) if feature_layers else None)

    def prefill_chunks(self, tokens, cache: KVCache, *, n_valid=None, feature_layers=(), chunk: int = PREFILL_CHUNK):
        """Yield a PrefillChunk per `chunk` columns of tokens [B, T]: each chunk is a chain after the
        committed cache, its attention mask [B, C, max(lengths) + C]; no logits are computed. A
        request commits its first n_valid[b] tokens (default T); its later columns are padding."""
        if not (isinstance(chunk, int) and chunk >= 1):
            raise ValueError(f"chunk: expected a positive number of tokens, got {chunk!r}")
        tokens = torch.as_tensor(tokens).to(self.device)
        length = tokens.shape[1]
        n_valid = torch.as_tensor(length if n_valid is None else n_valid, device=cache.lengths.device)
        for start in range(0, length, chunk):
            part = tokens[:, start:start + chunk]
            hidden, features = self.hidden_states(chain_tree(part), cache, feature_layers=feature_layers)
            committed = (n_valid - start).clamp(0, part.shape[1]).to(torch.int32).expand(len(part))
            cache.lengths += committed  # in place: a prepared step or a captured graph reads this buffer
            yield PrefillChunk(start=start, hidden=hidden, features=features, committed=committed)

    @torch.no_grad()
    def verify(self, tree: Tree, cache: KVCache, *, feature_layers=(), static: bool = False,
               prepared: "PreparedVerify | None" = None) -> TargetOutput:
        """Logits at every tree node; the nodes' entries are written, nothing is committed
        (cache.accept(result) keeps the accepted path). static: see step(). prepared: the launches
        prepare_verify made for exactly this tree and cache (a decode step's)."""
        return self.forward(tree, cache, feature_layers=feature_layers, static=static, prepared=prepared)

    def forward(self, tree: Tree, cache: KVCache, *, feature_layers=(), static: bool = False,
                prepared: "PreparedVerify | None" = None) -> TargetOutput:
        hidden, features = self.hidden_states(tree, cache, feature_layers=feature_layers, static=static,
                                              prepared=prepared)
        return TargetOutput(logits=self.logits(hidden), features=features)

    def prepare_verify(self, tree: Tree, cache: KVCache) -> "PreparedVerify":
        """The kernel launches of a verify step over this tree's and this cache's buffers, made once
        (checked, planned, allocated): per layer the verify attention and, for INT4 MoE layers, the
        MoE kernel, where those kernels run for this model (absorbed attention on a bf16/fp16 CUDA
        target, INT4 experts with bf16 tokens); layers they do not run on keep their own path."""
        return PreparedVerify(self, tree.to_torch(self.device), cache)

    def logits(self, hidden) -> torch.Tensor:
        """float32 [..., V]: the final norm and this rank's LM head rows, gathered over the vocabulary."""
        return self.tp.all_gather_last(self.lm_head(self.norm(hidden))).float()

    def hidden_states(self, tree: Tree, cache: KVCache, *, feature_layers=(), static: bool = False,
                      prepared: "PreparedVerify | None" = None):
        """The tree's nodes through every layer: ([B, T, D] before the final norm, features or None)."""
        if self.attention not in ATTENTION_PATHS:
            raise ValueError(f"attention: expected one of {ATTENTION_PATHS}, got {self.attention!r}")
        tree = tree.to_torch(self.device)
        if prepared is not None:
            prepared.check(tree, cache)
        step = self.step(tree, cache, static=static, prepared=prepared)
        x = self.embed_tokens(tree.tokens)                              # (B, T, D)
        outputs = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, step, cache.kv[i], path=self.attention, backend=self.attention_backend, layer=i)
            if i in feature_layers:
                outputs[i] = x
        features = torch.cat([outputs[i] for i in feature_layers], dim=-1) if feature_layers else None
        return x, features

    def step(self, tree: Tree, cache: KVCache, *, static: bool = False,
             prepared: "PreparedVerify | None" = None) -> Step:
        """static=True: fixed shapes and no host synchronisation (what a CUDA graph captures): keys
        span the whole cache and the caller guarantees max(lengths) + T <= L_max. prepared: the
        step's launches (they decided once whether the attention kernel runs)."""
        lengths = cache.lengths
        batch, nodes = tree.tokens.shape
        if static:
            visible = cache.capacity
        else:
            visible = int(lengths.max()) + nodes
            if visible > cache.capacity:
                raise ValueError(f"cache: {nodes} new tokens after {int(lengths.max())} committed exceed "
                                 f"its capacity L_max={cache.capacity}")
        if self.inv_freq.device != self.device:  # once: a graph cannot capture a copy from pageable memory
            self.inv_freq, self.rope_index = self.inv_freq.to(self.device), self.rope_index.to(self.device)
        slots = lengths[:, None] + arange_on(self, nodes, self.device)                          # int64 (B, T)
        angles = (lengths[:, None] + tree.depths)[..., None] * self.inv_freq                     # fp32 (B, T, rope/2)
        rope = rope_table(torch.cos(angles), torch.sin(angles), self.rope_scale, self.embed_tokens.weight.dtype)
        if prepared is not None:
            kernel = prepared.attention[0] is not None
        else:
            kernel = self.attention == "absorbed" and _backend.resolve(
                self.attention_backend, ("torch", "numpy", "cupy"), cache.kv[0], kernel_dtypes=KERNEL_DTYPES) == "cupy"
        mask = None if kernel else key_mask(lengths, tree, visible, device=self.device)
        rows = arange_on(self, batch, self.device)[:, None]
        return Step(tree=tree, lengths=lengths, slots=slots, rope=rope, rope_index=self.rope_index, visible=visible,
                    mask=mask, rows=rows, prepared=prepared)


# ----------------------------------------------------------------------------------------------
# a verify step's launches, prepared once (a Decoder's step; docs/DESIGN.md "The step as built")

class PreparedMoe:
    """One MoE layer's prepared kernel call: the router's tokens, ids and weights are copied into the
    launch's buffers (the dtype conversions a call makes anyway), then the four launches run."""

    def __init__(self, launch, x, routes, weights):
        self.launch, self.x, self.routes, self.weights = launch, x, routes, weights

    def __call__(self, x, ids, weights):
        self.x.copy_(x)
        self.routes.copy_(ids)
        self.weights.copy_(weights)
        return self.launch()


class PreparedVerify:
    """Transformer.prepare_verify's launches for one (tree, cache): attention[i] (a VerifyLaunch over
    layer i's cache, or None where the model's attention does not run the kernel) and moe[i] (a
    PreparedMoe, or None for dense layers and float experts). The layers share one set of query,
    output and work buffers: they run one after another on one stream."""

    def __init__(self, model: "Transformer", tree: Tree, cache: KVCache):
        layers = len(model.layers)
        self.tree_mask, self.cache_kv, self.cache_lengths = tree.mask, list(cache.kv), cache.lengths
        self.attention: list = [None] * layers
        self.moe: list = [None] * layers
        batch, nodes = (int(n) for n in tree.tokens.shape)
        device, dtype = model.device, model.embed_tokens.weight.dtype
        if model.attention == "absorbed" and _backend.resolve(model.attention_backend, ("torch", "numpy", "cupy"),
                                                              cache.kv[0], kernel_dtypes=KERNEL_DTYPES) == "cupy":
            attention = model.layers[0].self_attn
            self.q_latent = torch.empty(batch, nodes, attention.heads, LATENT_DIM, dtype=dtype, device=device)
            self.q_rope = torch.empty(batch, nodes, attention.heads, ROPE_DIM, dtype=dtype, device=device)
            first = prepare_verify_launch(self.q_latent, self.q_rope, cache.kv[0], cache.lengths, tree,
                                          scale=attention.scale)
            self.attention = [first] + [first.with_cache(kv) for kv in cache.kv[1:]]
        moe_layers = [i for i, block in enumerate(model.layers) if isinstance(block.mlp, MoE) and block.mlp.experts.int4]
        if moe_layers and dtype == torch.bfloat16 and device.type == "cuda" and _backend.cuda_available():
            config = model.config
            tokens, top_k = batch * nodes, config.num_experts_per_tok
            x = torch.zeros(tokens, config.hidden_size, dtype=dtype, device=device)
            routes = torch.zeros(tokens, top_k, dtype=torch.int32, device=device)
            weights = torch.zeros(tokens, top_k, dtype=torch.float32, device=device)
            first = prepare_moe_launch(x, routes, weights, model.layers[moe_layers[0]].mlp.experts.int4_experts(),
                                       routed=True)
            for i in moe_layers:
                launch = first.with_experts(model.layers[i].mlp.experts.int4_experts())
                self.moe[i] = PreparedMoe(launch, x, routes, weights)

    def check(self, tree: Tree, cache: KVCache) -> None:
        """A verify handed these launches must pass the buffers they were made for (identity checks,
        no device read): another tree or cache would be read at the prepared addresses."""
        if tree.mask is not self.tree_mask:
            raise ValueError("tree: not the tree these launches were prepared for (Transformer.prepare_verify)")
        if cache.lengths is not self.cache_lengths or len(cache.kv) != len(self.cache_kv) or any(
                a is not b for a, b in zip(cache.kv, self.cache_kv)):
            raise ValueError("cache: not the cache these launches were prepared for (Transformer.prepare_verify)")
