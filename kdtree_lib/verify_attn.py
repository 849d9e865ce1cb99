"""Tree-verify attention for MLA in its weight-absorbed form.

Absorbed MLA is multi-query attention with 576-wide keys and 512-wide values shared by all heads:
per layer the cache holds kv [B, L_max, 576] = [c_kv (512) | k_rope (64)]. A head's query is
q_latent = q_nope · W_UK (512 wide) plus q_rope (64 wide); its output o_latent (512 wide) is
turned back into the head's value space by W_UV. Tree node i of request b (cache slot
lengths[b] + i) attends to every committed token (slots < lengths[b]) and to tree node j iff bit
(i, j) of the ancestor mask is set.

Outputs: o_latent [B, N, H, 512] (the dtype of q_latent) and lse float32 [B, N, H], the natural
log of the softmax denominator over the scaled scores, so partial results can be merged.

The reference is written in torch in fp32 (NumPy inputs go through it on the CPU); the naive
per-head form below is what it must agree with.
"""
from __future__ import annotations

import math

import numpy as np

from . import backend as _backend
from .checks import check_array, check_same_device, framework, to_numpy
from .tree_build import Tree, unpack_mask

LATENT_DIM = 512
ROPE_DIM = 64
CACHE_DIM = LATENT_DIM + ROPE_DIM
# K2.6: softmax scale 1/sqrt(128 + 64) times YaRN's mscale squared, mscale = 1 + 0.1 ln(factor 64)
DEFAULT_SCALE = (128 + 64) ** -0.5 * (1 + 0.1 * math.log(64)) ** 2
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def verify_attention(q_latent, q_rope, cache, lengths, tree: Tree, *, scale: float = DEFAULT_SCALE,
                     backend: str = "auto"):
    """Attention of every tree node over its request's cache and its ancestors: (o_latent, lse)."""
    batch, nodes, heads = _check_args(q_latent, q_rope, cache, lengths, tree, scale)
    chosen = _backend.resolve(backend, ("torch", "numpy", "cupy"), q_latent, cache)
    if chosen == "cupy":
        return _verify_attention_cupy(q_latent, q_rope, cache, lengths, tree, scale)
    torch = _torch()
    as_numpy = framework(q_latent) == "numpy"
    q_latent, q_rope, cache = (_as_torch(x) for x in (q_latent, q_rope, cache))
    allowed = key_mask(lengths, tree, cache.shape[1], device=cache.device)  # (B, N, L)
    kv = cache.float()
    scores = (torch.einsum("bnhc,blc->bnhl", q_latent.float(), kv[..., :LATENT_DIM])
              + torch.einsum("bnhr,blr->bnhl", q_rope.float(), kv[..., LATENT_DIM:])) * scale
    scores = scores.masked_fill(~allowed[:, :, None, :], float("-inf"))  # (B, N, H, L)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bnhl,blc->bnhc", torch.exp(scores - lse[..., None]), kv[..., :LATENT_DIM])
    out = out.to(q_latent.dtype)
    if as_numpy:
        return out.numpy(), lse.numpy()
    return out, lse


