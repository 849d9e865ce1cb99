"""DFlash drafter: z-lab config/weight format, the cached decode path against an independent
reference of z-lab's computation (default RoPE and YaRN, transformers' Qwen3 RoPE), YaRN's
frequencies and both attention-factor conventions against transformers, the training path against
the decode path, save/load."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from kdtree_lib.dflash import model as dflash  # the module whose globals the split-path tests patch
from kdtree_lib.dflash import (DFlashConfig, DFlashDrafter, YarnRope, build_target_layer_ids, hf_features,
                               load_drafter, save_drafter, split_kv_attention)
from kdtree_lib.pair_reference import qwen3_rope, zlab_block_logits
from tolerances import logit_bound, rounding_bound

VOCAB, HIDDEN = 96, 32
LAYER_IDS = (1, 2)


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    config = DeepseekV3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=16,
                              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
                              kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                              n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
                              topk_group=1, first_k_dense_replace=1, max_position_embeddings=256)
    return DeepseekV3ForCausalLM(config).eval()


def make_drafter(target, **overrides):
    values = dict(hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, block_size=4, mask_token_id=VOCAB - 1,
                  target_layer_ids=LAYER_IDS, rope_theta=10000.0) | overrides
    torch.manual_seed(1)
    drafter = DFlashDrafter(DFlashConfig(**values))
    drafter.init_weights(0.2)
    for module in drafter.modules():  # non-trivial norms, so a skipped norm shows
        if module.__class__.__name__ == "RMSNorm":
            torch.nn.init.uniform_(module.weight, 0.5, 1.5)
    return drafter.bind(target).eval()


def features_of(target, tokens):
    with torch.no_grad():
        out = target(tokens, output_hidden_states=True)
    return hf_features(out.hidden_states, LAYER_IDS)


def test_config_formats():
    zlab = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
            "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
            "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 5, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000, "rope_scaling": None, "hidden_act": "silu", "attention_bias": False,
            "layer_types": ["full_attention"] * 5, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": 5, "num_target_layers": 36, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "max_position_embeddings": 40960}
    config = DFlashConfig.from_dict(zlab)
    assert (config.block_size, config.mask_token_id, config.target_layer_ids) == (16, 151669, (1, 9, 17, 25, 33))
    assert config.feature_size == 5 * 4096 and config.draft_depth == 15 and config.window(0) is None
    assert DFlashConfig.from_dict(config.to_dict()) == config
    top_level = {k: v for k, v in zlab.items() if k != "dflash_config"} | {
        "mask_token_id": 7, "target_layer_ids": [2], "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
        "layer_types": ["sliding_attention"] * 5, "sliding_window": 2048}
    config = DFlashConfig.from_dict(top_level)
    assert (config.mask_token_id, config.rope_theta, config.window(3)) == (7, 5e5, 2048)
    for bad, match in ((zlab | {"architectures": ["DFlash2DraftModel"]}, "architectures"),
                       (zlab | {"dflash_config": {**zlab["dflash_config"], "output_multiplier": 0.2}}, "output_multiplier"),
                       (zlab | {"some_switch": True}, "some_switch"),
                       (zlab | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "original_max_position"),
                       (zlab | {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_type"),
                       (zlab | {"rope_scaling": YARN | {"low_freq_factor": 1.0}}, "low_freq_factor"),
                       ({k: v for k, v in zlab.items() if k != "dflash_config"}, "mask_token_id"),
                       (zlab | {"block_size": 1}, "block_size")):
        with pytest.raises(ValueError, match=match):
            DFlashConfig.from_dict(bad)
    with pytest.raises(ValueError, match="yarn_attention"):
        DFlashConfig.from_dict(zlab | {"rope_scaling": YARN}, yarn_attention="paper")
    defaults = DFlashConfig.from_dict({k: v for k, v in zlab.items() if k not in ("block_size", "dflash_config")}
                                      | {"mask_token_id": 3})
    assert (defaults.block_size, defaults.target_layer_ids) == (16, build_target_layer_ids(36, 5))


# YaRN as the real drafter has it (rope_scaling, old-style "type"), at a short original context so
# that the ramp and the interpolation act on the test's positions
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.mark.parametrize("rope, legacy_factor", [
    (YARN, 0.1 * math.log(4.0) + 1),
    (YARN | {"mscale": 0.707, "mscale_all_dim": 1.0, "factor": 64.0, "original_max_position_embeddings": 8}, None),
    ({k: v for k, v in YARN.items() if k not in ("mscale", "mscale_all_dim")} | {"factor": 8.0}, None)])
def test_yarn_rope_equals_transformers(rope, legacy_factor):
    """cos/sin at positions 0..40 over head_dim 16: transformers' value by default; the legacy
    0.1 ln(factor) + 1 equals transformers given that attention_factor explicitly."""
    raw = {"architectures": ["DFlashDraftModel"], "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": VOCAB, "block_size": 4,
           "mask_token_id": 1, "target_layer_ids": [1], "layer_types": ["full_attention"], "rope_theta": 10000.0,
           "rope_scaling": rope}
    positions = torch.arange(41)[None]
    for convention in ("transformers", "legacy"):
        drafter = DFlashDrafter(DFlashConfig.from_dict(raw, yarn_attention=convention))
        table, _ = drafter._rope(positions)  # [cos | -sin (first half) | sin (second half)]
        cos, sin = table[..., :16], torch.cat([-table[..., 16:24], table[..., 24:]], dim=-1)
        factor = {"transformers": None, "legacy": 0.1 * math.log(rope["factor"]) + 1}[convention]
        explicit = raw if factor is None else raw | {"rope_scaling": rope | {"attention_factor": factor}}
        want_cos, want_sin = qwen3_rope(explicit, positions[0])
        # float32 angles position x inv_freq (up to 40 rad) then cos/sin: a few roundings at that magnitude
        angle_bound = 2 * rounding_bound(torch.float32, terms=4, magnitude=float(positions.max()))
        torch.testing.assert_close(cos[0], want_cos, rtol=0, atol=angle_bound)
        torch.testing.assert_close(sin[0], want_sin, rtol=0, atol=angle_bound)
        assert DFlashConfig.from_dict(drafter.config.to_dict()) == drafter.config
    default_cos, _ = qwen3_rope(raw | {"rope_scaling": None}, positions[0])
    assert (want_cos - default_cos).abs().max() > 0.1  # YaRN changes these positions' angles
    if legacy_factor is not None:
        assert drafter.config.yarn.attention_factor == pytest.approx(legacy_factor)
        assert DFlashConfig.from_dict(raw).yarn.attention_factor == 1.0  # mscale == mscale_all_dim


def test_weight_names_are_zlabs(target):
    names = set(make_drafter(target).state_dict())
    per_layer = {"input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                 "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "self_attn.q_norm", "self_attn.k_norm"}
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{name}.weight" for i in range(2) for name in per_layer}
    assert names == expected


@pytest.fixture(params=["sdpa", "split"])
def attention_path(request, monkeypatch):
    """Run a test as is (tiny caches: one SDPA call) and with the split-KV path from 8 context keys on."""
    if request.param == "split":
        monkeypatch.setattr(dflash, "KEY_CHUNK", 8)
        monkeypatch.setattr(dflash, "SPLIT_MIN_KEYS", 8)
    return request.param


@pytest.mark.parametrize("overrides", [{}, {"layer_types": ("sliding_attention", "full_attention"),
                                             "sliding_window": 5},
                                       {"yarn": YarnRope.from_parameters(YARN)},
                                       {"yarn": YarnRope.from_parameters(YARN, "legacy")}])
def test_draft_rounds_equal_reference(target, overrides, attention_path):
    drafter = make_drafter(target, **overrides)
    torch.manual_seed(2)
    tokens = torch.randint(0, VOCAB - 1, (1, 20))
    features = features_of(target, tokens)[0]
    cache = drafter.new_cache(1, 32)
    committed = 0
    for new in (6, 3, 1, 4):  # prompt, then rounds that accepted 3, 1 and 4 tokens
        bonus = int(tokens[0, committed + new])
        got = drafter.draft(cache, features[None, committed:committed + new], torch.tensor([bonus]))
        committed += new
        want = zlab_block_logits(drafter, features[:committed], bonus)
        assert got.shape == (1, 3, VOCAB) and int(cache.lengths[0]) == committed
        torch.testing.assert_close(got[0], want, rtol=0, atol=logit_bound(drafter.config, want))


def test_ragged_batch_equals_single_requests(target, attention_path):
    drafter = make_drafter(target)
    torch.manual_seed(3)
    tokens = torch.randint(0, VOCAB - 1, (2, 16))
    features = features_of(target, tokens)
    cache = drafter.new_cache(2, 24)
    drafter.draft(cache, features[:, :7], torch.stack([tokens[0, 7], tokens[1, 4]]), n_new=torch.tensor([7, 4]))
    # each row holds its own request's next committed tokens (7.. and 4..), padded to T=3
    got = drafter.draft(cache, torch.stack([features[0, 7:10], features[1, 4:7]]),
                        torch.stack([tokens[0, 9], tokens[1, 6]]), n_new=torch.tensor([2, 2]))
    assert cache.lengths.tolist() == [9, 6]
    for b, length in ((0, 9), (1, 6)):
        single = drafter.new_cache(1, 24)
        want = drafter.draft(single, features[b:b + 1, :length], tokens[b:b + 1, length])
        torch.testing.assert_close(got[b], want[0], rtol=0, atol=logit_bound(drafter.config, want))


def split_inputs(dtype, *, batch=3, kv_heads=2, group=4, queries=5, dim=32, chunks=5, seed=0):
    """q, context k/v, own k/v and a mask for split_kv_attention: ragged lengths (one request's
    later chunks fully hidden), random holes, a causal own block."""
    generator = torch.Generator().manual_seed(seed)
    context = chunks * dflash.KEY_CHUNK
    shapes = [(group * queries,), (context,), (context,), (queries,), (queries,)]
    tensors = [torch.randn(batch, kv_heads, n, dim, generator=generator).to(dtype) for (n,) in shapes]
    lengths = torch.tensor([context, dflash.KEY_CHUNK + 7, 3][:batch])
    slots = torch.arange(context)[None, None, :] < lengths[:, None, None]                 # (B, 1, C)
    holes = torch.rand(batch, queries, context, generator=generator) > 0.1
    causal = torch.ones(queries, queries, dtype=torch.bool).tril().expand(batch, -1, -1)
    visible = torch.cat([slots & holes, causal], dim=2)[:, None]                          # (B, 1, Q, C + Q)
    return tensors, visible


def sdpa_attention(q, context_k, context_v, own_k, own_v, visible):
    group = q.shape[2] // own_k.shape[2]
    return F.scaled_dot_product_attention(q, torch.cat([context_k, own_k], 2), torch.cat([context_v, own_v], 2),
                                          attn_mask=visible.repeat(1, 1, group, 1))


def unfused_attention(q, context_k, context_v, own_k, own_v, visible):
    """Attention as a same-precision torch run writes it: scores in q's dtype, softmax in float32,
    probabilities back in q's dtype for the product with the values."""
    group = q.shape[2] // own_k.shape[2]
    k, v = torch.cat([context_k, own_k], 2), torch.cat([context_v, own_v], 2)
    hidden = ~visible.repeat(1, 1, group, 1)
    scores = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(hidden, -torch.inf)
    return scores.float().softmax(-1).to(v.dtype) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_split_kv_attention_equals_sdpa(monkeypatch, dtype, seed):
    """Against SDPA in float64: float32 to rounding, bfloat16 within twice a same-precision torch run's error."""
    monkeypatch.setattr(dflash, "KEY_CHUNK", 64)
    tensors, visible = split_inputs(dtype, seed=seed)
    reference = sdpa_attention(*(t.double() for t in tensors), visible)
    got = split_kv_attention(*tensors, visible)
    # the context as a slice of a longer storage (chunks that are no plain view of it)
    storage = [torch.cat([t, torch.full_like(t, float("nan"))], 2) for t in tensors[1:3]]
    sliced = split_kv_attention(tensors[0], *(t[:, :, :tensors[1].shape[2]] for t in storage), *tensors[3:], visible)
    error = (got.double() - reference).abs().max().item()
    sdpa = (sdpa_attention(*tensors, visible).double() - reference).abs().max().item()
    baseline = (unfused_attention(*tensors, visible).double() - reference).abs().max().item()
    print(f"{dtype}: split max error {error:.2e}, SDPA's {sdpa:.2e}, unfused torch's {baseline:.2e}")
    assert got.dtype == dtype and got.shape == tensors[0].shape
    assert torch.equal(sliced, got)
    assert (split_kv_attention(*tensors, torch.ones_like(visible)) - got).abs().max() > 0.1  # the mask matters here
    assert error <= (1e-5 if dtype == torch.float32 else 2 * baseline)


