"""DFlash: the block-diffusion draft model, in the z-lab checkpoint format.

One forward drafts a whole block. The block is [bonus, mask, ..., mask] (block_size tokens): the
bonus is the last token the target committed, the masks stand for the D = block_size - 1 tokens
to guess, and block position k's output predicts the token k places after the bonus. Inside the
block attention is bidirectional; every block position also attends to the context, which is the
target's own hidden states of the committed tokens:

    features [T, len(target_layer_ids) * D]   the target's layer outputs, concatenated
      -> fc -> hidden_norm                     one D-wide vector per committed token
      -> per layer: k_proj / v_proj (+ k_norm, RoPE at the token's position)
                                                extra keys and values in front of the block's own

The drafter has no embedding and no LM head: the block's tokens go through the target's
embedding, and the drafter's final `norm` output goes through the target's `lm_head`. Layers are
Qwen3's (q/k RMSNorm per head, GQA, SwiGLU). Weight names and config keys are z-lab's
(`fc`, `hidden_norm`, `layers.N.self_attn.q_proj`, ..., `norm`; `block_size`, and `mask_token_id`,
`target_layer_ids` at the top level or under `dflash_config`), so a real DFlash checkpoint loads.
RoPE (default or YaRN) and the config keys: config.py.

The context keys and values live in a cache that holds committed tokens only: each round appends
the features of the tokens the target just accepted and the block's own keys are never stored, so
the cache is back at the committed length after every round (z-lab's "crop to start").

Shapes: B requests, T new context tokens, L cache slots, Q = block_size, D hidden, F feature width,
H query heads, G key/value heads, d head_dim, V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..model.model import RMSNorm, arange_on, made_once, rotate, yarn_inv_freq
from ..model.tp import TensorParallel
from .config import DFlashConfig


# ----------------------------------------------------------------------------------------------
# modules (Qwen3's layers; attention takes the context's keys and values from outside)

def rope_index(dim: int) -> torch.Tensor:
    """int64 [2d]: where `rotate` (model.model) reads x [..., d] from, as [x | x2 | x1] with x1, x2 its
    halves: x cos + rotate_half(x) sin, rotate_half(x) = [-x2 | x1], with the table of DFlashDrafter._rope."""
    half = dim // 2
    steps = torch.arange(dim, device="cpu")  # cpu even when built on meta
    return torch.cat([steps, steps[half:], steps[:half]])


# ----------------------------------------------------------------------------------------------
# split-KV attention: a few queries (one block) over a long context

KEY_CHUNK = 512          # context keys per split; caches of SPLIT_MIN_KEYS slots or more hold whole chunks
SPLIT_MIN_KEYS = 2048    # context length from which the split path replaces one SDPA call
SPLIT_MAX_QUERIES = 64   # query positions up to which it does (a drafted block, not training's many blocks)


def uses_split_kv(context_len: int, queries: int) -> bool:
    """Whether Attention takes the split path for `context_len` context keys and `queries` positions."""
    return context_len >= SPLIT_MIN_KEYS and context_len % KEY_CHUNK == 0 and queries <= SPLIT_MAX_QUERIES


def chunk_aligned(slots: int) -> int:
    """`slots` rounded up to whole key chunks where the split path runs (SPLIT_MIN_KEYS or more)."""
    return -(-slots // KEY_CHUNK) * KEY_CHUNK if slots >= SPLIT_MIN_KEYS else slots


def split_kv_attention(q, context_k, context_v, own_k, own_v, visible):
    """Softmax attention of q (B, G, R, d) over [context (B, G, C, d) ; own block (B, G, Q, d)] where
    visible (B, 1, Q, C + Q) bool, R = (H/G)·Q rows (head-major), C a multiple of KEY_CHUNK: what
    scaled_dot_product_attention computes on the concatenated keys with the mask repeated per head.

    SDPA runs one CTA per (request, key/value head) on this shape and walks the whole context in
    it. Here the context is cut into C / KEY_CHUNK chunks (views of the cache when it holds exactly
    C slots), all scored by one batched matmul; each chunk gives its unnormalised output with its
    float32 softmax statistics, the own block is one more piece, and a log-sum-exp merge combines
    them exactly. Fixed shapes, no host synchronisation: a CUDA graph captures it."""
    queries = own_k.shape[2]
    chunks = context_k.shape[2] // KEY_CHUNK
    q = (q * q.shape[-1] ** -0.5)[:, :, None]                                  # (B, G, 1, R, d)
    context_visible = visible[..., :-queries].unflatten(-1, (chunks, KEY_CHUNK)).transpose(2, 3)  # (B, 1, n, Q, c)
    pieces = [_attention_piece(q, context_k.unflatten(2, (chunks, KEY_CHUNK)),
                               context_v.unflatten(2, (chunks, KEY_CHUNK)), context_visible),
              _attention_piece(q, own_k[:, :, None], own_v[:, :, None], visible[:, :, None, :, -queries:])]
    out, top, total = (torch.cat(parts, dim=2) for parts in zip(*pieces))      # (B, G, n + 1, R, d or 1)
    lse = torch.logsumexp(top + total.log(), dim=2, keepdim=True)              # (B, G, 1, R, 1)
    return (out.float() * torch.exp(top - lse)).sum(2).to(q.dtype)             # (B, G, R, d)


def _attention_piece(q, k, v, visible):
    """q (B, G, 1, R, d), pre-scaled, on keys/values (B, G, n, c, d) where visible (B, 1, n, Q, c):
    per chunk sum_j exp(s_j - m) v_j (B, G, n, R, d), the stabiliser m and sum_j exp(s_j - m)
    (B, G, n, R, 1) in float32. A chunk that shows a row nothing gets a finite m and a zero sum."""
    scores = torch.matmul(q, k.transpose(-1, -2))                              # (B, G, n, R, c)
    scores.unflatten(3, (-1, visible.shape[3])).masked_fill_(~visible[:, :, :, None], float("-inf"))
    top = scores.detach().amax(-1, keepdim=True).clamp_min_(torch.finfo(scores.dtype).min)  # (B, G, n, R, 1)
    probs = scores.sub_(top).exp_()
    return torch.matmul(probs, v), top.float(), probs.sum(-1, keepdim=True, dtype=torch.float32)


def sharded_linear(in_features: int, out_features: int, bias: bool, tp_dim: int | None) -> nn.Linear:
    """nn.Linear marked with the dimension its checkpoint weight is split along (None: whole)."""
    layer = nn.Linear(in_features, out_features, bias=bias)
    layer.tp_dim = tp_dim
    return layer


class Attention(nn.Module):
    """Qwen3 attention over [context ; block]; with a TensorParallel of size > 1 this rank holds
    1/tp of the query and key/value heads and returns its partial o_proj sum."""

    def __init__(self, c: DFlashConfig, tp: TensorParallel):
        super().__init__()
        tp.split(c.num_key_value_heads, "num_key_value_heads")
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads // tp.size, c.num_key_value_heads // tp.size, c.head_dim
        self.q_proj = sharded_linear(c.hidden_size, self.heads * c.head_dim, c.attention_bias, 0)
        self.k_proj = sharded_linear(c.hidden_size, self.kv_heads * c.head_dim, c.attention_bias, 0)
        self.v_proj = sharded_linear(c.hidden_size, self.kv_heads * c.head_dim, c.attention_bias, 0)
        self.o_proj = sharded_linear(self.heads * c.head_dim, c.hidden_size, c.attention_bias, 1)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def key_value(self, x, rope):
        """Keys (normed, rotated) and values of x (B, N, D): two (B, G, N, d); rope: (table (B, N, 2d),
        index), DFlashDrafter._rope's."""
        table, index = rope
        k, v = self.unrotated_key_value(x)
        return rotate(k, table[:, :, None], index).transpose(1, 2), v

    def unrotated_key_value(self, x):
        """Keys normed, not yet rotated, (B, N, G, d), and values (B, G, N, d) of x (B, N, D)."""
        batch, n = x.shape[:2]
        k = self.k_norm(self.k_proj(x).view(batch, n, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(batch, n, self.kv_heads, self.head_dim).transpose(1, 2)
        return k, v

    def attention_mask(self, mask, context_len: int, queries: int, dtype):
        """The form of a block's mask (B, 1, Q, C + Q) forward takes, made once per step: as is on the
        split path; else its rows repeated per query head of a key/value head (SDPA's query rows), as
        the additive mask SDPA makes of a boolean one (0 visible, -inf not, in the queries' `dtype`)."""
        if mask is None or uses_split_kv(context_len, queries):
            return mask
        additive = torch.zeros_like(mask, dtype=dtype).masked_fill_(~mask, float("-inf"))
        return additive.repeat(1, 1, self.heads // self.kv_heads, 1)           # (B, 1, (H/G)·Q, C + Q)

    def forward(self, x, context_k, context_v, rope, mask):
        """x (B, Q, D) attends to [context keys (B, G, C, d) ; its own keys]; rope: as key_value's; mask:
        attention_mask's form of (B, 1, Q, C + Q), or None."""
        batch, n = x.shape[:2]
        table, index = rope
        q = self.q_norm(self.q_proj(x).view(batch, n, self.heads, self.head_dim))
        k, own_v = self.unrotated_key_value(x)                                 # (B, Q, G, d), (B, G, Q, d)
        # queries and the block's own keys rotated together (one gather, product and sum for both), stored
        # head-major outside training (out= has no gradient): the GQA reshape below is then a view
        both = torch.cat([q, k], dim=2)                                        # (B, Q, H + G, d)
        head_major = None if both.requires_grad else both.new_empty(batch, self.heads + self.kv_heads, n,
                                                                     self.head_dim).transpose(1, 2)
        rotated = rotate(both, table[:, :, None], index, out=head_major).transpose(1, 2)
        q, own_k = rotated.split([self.heads, self.kv_heads], dim=1)           # (B, H, Q, d), (B, G, Q, d)
        # GQA: the H / G query heads of one key/value head become rows of its query block, so each
        # key is read once (enable_gqa with a mask falls back to a path that repeats the keys)
        group = self.heads // self.kv_heads
        q = q.reshape(batch, self.kv_heads, group * n, self.head_dim)          # (B, G, (H/G)·Q, d)
        if mask is not None and uses_split_kv(context_k.shape[2], n):
            out = split_kv_attention(q, context_k, context_v, own_k, own_v, mask)
        else:
            k = torch.cat([context_k, own_k], dim=2)                           # (B, G, C + Q, d)
            v = torch.cat([context_v, own_v], dim=2)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)      # (B, G, (H/G)·Q, d)
        out = out.reshape(batch, self.heads, n, self.head_dim)                 # (B, H, Q, d)
        return self.o_proj(out.transpose(1, 2).reshape(batch, n, -1))          # (B, Q, D)


class MLP(nn.Module):
    """SwiGLU; 1/tp of its width on this rank (a partial down_proj sum)."""

    def __init__(self, c: DFlashConfig, tp: TensorParallel):
        super().__init__()
        start, stop = tp.split(c.intermediate_size, "intermediate_size")
        self.gate_proj = sharded_linear(c.hidden_size, stop - start, False, 0)
        self.up_proj = sharded_linear(c.hidden_size, stop - start, False, 0)
        self.down_proj = sharded_linear(stop - start, c.hidden_size, False, 1)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: DFlashConfig, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.self_attn = Attention(c, tp)
        self.mlp = MLP(c, tp)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, context_k, context_v, rope, mask):
        attention = self.self_attn(self.input_layernorm(x), context_k, context_v, rope, mask)
        h, x = self.post_attention_layernorm.add_forward(self.tp.all_reduce(attention), x)  # x += attention
        return x + self.tp.all_reduce(self.mlp(h))


# ----------------------------------------------------------------------------------------------
# the target's pieces the drafter borrows

@dataclass
class TargetHead:
    """The target's token embedding and LM head (not owned: never saved with the drafter)."""
    embed: Callable[[torch.Tensor], torch.Tensor]    # ids (...) -> (..., D)
    lm_head: Callable[[torch.Tensor], torch.Tensor]  # (..., D) -> (..., V)
    weight: torch.Tensor                             # the embedding matrix: device and dtype

    @classmethod
    def of(cls, target) -> "TargetHead":
        """From kdtree_lib.model's Transformer (embed_tokens, lm_head, tp) or a transformers causal LM."""
        embed = getattr(target, "embed_tokens", None)
        if embed is None and hasattr(target, "get_input_embeddings"):
            embed = target.get_input_embeddings()
        lm_head = getattr(target, "lm_head", None)
        if embed is None or lm_head is None:
            raise ValueError(f"target: {type(target).__name__} has no embed_tokens / lm_head")
        tp = getattr(target, "tp", None)
        head = (lambda h: tp.all_gather_last(lm_head(h))) if tp is not None else lm_head
        return cls(embed=embed, lm_head=head, weight=embed.weight)


# ----------------------------------------------------------------------------------------------
# the drafter

@dataclass
class DFlashCache:
    """Context keys/values of the committed tokens: per layer (B, G, S, d), and lengths int64 [B].
    A request holds up to `capacity` tokens; the storage S rounds a long cache (SPLIT_MIN_KEYS slots
    or more) up to whole key chunks, so the split-KV attention reads it as views."""
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: torch.Tensor
    capacity: int

    @property
    def slots(self) -> int:
        """S: the storage's slots."""
        return int(self.keys[0].shape[2])

    def attended_slots(self, static: bool) -> int:
        """The slots a block attends over (the rest are empty): all of them with static=True (fixed
        shapes), else the longest request's, rounded up to whole chunks where the split path runs."""
        return self.slots if static else chunk_aligned(int(self.lengths.max()))

    def crop(self, lengths) -> None:
        """Roll back to `lengths` committed tokens (entries past them are ignored, then overwritten)."""
        lengths = torch.as_tensor(lengths, device=self.lengths.device).long()
        self.lengths = torch.minimum(self.lengths, lengths.expand_as(self.lengths))


class DFlashDrafter(nn.Module):
    """The draft model's own weights; bind(target) attaches the target's embedding and LM head.

    tp: a TensorParallel of size > 1 shards the layers (heads, key/value heads and MLP width 1/tp,
    two all-reduces per layer; fc and the norms whole); the default holds the whole drafter."""

    def __init__(self, config: DFlashConfig, tp: TensorParallel = TensorParallel()):
        super().__init__()
        if config.attention_bias and tp.size > 1:
            raise ValueError("attention_bias: a TP-sharded drafter with biased projections is not implemented")
        self.config, self.tp = config, tp
        self.fc = nn.Linear(config.feature_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(config, tp) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.target: TargetHead | None = None
        self.inv_freq = (config.yarn.inv_freq(config.head_dim, config.rope_theta) if config.yarn else
                         yarn_inv_freq(config.head_dim, config.rope_theta))  # float32 [d/2]
        self.rope_index = rope_index(config.head_dim)

    def bind(self, target) -> "DFlashDrafter":
        head = target if isinstance(target, TargetHead) else TargetHead.of(target)
        if head.weight.shape[-1] != self.config.hidden_size:
            raise ValueError(f"target: embedding {tuple(head.weight.shape)} does not fit the drafter's "
                             f"hidden_size={self.config.hidden_size}")
        self.target = head
        return self

    def init_weights(self, std: float = 0.02) -> None:
        """Fresh weights for training: normal(std) projections, unit norms."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    # ------------------------------------------------------------------------------------------
    def _rope(self, positions):
        """(table (B, N, 2d), index): `rotate`'s RoPE at integer positions (B, N), made once per
        step for every layer: cos and sin of the angles over the full head_dim (rotate_half's layout),
        in float32, times YaRN's attention factor, as [cos | -sin (first half) | sin (second half)]."""
        c = self.config
        if self.inv_freq.device != positions.device:  # once: a graph cannot capture a host copy
            self.inv_freq, self.rope_index = self.inv_freq.to(positions.device), self.rope_index.to(positions.device)
        angles = positions[..., None] * self.inv_freq                          # float32 (B, N, d/2)
        angles = torch.cat([angles, angles], dim=-1)
        half = c.head_dim // 2
        cos, sin = angles.cos(), angles.sin()
        table = torch.cat([cos, -sin[..., :half], sin[..., half:]], dim=-1)
        scale = c.yarn.attention_factor if c.yarn else 1.0
        return (table if scale == 1 else table * scale).to(self.fc.weight.dtype), self.rope_index

    def _head(self):
        if self.target is None:
            raise ValueError("drafter: not bound to a target (call bind(target) or load_drafter(path, target))")
        return self.target

    def _mask(self, visible, query_pos, key_pos, layer):
        """Add causality and the sliding window (by position) to a base visibility (B, Q, K)."""
        window = self.config.window(layer)
        if not self.config.is_causal and window is None:
            return visible[:, None]                                            # (B, 1, Q, K)
        diff = query_pos[:, :, None] - key_pos[:, None, :]                     # (B, Q, K)
        if self.config.is_causal:
            visible = visible & (diff >= 0)
        if window is not None:
            near = diff < window
            if not self.config.is_causal:
                near &= -diff < window
            visible = visible & near
        return visible[:, None]                                                # (B, 1, Q, K)

    def _run_layers(self, x, query_pos, context_kv, key_pos, visible):
        """x (B, Q, D) through every layer; context_kv(layer, i) -> (k, v) (B, G, C, d). The RoPE
        table and each distinct mask (per sliding window) are made once, for all layers."""
        rope = self._rope(query_pos)
        masks = {}
        for i, layer in enumerate(self.layers):
            context_k, context_v = context_kv(layer, i)
            window = self.config.window(i)
            if window not in masks:
                masks[window] = layer.self_attn.attention_mask(self._mask(visible, query_pos, key_pos, i),
                                                               context_k.shape[2], x.shape[1], x.dtype)
            x = layer(x, context_k, context_v, rope, masks[window])
        return self.norm(x)

    # ------------------------------------------------------------------------------------------
    # decoding: one block per request, context from the cache

    def new_cache(self, batch: int, capacity: int) -> DFlashCache:
        c, weight = self.config, self.fc.weight
        shape = (batch, c.num_key_value_heads // self.tp.size, chunk_aligned(capacity), c.head_dim)
        return DFlashCache(keys=[weight.new_zeros(shape) for _ in self.layers],
                           values=[weight.new_zeros(shape) for _ in self.layers],
                           lengths=torch.zeros(batch, dtype=torch.long, device=weight.device), capacity=capacity)

    @torch.no_grad()
    def extend(self, cache: DFlashCache, features, n_new=None, *, static: bool = False) -> None:
        """Append the newly committed tokens' context keys and values to the cache.

        features (B, T, F): the target features of each request's next committed tokens (those at
        positions lengths[b] ... lengths[b] + n_new[b] - 1; rows past n_new[b] are ignored);
        n_new int [B] (default T for every request); T may be 0. static: no checks (no host
        synchronisation); the caller guarantees n_new and capacity.
        """
        c = self.config
        batch, count, width = features.shape
        if width != c.feature_size or batch != cache.lengths.shape[0]:
            raise ValueError(f"features: expected (B={cache.lengths.shape[0]}, T, F={c.feature_size}), "
                             f"got {tuple(features.shape)}")
        device = cache.lengths.device
        n_new = torch.full((batch,), count, device=device) if n_new is None else torch.as_tensor(n_new, device=device)
        if not static:
            if bool(((n_new < 0) | (n_new > count)).any()):
                raise ValueError(f"n_new: expected values in 0..T={count}, got {n_new.tolist()}")
            end = int(cache.lengths.max()) + count
            if end > cache.capacity:
                raise ValueError(f"cache: {end} slots needed, capacity {cache.capacity}")
        slots = cache.lengths[:, None] + arange_on(self, count, device)         # (B, T)
        context = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))  # (B, T, D)
        table, rope_index = self._rope(slots)
        index = slots[:, None, :, None].expand(-1, cache.keys[0].shape[1], -1, c.head_dim)
        projected = [layer.self_attn.unrotated_key_value(context) for layer in self.layers]
        # every layer's keys rotated together (Attention.key_value's rotation): one gather, product and sum
        keys = [k for k, _ in projected]
        keys = rotate(keys[0] if len(keys) == 1 else torch.cat(keys, dim=2), table[:, :, None], rope_index)
        for i, (k, (_, v)) in enumerate(zip(keys.split(projected[0][0].shape[2], dim=2), projected)):
            cache.keys[i].scatter_(2, index, k.transpose(1, 2))                # (B, G, T, d)
            cache.values[i].scatter_(2, index, v)
        cache.lengths += n_new.long()  # in place: a prepared step or a captured graph reads this buffer

    @torch.no_grad()
    def draft(self, cache: DFlashCache, features, bonus, n_new=None, *, static: bool = False, out=None):
        """Append the newly committed tokens' features (extend), then draft the block after `bonus`.

        features, n_new, static: as extend; bonus int [B]: the token at position lengths[b] +
        n_new[b], not yet run by the target. static=True: fixed shapes and no host synchronisation
        (what a CUDA graph captures): the block attends over the whole cache storage.
        Returns float32 logits (B, D, V) for the D = block_size - 1 positions after the bonus (into
        `out` when given: a decode step's prepared top-k reads that buffer).
        """
        c = self.config
        head = self._head()
        self.extend(cache, features, n_new, static=static)
        batch, device = features.shape[0], cache.lengths.device
        visible_slots = cache.attended_slots(static)
        key_slot = arange_on(self, visible_slots, device)
        block_pos = cache.lengths[:, None] + arange_on(self, c.block_size, device)         # (B, Q)
        # key positions matter only to causal or windowed layers (_mask)
        key_pos = torch.cat([key_slot.expand(batch, -1), block_pos], dim=1) if c.positional_mask else None
        own = made_once(self, "_own_block", (batch, c.block_size, device),                 # (B, Q, Q) all visible
                        lambda: torch.ones(batch, c.block_size, c.block_size, dtype=torch.bool, device=device))
        visible = torch.cat([(key_slot[None, :] < cache.lengths[:, None])[:, None, :].expand(-1, c.block_size, -1),
                             own], dim=2)                                                   # (B, Q, L' + Q)
        masks = made_once(self, "_mask_tokens", (batch, c.block_size, device), lambda: torch.full(
            (batch, c.block_size - 1), c.mask_token_id, dtype=torch.long, device=device))    # (B, Q - 1)
        block = torch.cat([torch.as_tensor(bonus, device=device).long()[:, None], masks], dim=1)  # [bonus, mask, ...]
        x = head.embed(block).to(self.fc.weight.dtype)                                    # (B, Q, D)
        hidden = self._run_layers(
            x, block_pos,
            lambda layer, i: (cache.keys[i][:, :, :visible_slots], cache.values[i][:, :, :visible_slots]),
            key_pos, visible)
        logits = head.lm_head(hidden[:, 1:])                                               # (B, D, V)
        return logits.float() if out is None else out.copy_(logits)

    # ------------------------------------------------------------------------------------------
    # training: many blocks per sequence, each seeing only the context before its anchor

    def forward_blocks(self, features, tokens, anchors):
        """The drafter's final hidden states for blocks at `anchors`, as DFlash is trained.

        features (B, S, F): target features of the whole sequence; tokens int (B, S);
        anchors int (B, N): block n is [tokens[anchor], mask, ...] at positions anchor + k and sees
        the context strictly before its anchor, its own block bidirectionally, no other block.
        Returns (B, N, Q, D); position k (k >= 1) is trained to predict tokens[anchor + k].
        """
        c = self.config
        head = self._head()
        batch, length, _ = features.shape
        n_blocks = anchors.shape[1]
        device = tokens.device
        offsets = torch.arange(c.block_size, device=device)
        block_pos = (anchors[:, :, None] + offsets).reshape(batch, -1)                     # (B, N*Q)
        block = torch.full((batch, n_blocks, c.block_size), c.mask_token_id, dtype=torch.long, device=device)
        block[:, :, 0] = tokens.gather(1, anchors)
        x = head.embed(block.reshape(batch, -1)).to(self.fc.weight.dtype)                  # (B, N*Q, D)

        context = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))            # (B, S, D)
        context_pos = torch.arange(length, device=device).expand(batch, -1)
        rope = self._rope(context_pos)
        block_id = torch.arange(n_blocks, device=device).repeat_interleave(c.block_size)   # (N*Q,)
        sees_context = context_pos[:, None, :] < anchors.repeat_interleave(c.block_size, dim=1)[:, :, None]
        same_block = (block_id[:, None] == block_id[None, :]).expand(batch, -1, -1)
        visible = torch.cat([sees_context, same_block], dim=2)                             # (B, N*Q, S + N*Q)
        key_pos = torch.cat([context_pos, block_pos], dim=1)
        hidden = self._run_layers(x, block_pos,
                                  lambda layer, i: layer.self_attn.key_value(context, rope),
                                  key_pos, visible)
        return hidden.view(batch, n_blocks, c.block_size, -1)

    def logits(self, hidden):
        """The target's LM head on the drafter's hidden states."""
        return self._head().lm_head(hidden)


# ----------------------------------------------------------------------------------------------
# target features

def hf_features(hidden_states, layer_ids) -> torch.Tensor:
    """Concatenate transformers' output_hidden_states (embeddings first) at `layer_ids`: (B, T, F)."""
    if max(layer_ids) >= len(hidden_states) - 2:
        raise ValueError(f"layer_ids: {list(layer_ids)} include the last layer, whose transformers "
                         "hidden state is taken after the final norm")
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)