def verify_attention_naive(q_nope, q_rope, cache, lengths, tree: Tree, *, w_uk, w_uv,
                           scale: float = DEFAULT_SCALE):
    """The same attention with per-head keys and values (what the absorbed form must equal).

    q_nope [B, N, H, d_nope]; w_uk [H, d_nope, 512] and w_uv [H, d_v, 512] are the two halves of
    kv_b_proj; keys are c_kv·W_UKᵀ ⊕ k_rope, values c_kv·W_UVᵀ. Returns (out [B, N, H, d_v], lse).
    """
    torch = _torch()
    q_nope, q_rope, cache, w_uk, w_uv = (_as_torch(x).float() for x in (q_nope, q_rope, cache, w_uk, w_uv))
    allowed = key_mask(lengths, tree, cache.shape[1], device=cache.device)
    c_kv, k_rope = cache[..., :LATENT_DIM], cache[..., LATENT_DIM:]
    k_nope = torch.einsum("blc,hdc->blhd", c_kv, w_uk)  # (B, L, H, d_nope)
    values = torch.einsum("blc,hdc->blhd", c_kv, w_uv)  # (B, L, H, d_v)
    scores = (torch.einsum("bnhd,blhd->bnhl", q_nope, k_nope)
              + torch.einsum("bnhr,blr->bnhl", q_rope, k_rope)) * scale
    scores = scores.masked_fill(~allowed[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bnhl,blhd->bnhd", torch.exp(scores - lse[..., None]), values)
    return out, lse


def absorb_query(q_nope, w_uk):
    """q_latent = q_nope · W_UK per head: [B, N, H, d_nope] x [H, d_nope, 512] -> [B, N, H, 512]."""
    return _torch().einsum("bnhd,hdc->bnhc", q_nope, w_uk)


def project_output(o_latent, w_uv):
    """A head's value-space output from its latent output: o_latent · W_UVᵀ -> [B, N, H, d_v]."""
    return _torch().einsum("bnhc,hdc->bnhd", o_latent, w_uv)


def key_mask(lengths, tree: Tree, slots: int, *, device=None):
    """bool [B, N, slots]: may tree node i attend to cache slot l (committed prefix or ancestor)?"""
    torch = _torch()
    lengths = torch.as_tensor(to_numpy(lengths).astype(np.int64), device=device)
    nodes = tree.capacity
    ancestors = torch.as_tensor(unpack_mask(tree.mask, nodes), device=device)  # (B, N, N)
    slot = torch.arange(slots, device=device)
    allowed = (slot[None, :] < lengths[:, None])[:, None, :].repeat(1, nodes, 1)  # (B, N, L)
    tree_slots = (lengths[:, None] + torch.arange(nodes, device=device))[:, None, :].expand(-1, nodes, -1)
    return allowed.scatter(2, tree_slots, ancestors)


def _check_args(q_latent, q_rope, cache, lengths, tree, scale):
    check_array("q_latent", q_latent, dtypes=FLOAT_DTYPES, shape=(None, None, None, LATENT_DIM))
    batch, nodes, heads, _ = q_latent.shape
    dtype = str(q_latent.dtype).removeprefix("torch.")
    check_array("q_rope", q_rope, dtypes=dtype, shape=(batch, nodes, heads, ROPE_DIM))
    check_array("cache", cache, dtypes=dtype, shape=(batch, None, CACHE_DIM))
    check_array("lengths", lengths, dtypes=("int32", "int64"), shape=(batch,))
    if not isinstance(tree, Tree):
        raise ValueError(f"tree: expected a Tree, got {type(tree).__name__}")
    if (tree.batch, tree.capacity) != (batch, nodes):
        raise ValueError(f"tree: expected batch {batch} and {nodes} nodes (as q_latent), "
                         f"got batch {tree.batch} and {tree.capacity} nodes")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: expected a positive finite number, got {scale!r}")
    check_same_device(q_latent=q_latent, q_rope=q_rope, cache=cache, lengths=lengths,
                      **{"tree.mask": tree.mask})
    if framework(lengths) != "cupy" and not (framework(lengths) == "torch" and lengths.is_cuda):
        host_lengths = to_numpy(lengths)
        if (host_lengths < 0).any() or (host_lengths + nodes > cache.shape[1]).any():
            raise ValueError(f"lengths: each must be >= 0 with lengths + {nodes} tree nodes "
                             f"<= L_max={cache.shape[1]}")
    return batch, nodes, heads


def _as_torch(x):
    torch = _torch()
    if framework(x) == "torch":
        return x
    if framework(x) == "cupy":
        return torch.as_tensor(x, device="cuda")
    return torch.from_numpy(np.ascontiguousarray(x))


def _torch():
    import torch
    return torch