def test_split_path_in_static_draft_equals_sdpa(target, monkeypatch):
    """A ragged batch, sliding and causal layers: the split path (static, over the whole storage,
    and eager) drafts what one SDPA call over the used slots drafts."""
    drafter = make_drafter(target, is_causal=True, layer_types=("sliding_attention", "full_attention"),
                           sliding_window=6)
    tokens = torch.randint(0, VOCAB - 1, (2, 24))
    features = features_of(target, tokens)

    def rounds(static):
        cache = drafter.new_cache(2, 21)
        first = drafter.draft(cache, features[:, :11], tokens[:, 11], n_new=torch.tensor([11, 5]), static=static)
        second = drafter.draft(cache, torch.stack([features[0, 11:14], features[1, 5:8]]),
                               torch.stack([tokens[0, 14], tokens[1, 8]]), static=static)
        return torch.cat([first, second]), cache

    want, _ = rounds(static=False)
    monkeypatch.setattr(dflash, "KEY_CHUNK", 8)
    monkeypatch.setattr(dflash, "SPLIT_MIN_KEYS", 8)
    calls = []  # the context length of each split call
    monkeypatch.setattr(dflash, "split_kv_attention",
                        lambda *args: calls.append(args[1].shape[2]) or split_kv_attention(*args))
    for static in (True, False):
        got, cache = rounds(static)
        assert cache.slots == 24 and cache.capacity == 21
        torch.testing.assert_close(got, want, rtol=0, atol=logit_bound(drafter.config, want))
    assert calls == [24] * 4 + [16] * 4   # per layer: static over the storage, eager over the used chunks


