"""The rewrites that cut an eager decode step's torch ops (issue 30; counted by bench.op_counts) give the
same bits as the formulations they replaced: each replaced formulation is written out here as it was
and compared with torch.equal on random inputs, float32 and bfloat16, on the CPU and (-m gpu) the GPU."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kdtree_lib.decode import Decoder
from kdtree_lib.dflash import DFlashConfig, DFlashDrafter
from kdtree_lib.dflash.model import split_kv_attention, uses_split_kv
from kdtree_lib.model import ModelConfig, TensorParallel
from kdtree_lib.model.model import (Experts, Router, combine_slots, VocabParallelEmbedding, rope_index, rope_table, rotate,
                                    yarn_inv_freq)
from kdtree_lib.model.config import tiny_config
from kdtree_lib.pairs import random_pair

DTYPES = (torch.float32, torch.bfloat16)
DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.gpu))


def randn(*shape, seed, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


# ----------------------------------------------------------------------------------------------
# RoPE: the target's per-step table and three-op rotation

def replaced_target_rope(x, cos, sin, interleave: bool):
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", (True, False))
@pytest.mark.parametrize("scale", (1.0, 1.3466))
@pytest.mark.parametrize("device", DEVICES)
def test_the_target_rope_table_and_rotation_equal_the_per_layer_formula(dtype, interleave, scale, device):
    batch, nodes, heads, rope = 3, 9, 4, 64
    positions = torch.randint(0, 70000, (batch, nodes), generator=torch.Generator().manual_seed(1),
                              dtype=torch.int32).to(device)
    depths = torch.randint(0, 9, (batch, nodes), generator=torch.Generator().manual_seed(2),
                           dtype=torch.int32).to(device)
    inv_freq = yarn_inv_freq(rope, 50000.0, 64.0, 4096).to(device)
    angles = (positions + depths).float()[..., None] * inv_freq                          # as the step made them
    cos, sin = ((f(angles) * scale).to(dtype) for f in (torch.cos, torch.sin))
    table = rope_table(torch.cos((positions + depths)[..., None] * inv_freq),
                       torch.sin((positions + depths)[..., None] * inv_freq), scale, dtype)
    index = rope_index(rope, interleave).to(device)
    q = randn(batch, nodes, heads, 192, seed=3, dtype=dtype, device=device)[..., 128:]  # a strided slice, as in MLA
    k = randn(batch, nodes, rope, seed=4, dtype=dtype, device=device)
    want_q = replaced_target_rope(q, cos[:, :, None], sin[:, :, None], interleave)
    assert torch.equal(rotate(q, table[:, :, None], index), want_q)
    assert torch.equal(rotate(k, table, index), replaced_target_rope(k, cos, sin, interleave))
    out = torch.full((batch, nodes, heads, rope), float("nan"), dtype=dtype, device=device)  # a launch's buffer
    assert rotate(q, table[:, :, None], index, out=out) is out and torch.equal(out, want_q)


def test_the_target_step_holds_the_table_of_its_positions():
    target, _ = random_pair(vocab=48)
    cache = target.new_cache(2, 40)
    cache.lengths.copy_(torch.tensor([5, 17], dtype=torch.int32))
    from kdtree_lib.model.model import chain_tree
    step = target.step(chain_tree(torch.arange(12).view(2, 6)), cache, static=True)
    positions = (cache.lengths[:, None] + torch.arange(6)).float()[..., None] * target.inv_freq
    cos, sin = ((f(positions) * target.rope_scale).to(torch.float32) for f in (torch.cos, torch.sin))
    assert torch.equal(step.rope, torch.cat([cos, cos, -sin, sin], dim=-1))
    assert torch.equal(step.slots, cache.lengths[:, None].long() + torch.arange(6))
    assert torch.equal(step.rows, torch.arange(2)[:, None])


# ----------------------------------------------------------------------------------------------
# RoPE: the drafter's table and rotation (queries and own keys together)

def replaced_drafter_rope(drafter, positions):
    c = drafter.config
    angles = positions.float()[..., None] * drafter.inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    scale = c.yarn.attention_factor if c.yarn else 1.0
    dtype = drafter.fc.weight.dtype
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def replaced_apply_rope(x, cos, sin):                                     # x (B, heads, N, d)
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("yarn", (None, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}))
@pytest.mark.parametrize("device", DEVICES)
def test_the_drafter_rope_equals_rotate_half(dtype, yarn, device):
    raw = {"architectures": ["DFlashDraftModel"], "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 40, "block_size": 4,
           "mask_token_id": 39, "target_layer_ids": [1], "rope_theta": 10000.0, "rope_scaling": yarn}
    config = DFlashConfig.from_dict(raw)
    assert config.yarn is None if yarn is None else config.yarn.attention_factor != 1
    drafter = DFlashDrafter(config).to(device=device, dtype=dtype)
    positions = torch.randint(0, 9000, (2, 7), generator=torch.Generator().manual_seed(5)).to(device)
    table, index = drafter._rope(positions)                                   # moves inv_freq to the device
    cos, sin = replaced_drafter_rope(drafter, positions)
    q, k = (randn(2, 7, heads, 16, seed=seed, dtype=dtype, device=device) for heads, seed in ((4, 6), (2, 7)))
    both = rotate(torch.cat([q, k], dim=2), table[:, :, None], index)
    assert torch.equal(both[:, :, :4].transpose(1, 2), replaced_apply_rope(q.transpose(1, 2), cos, sin))
    assert torch.equal(both[:, :, 4:].transpose(1, 2), replaced_apply_rope(k.transpose(1, 2), cos, sin))
    assert torch.equal(rotate(k, table[:, :, None], index), both[:, :, 4:])


def replaced_attention(a, x, context_k, context_v, cos, sin, mask):
    batch, n = x.shape[:2]
    q = a.q_norm(a.q_proj(x).view(batch, n, a.heads, a.head_dim)).transpose(1, 2)
    q = replaced_apply_rope(q, cos, sin)
    own_k = replaced_apply_rope(a.k_norm(a.k_proj(x).view(batch, n, a.kv_heads, a.head_dim)).transpose(1, 2), cos, sin)
    own_v = a.v_proj(x).view(batch, n, a.kv_heads, a.head_dim).transpose(1, 2)
    group = a.heads // a.kv_heads
    q = q.reshape(batch, a.kv_heads, group * n, a.head_dim)
    if mask is not None and uses_split_kv(context_k.shape[2], n):
        out = split_kv_attention(q, context_k, context_v, own_k, own_v, mask)
    else:
        k, v = torch.cat([context_k, own_k], dim=2), torch.cat([context_v, own_v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.repeat(1, 1, group, 1))
    out = out.reshape(batch, a.heads, n, a.head_dim)
    return a.o_proj(out.transpose(1, 2).reshape(batch, n, -1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("context", (40, 2048))                                   # SDPA; the split path
@pytest.mark.parametrize("device", DEVICES)
def test_the_drafter_attention_equals_its_per_layer_form(dtype, context, device):
    """At the stand-in drafter's attention shape (4 query heads, 2 key/value heads of 64): on a GPU the
    attention backend SDPA picks depends on it."""
    config = DFlashConfig(hidden_size=256, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64, vocab_size=64, block_size=8, mask_token_id=63,
                          target_layer_ids=(1,), num_target_layers=3)
    torch.manual_seed(54)
    drafter = DFlashDrafter(config)
    drafter.init_weights(0.05)
    drafter = drafter.to(device=device, dtype=dtype)
    attention = drafter.layers[0].self_attn
    x = randn(2, 8, config.hidden_size, seed=50, dtype=dtype, device=device)
    context_k, context_v = (randn(2, attention.kv_heads, context, 64, seed=s, dtype=dtype, device=device)
                            for s in (51, 52))
    mask = (torch.rand(2, 1, 8, context + 8, generator=torch.Generator().manual_seed(53)) > 0.2).to(device)
    positions = torch.tensor([[30, 31, 32, 33, 34, 35, 36, 37], [5, 6, 7, 8, 9, 10, 11, 12]], device=device)
    rope = drafter._rope(positions)
    cos, sin = replaced_drafter_rope(drafter, positions)
    got = attention(x, context_k, context_v, rope, attention.attention_mask(mask, context, 8, dtype))
    assert torch.equal(got, replaced_attention(attention, x, context_k, context_v, cos, sin, mask))


@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_rotates_every_layers_keys_as_key_value_does(dtype):
    _, drafter = random_pair(vocab=48, dtype=dtype)
    drafter.layers.append(type(drafter.layers[0])(drafter.config, drafter.tp).to(dtype))   # two layers
    with torch.no_grad():
        for i, weight in enumerate(drafter.layers[1].parameters()):
            weight.copy_(0.2 * randn(*weight.shape, seed=30 + i))
    cache = drafter.new_cache(2, 24)
    cache.lengths.copy_(torch.tensor([3, 9]))
    features = randn(2, 5, drafter.config.feature_size, seed=40, dtype=dtype)
    drafter.extend(cache, features, static=True)
    slots = torch.tensor([3, 9])[:, None] + torch.arange(5)
    context = drafter.hidden_norm(drafter.fc(features))
    rope = drafter._rope(slots)
    for i, layer in enumerate(drafter.layers):
        k, v = layer.self_attn.key_value(context, rope)                              # (B, G, T, d)
        for b in range(2):
            assert torch.equal(cache.keys[i][b, :, slots[b]], k[b])
            assert torch.equal(cache.values[i][b, :, slots[b]], v[b])


def test_the_drafter_mask_is_repeated_once_for_every_layer():
    _, drafter = random_pair(vocab=48)
    attention = drafter.layers[0].self_attn
    mask = torch.rand(2, 1, 8, 40, generator=torch.Generator().manual_seed(8)) > 0.3
    group = attention.heads // attention.kv_heads
    additive = attention.attention_mask(mask, 32, 8, torch.bfloat16)
    assert additive.dtype == torch.bfloat16
    assert torch.equal(additive == 0, mask.repeat(1, 1, group, 1)) and torch.isneginf(additive[additive != 0]).all()
    assert attention.attention_mask(mask, 2048, 8, torch.bfloat16) is mask     # the split path takes it as is


# ----------------------------------------------------------------------------------------------
# the embedding, the router, the grouped experts

def replaced_embedding(module, ids):
    local = ids - module.start
    inside = (local >= 0) & (local < len(module.weight))
    x = F.embedding(local.clamp(0, len(module.weight) - 1), module.weight)
    return x * inside[..., None].to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", (0, 1))
@pytest.mark.parametrize("device", DEVICES)
def test_the_embedding_equals_the_masked_lookup(dtype, rank, device):
    module = VocabParallelEmbedding(64, 16, TensorParallel(rank=rank, size=2)).to(device=device, dtype=dtype)
    module.tp = TensorParallel()  # rank `rank`'s rows, compared before the all-reduce
    with torch.no_grad():
        module.weight.copy_(randn(32, 16, seed=9))
        module.weight[3, 0] = -0.0                                               # x * 1 keeps a negative zero
    ids = torch.randint(-3, 70, (3, 11), generator=torch.Generator().manual_seed(10)).to(device)
    for given in (ids, ids.to(torch.int32)):
        assert torch.equal(module(given), replaced_embedding(module, ids))


def replaced_router(router, x):
    c = router.config
    scores = F.linear(x.float(), router.weight.float()).sigmoid()
    choice = scores + router.e_score_correction_bias
    if c.topk_group < c.n_group:
        groups = choice.view(len(x), c.n_group, -1)
        group_scores = groups.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(c.topk_group, dim=-1).indices, True)
        choice = groups.masked_fill(~keep[..., None], float("-inf")).view(len(x), -1)
    ids = choice.topk(c.num_experts_per_tok, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * c.routed_scaling_factor, ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups", ({}, {"n_group": 4, "topk_group": 2}))
@pytest.mark.parametrize("device", DEVICES)
def test_the_router_keeps_one_fp32_weight_and_routes_the_same(dtype, groups, device):
    config = ModelConfig.from_dict(tiny_config(n_routed_experts=16, num_experts_per_tok=4, **groups))
    router = Router(config)
    with torch.no_grad():
        router.weight.copy_(randn(*router.weight.shape, seed=11))
        router.e_score_correction_bias.copy_(0.1 * randn(16, seed=12))
    router = router.to(device=device, dtype=dtype)
    assert router.e_score_correction_bias.dtype == torch.float32
    x = randn(23, config.hidden_size, seed=13, dtype=dtype, device=device)
    for _ in range(2):
        got, want = router(x), replaced_router(router, x)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if dtype != torch.float32:
        assert router.weight_fp32() is router.weight_fp32()                      # cast once
    with torch.no_grad():
        router.weight.mul_(-1)                                                   # a load writes in place: recast
    got, want = router(x), replaced_router(router, x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def replaced_grouped(experts, x, ids, weights):
    count = len(experts.expert_ids)
    local = ids - experts.expert_ids.start
    mine = (local >= 0) & (local < count)
    key = torch.where(mine, local, count).flatten()
    order = torch.argsort(key, stable=True)
    token = order // ids.shape[1]
    ends = torch.searchsorted(key[order], torch.arange(count, device=x.device), right=True).to(torch.int32)
    gate, up = torch._grouped_mm(x[token], experts.gate_up_proj.transpose(1, 2), offs=ends).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, experts.down_proj.transpose(1, 2), offs=ends)
    keep = mine.flatten()[order, None]
    return combine_slots(torch.where(keep, y, 0), order, weights, x.dtype)  # the combine is not the rewrite here


@pytest.mark.parametrize("moe_parallel, size, rank", [("tp", 1, 0), ("tp", 2, 1), ("ep", 2, 0), ("ep", 2, 1)])
@pytest.mark.parametrize("device", DEVICES)
def test_the_grouped_experts_equal_the_masked_dispatch(moe_parallel, size, rank, device):
    config = ModelConfig.from_dict(tiny_config())
    experts = Experts(config, TensorParallel(rank=rank, size=size), moe_parallel)
    experts = experts.to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for i, weight in enumerate(experts.parameters()):
            weight.copy_(0.1 * randn(*weight.shape, seed=14 + i))
    generator = torch.Generator().manual_seed(16)
    x = randn(37, config.hidden_size, seed=17, dtype=torch.bfloat16, device=device)
    ids = torch.stack([torch.randperm(config.n_routed_experts, generator=generator)[:2] for _ in range(37)]).to(device)
    weights = torch.rand(37, 2, generator=generator).to(device)
    assert torch.equal(experts.grouped(x, ids, weights), replaced_grouped(experts, x, ids, weights))


# ----------------------------------------------------------------------------------------------
# the commit

def replaced_commit(d, tree_tokens, features, path, n_accepted, bonus, new_lengths):
    live = d.active
    drafts = tree_tokens.gather(1, path[:, 1:].clamp(min=0))
    emitted = torch.cat([drafts, bonus[:, None]], dim=1)
    emitted.scatter_(1, (n_accepted - 1)[:, None], bonus[:, None])
    valid = live[:, None] & (d.columns < n_accepted[:, None])
    discard = d.out.shape[1] - 1
    d.out.scatter_(1, torch.where(valid, d.out_len[:, None] + d.columns, discard), emitted)
    committed = torch.where(live, n_accepted, 0)
    column = d.round.clamp(max=d.accepted.shape[1] - 1)
    d.accepted.scatter_(1, column[:, None], committed[:, None])
    d.round += live
    stopped = (valid[..., None] & (emitted[..., None] == d.stop_table)).flatten(1).any(dim=1)
    d.out_len += committed
    d.cache.lengths.copy_(torch.where(live, new_lengths, d.cache.lengths))
    if d.drafting:
        rows = path.clamp(min=0)[..., None].expand(-1, -1, features.shape[-1])
        d.features.copy_(features.gather(1, rows))
        d.n_features.copy_(committed)
    d.root.copy_(torch.where(live, bonus, d.root))
    d.active &= ~stopped & (d.out_len < d.max_new)


COMMIT_STATE = ("out", "out_len", "accepted", "round", "root", "active", "features", "n_features")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_the_commit_writes_what_it_wrote(dtype, device):
    """Random rounds through both commits, from the same state: every buffer equal after each."""
    target, drafter = random_pair(vocab=48, dtype=dtype, device=device)
    decoders = [Decoder(target, drafter, method="ddtree", budget=6, batch=4, capacity=64, temperature=0.0,
                        backend="numpy") for _ in range(2)]
    rng = np.random.default_rng(18)
    for d in decoders:
        d.max_new_tokens = 20
        d._start_rows(slice(None), torch.tensor([3, 4, 5, 6]))
        d.stop_table[:2] = torch.tensor([7, 11], device=device)
        d.active[2] = False                                                          # a finished request
        d.max_new[1] = 5
    width = drafter.config.draft_depth + 1
    for _ in range(5):
        accepted = rng.integers(1, width + 1, 4)
        n_accepted = torch.as_tensor(accepted, device=device)
        path = torch.as_tensor(np.where(np.arange(width) < accepted[:, None], rng.integers(0, 7, (4, width)), -1),
                               device=device)
        tokens = torch.as_tensor(rng.integers(0, 48, (4, 7)), device=device)
        features = randn(4, 7, drafter.config.feature_size, seed=int(rng.integers(1000)), dtype=dtype, device=device)
        bonus = torch.as_tensor(rng.integers(0, 48, 4), device=device)
        new_lengths = decoders[0].cache.lengths + n_accepted.to(torch.int32)
        decoders[0]._commit(tokens, features, path, n_accepted, bonus, new_lengths)
        replaced_commit(decoders[1], tokens, features, path, n_accepted, bonus, new_lengths)
        for name in COMMIT_STATE:
            assert torch.equal(getattr(decoders[0], name), getattr(decoders[1], name)), name
        assert torch.equal(decoders[0].cache.lengths, decoders[1].cache.lengths)