def test_crop_rolls_back(target):
    drafter = make_drafter(target)
    tokens = torch.randint(0, VOCAB - 1, (1, 16))
    features = features_of(target, tokens)
    cache = drafter.new_cache(1, 24)
    drafter.draft(cache, features[:, :10], tokens[:, 10])
    cache.crop(torch.tensor([6]))
    again = drafter.draft(cache, features[:, 6:8], tokens[:, 8])
    fresh = drafter.draft(drafter.new_cache(1, 24), features[:, :8], tokens[:, 8])
    torch.testing.assert_close(again, fresh, rtol=0, atol=logit_bound(drafter.config, fresh))


def test_training_blocks_equal_decode(target):
    drafter = make_drafter(target)
    torch.manual_seed(4)
    tokens = torch.randint(0, VOCAB - 1, (2, 18))
    features = features_of(target, tokens)
    anchors = torch.tensor([[3, 9, 12], [1, 5, 14]])
    with torch.no_grad():
        logits = drafter.logits(drafter.forward_blocks(features, tokens, anchors))   # (B, N, Q, V)
    assert logits.shape == (2, 3, 4, VOCAB)
    for b in range(2):
        for n, anchor in enumerate(anchors[b].tolist()):
            cache = drafter.new_cache(1, 24)
            want = drafter.draft(cache, features[b:b + 1, :anchor], tokens[b:b + 1, anchor])
            torch.testing.assert_close(logits[b, n, 1:], want[0], rtol=0, atol=logit_bound(drafter.config, want))


def test_save_load_round_trip_and_shards(target, tmp_path):
    drafter = make_drafter(target)
    tokens = torch.randint(0, VOCAB - 1, (1, 10))
    features = features_of(target, tokens)
    want = drafter.draft(drafter.new_cache(1, 16), features[:, :8], tokens[:, 8])
    save_drafter(drafter, tmp_path / "one", dtype=torch.float32)
    save_drafter(drafter, tmp_path / "sharded", dtype=torch.float32, shard_bytes=10_000)
    assert (tmp_path / "one" / "model.safetensors").is_file()
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and all((tmp_path / "sharded" / s).stat().st_size <= 10_000 + 2048 for s in shards)
    raw = json.loads((tmp_path / "one" / "config.json").read_text())
    assert raw["dflash_config"] == {"mask_token_id": VOCAB - 1, "target_layer_ids": list(LAYER_IDS)}
    assert raw["block_size"] == 4
    for folder in ("one", "sharded"):
        loaded = load_drafter(tmp_path / folder, target)
        got = loaded.draft(loaded.new_cache(1, 16), features[:, :8], tokens[:, 8])
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    bf16 = tmp_path / "bf16"
    save_drafter(drafter, bf16)
    assert load_drafter(bf16, target).fc.weight.dtype == torch.float32  # the target's dtype


def test_bad_input(target):
    drafter = make_drafter(target)
    features = torch.zeros(1, 5, drafter.config.feature_size)
    cache = drafter.new_cache(1, 8)
    with pytest.raises(ValueError, match="features"):
        drafter.draft(cache, torch.zeros(1, 5, 7), torch.tensor([1]))
    with pytest.raises(ValueError, match="n_new"):
        drafter.draft(cache, features, torch.tensor([1]), n_new=torch.tensor([6]))
    with pytest.raises(ValueError, match="capacity"):
        drafter.draft(cache, torch.zeros(1, 9, drafter.config.feature_size), torch.tensor([1]))
    with pytest.raises(ValueError, match="bind"):
        DFlashDrafter(drafter.config).draft(cache, features, torch.tensor([1]))
    with pytest.raises(ValueError, match="hidden_size"):
        DFlashDrafter(DFlashConfig(**{**drafter.config.__dict__, "hidden_size": 16})).bind(target)
    with pytest.raises(ValueError, match="last layer"):
        hf_features(tuple(torch.zeros(1, 2, 3) for _ in range(5)), (1, 3))


def test_build_target_layer_ids():
    assert build_target_layer_ids(8, 3) == (1, 4, 6)
    assert build_target_layer_ids(6, 1) == (4,)
    with pytest.raises(ValueError, match="count"):
        build_target_layer_ids(4, 3)
