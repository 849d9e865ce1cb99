"""kdtree_lib.model on the CPU: config parsing, parity with transformers' DeepseekV3ForCausalLM
(prefill and tree verify, naive and absorbed attention), checkpoint layouts, INT4, bad input."""
import json
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from kdtree_lib.model import CheckpointReader, ModelConfig, Transformer, TensorParallel, load_config, load_target
from kdtree_lib.model.checkpoint import dequantize_int4, empty_target, load_weights, quantize_int4
from kdtree_lib.model.model import Experts
from kdtree_lib.pairs import tiny_config
from kdtree_lib.model.reference import prefill_logits, random_model, save_kimi_checkpoint, tree_logits
from kdtree_lib.paths import REPO_ROOT
from kdtree_lib.tree_accept import accept, posterior_tokens
from kdtree_lib.contracts import tree_from_parents
from tolerances import logit_bound, rounding_bound

VARIANTS = {"k26": {}, "v3-groups": {"n_group": 4, "topk_group": 2, "first_k_dense_replace": 2}}
PARENTS = np.array([[-1, 0, 0, 1, 1, 2, 3, 6, -1], [-1, 0, 1, 2, 0, 4, -1, -1, -1]])


@pytest.fixture(scope="module", params=list(VARIANTS))
def reference(request, tmp_path_factory):
    """(transformers model, its config dict, its save_pretrained directory)."""
    config = tiny_config(**VARIANTS[request.param])
    model = random_model(config, seed=len(request.param))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, config, path


def random_tokens(shape, seed):
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))


def random_tree(seed):
    tokens = np.random.default_rng(seed).integers(0, 256, PARENTS.shape)
    return tree_from_parents(PARENTS, tokens)


# ----------------------------------------------------------------------------------------------
# config

def test_k26_config_has_the_real_values():
    c = load_config(REPO_ROOT / "data" / "configs" / "kimi-k2.6.json")
    assert (c.hidden_size, c.num_hidden_layers, c.first_k_dense_replace, c.intermediate_size) == (7168, 61, 1, 18432)
    assert (c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank) == (64, 1536, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (128, 64, 128)
    assert (c.n_routed_experts, c.moe_intermediate_size, c.num_experts_per_tok, c.n_shared_experts) == (384, 2048, 8, 1)
    assert (c.vocab_size, c.routed_scaling_factor, c.norm_topk_prob, c.rms_norm_eps) == (163840, 2.827, True, 1e-5)
    assert (c.rope_factor, c.rope_theta, c.rope_original_max_position) == (64, 50000, 4096)
    assert (c.rope_beta_fast, c.rope_beta_slow, c.rope_mscale, c.rope_mscale_all_dim) == (32, 1, 1, 1)
    assert c.rope_interleave and c.num_nextn_predict_layers == 0
    assert c.quantization.group_size == 32 and c.quantization.num_bits == 4
    assert c.softmax_scale == pytest.approx(192 ** -0.5 * (1 + 0.1 * np.log(64)) ** 2)


def test_config_from_transformers_output_equals_the_dict_it_came_from(reference):
    _, config, path = reference
    assert load_config(path) == ModelConfig.from_dict(config)


@pytest.mark.parametrize("where", ["top", "rope", "wrapper"])
def test_unknown_config_key_is_an_error(where):
    config = tiny_config()
    if where == "top":
        config["moe_shared_gate"] = True
    elif where == "rope":
        config["rope_scaling"]["low_freq_factor"] = 1.0
    else:
        config = {"model_type": "kimi_k25", "text_config": config, "vision_tower_depth": 27}
    key = {"top": "moe_shared_gate", "rope": "low_freq_factor", "wrapper": "vision_tower_depth"}[where]
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_dict(config)


def test_unsupported_switch_is_an_error():
    with pytest.raises(ValueError, match="scoring_func"):
        ModelConfig.from_dict(tiny_config(scoring_func="softmax"))


# ----------------------------------------------------------------------------------------------
# parity with transformers

@pytest.mark.parametrize("attention", ["naive", "absorbed"])
def test_prefill_logits_equal_transformers(reference, attention):
    hf, _, path = reference
    model = load_target(path, dtype=torch.float32, attention=attention)
    tokens = random_tokens((2, 13), seed=1)
    ours = model.prefill(tokens, model.new_cache(2, 16)).logits
    expected = prefill_logits(hf, tokens)
    torch.testing.assert_close(ours, expected, atol=logit_bound(model.config, expected), rtol=0)


@pytest.mark.parametrize("attention", ["naive", "absorbed"])
def test_tree_verify_logits_equal_transformers(reference, attention):
    """Ragged prompts (7 and 4 tokens, right-padded), then a tree with padding nodes."""
    hf, _, path = reference
    model = load_target(path, dtype=torch.float32, attention=attention)
    prompts, n_valid = random_tokens((2, 7), seed=2), torch.tensor([7, 4])
    tree = random_tree(seed=3)
    cache = model.new_cache(2, 7 + tree.capacity)
    model.prefill(prompts, cache, n_valid=n_valid)
    assert cache.lengths.tolist() == [7, 4]
    ours = model.verify(tree, cache).logits
    for b in range(2):
        live = int(tree.n_nodes[b])
        expected = tree_logits(hf, prompts[b, :n_valid[b]], tree, b)
        torch.testing.assert_close(ours[b, :live], expected[:live], atol=logit_bound(model.config, expected), rtol=0)


def test_feature_layers_are_the_decoder_layer_outputs(reference):
    hf, _, path = reference
    model = load_target(path, dtype=torch.float32)
    tokens = random_tokens((1, 6), seed=4)
    features = model.prefill(tokens, model.new_cache(1, 6), feature_layers=(1, 0)).features
    hidden = hf(input_ids=tokens, output_hidden_states=True).hidden_states  # [embeddings, layer 0, ...]
    expected = torch.cat([hidden[2], hidden[1]], dim=-1)
    torch.testing.assert_close(features, expected, atol=logit_bound(model.config, expected), rtol=0)


def test_accepted_path_compacts_to_the_cache_of_the_linear_sequence(reference):
    """Greedy continuation g1..g4 of a prompt; a tree holding g1 -> g2 -> g3 among distractors
    accepts exactly that path with bonus g4, and the compacted cache equals a plain prefill."""
    _, _, path = reference
    model = load_target(path, dtype=torch.float32)
    prompt = random_tokens((1, 6), seed=5)
    greedy, cache = prompt, model.new_cache(1, 16)
    step = model.prefill(greedy, cache)
    for _ in range(4):
        greedy = torch.cat([greedy, step.logits[:, -1:].argmax(-1)], dim=1)
        step = model.prefill(greedy[:, -1:], cache)
    g = greedy[0, 6:].tolist()
    tokens = np.array([[prompt[0, -1].item(), g[0], g[0] + 1, g[1], g[1] + 1, g[2], g[2] + 1]]) % 256
    tree = tree_from_parents(np.array([[-1, 0, 0, 1, 1, 3, 3]]), tokens)
    cache = model.new_cache(1, 16)
    model.prefill(prompt[:, :-1], cache)
    result = accept(tree, posterior_tokens(model.verify(tree, cache).logits))
    assert result.path[0].tolist()[:4] == [0, 1, 3, 5] and result.bonus[0] == g[3]
    cache.accept(result)
    linear = model.new_cache(1, 16)
    model.prefill(greedy[:, :9], linear)
    assert cache.lengths.tolist() == linear.lengths.tolist() == [9]
    for ours, expected in zip(cache.kv, linear.kv):
        torch.testing.assert_close(ours[:, :9], expected[:, :9], atol=logit_bound(model.config, expected), rtol=0)


def test_router_bias_stays_fp32_when_the_model_is_cast(reference):
    _, _, path = reference
    model = load_target(path, dtype=torch.float32)
    bias = model.layers[-1].mlp.gate.e_score_correction_bias.clone()
    model = model.to(torch.bfloat16)
    assert model.layers[-1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(model.layers[-1].mlp.gate.e_score_correction_bias, bias)


# ----------------------------------------------------------------------------------------------
# checkpoint layouts and the INT4 format

def test_kimi_layout_loads_the_same_model(reference, tmp_path):
    hf, config, _ = reference
    path = save_kimi_checkpoint(hf, config, tmp_path, int4=False)
    assert (path / "model.safetensors.index.json").is_file()
    model = load_target(path, dtype=torch.float32)
    tokens = random_tokens((1, 9), seed=6)
    expected = prefill_logits(hf, tokens)
    torch.testing.assert_close(model.prefill(tokens, model.new_cache(1, 9)).logits, expected,
                               atol=logit_bound(model.config, expected), rtol=0)


def test_int4_unpacking_follows_compressed_tensors():
    """Codes q+8, eight per int32 along the input dimension, the first in the lowest nibble."""
    words = torch.tensor([[0x76543210, 0xFEDCBA98 - 2**32, 0x76543210, 0xFEDCBA98 - 2**32]], dtype=torch.int32)
    scale = torch.tensor([[0.5]], dtype=torch.bfloat16)
    expected = torch.arange(-8, 8, dtype=torch.float32).repeat(2)[None] * 0.5
    assert torch.equal(dequantize_int4(words, scale, 32), expected)


def test_int4_quantize_round_trips_representable_weights():
    q = torch.cat([torch.arange(-7, 8), torch.zeros(17)]).float()[None]  # one row, one group of 32
    packed, scale = quantize_int4(q * 0.25)
    assert packed.dtype == torch.int32 and packed.shape == (1, 4) and scale.tolist() == [[0.25]]
    assert packed[0, 0].item() & 0xFFFFFFFF == 0x87654321  # codes of -7..0
    assert torch.equal(dequantize_int4(packed, scale, 32), q * 0.25)


def test_int4_experts_load_dequantized_and_give_the_dequantized_models_logits(reference, tmp_path):
    hf, config, _ = reference
    path = save_kimi_checkpoint(hf, config, tmp_path, int4=True)
    model = load_target(path, dtype=torch.float32, dequantize_experts=True)
    layer = config["first_k_dense_replace"]
    stacked = hf.model.layers[layer].mlp.experts
    for e in range(config["n_routed_experts"]):
        gate, up = stacked.gate_up_proj[e].detach().chunk(2)
        for ours, original in [(model.layers[layer].mlp.experts.gate_up_proj[e], torch.cat([gate, up])),
                               (model.layers[layer].mlp.experts.down_proj[e], stacked.down_proj[e].detach())]:
            assert torch.equal(ours, dequantize_int4(*quantize_int4(original), 32))
            assert (ours - original).abs().max() <= original.abs().max() / 7  # half a step at most
    dequantized = random_model(config, seed=0)
    dequantized.load_state_dict(hf.state_dict())
    for i in range(layer, config["num_hidden_layers"]):
        experts = dequantized.model.layers[i].mlp.experts
        with torch.no_grad():
            for e in range(config["n_routed_experts"]):
                gate, up = experts.gate_up_proj[e].chunk(2)
                experts.gate_up_proj[e] = torch.cat([dequantize_int4(*quantize_int4(w), 32) for w in (gate, up)])
                experts.down_proj[e] = dequantize_int4(*quantize_int4(experts.down_proj[e]), 32)
    tokens = random_tokens((1, 9), seed=7)
    expected = prefill_logits(dequantized, tokens)
    torch.testing.assert_close(model.prefill(tokens, model.new_cache(1, 9)).logits, expected,
                               atol=logit_bound(model.config, expected), rtol=0)


# ----------------------------------------------------------------------------------------------
# bad input: a clear error naming the tensor, file or key

def test_missing_shard_names_the_file(reference, tmp_path):
    hf, config, _ = reference
    path = save_kimi_checkpoint(hf, config, tmp_path, int4=False)
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ValueError, match="model-00002-of-00003.safetensors"):
        load_target(path, dtype=torch.float32)


def test_shape_disagreeing_with_the_config_names_the_tensor(reference, tmp_path):
    _, config, path = reference
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    bad = dict(config, q_lora_rank=40)
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_a_proj\.weight"):
        load_target(tmp_path, dtype=torch.float32)


def test_missing_tensor_names_it(reference, tmp_path):
    hf, config, _ = reference
    path = save_kimi_checkpoint(hf, config, tmp_path, int4=False)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    last = config["num_hidden_layers"] - 1
    del index["weight_map"][f"language_model.model.layers.{last}.mlp.experts.3.up_proj.weight"]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"layers\.{last}\.mlp\.experts\.3\.up_proj\.weight"):
        load_target(path, dtype=torch.float32)


@pytest.mark.parametrize("degree, overrides, key", [(3, {"vocab_size": 258}, "num_attention_heads"),
                                                    (4, {"moe_intermediate_size": 42}, "moe_intermediate_size"),
                                                    (4, {"vocab_size": 255}, "vocab_size")])
def test_tp_degree_that_does_not_divide_names_the_key(degree, overrides, key):
    config = ModelConfig.from_dict(tiny_config(**overrides))
    with pytest.raises(ValueError, match=key):
        with torch.device("meta"):
            Transformer(config, TensorParallel(rank=0, size=degree))


@pytest.mark.parametrize("moe_parallel, rank", [("tp", 1), ("ep", 0)])
def test_grouped_experts_equal_the_expert_loop(moe_parallel, rank):
    config = ModelConfig.from_dict(tiny_config())
    experts = Experts(config, TensorParallel(rank=rank, size=2), moe_parallel).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for weight in experts.parameters():
            weight.copy_(0.1 * torch.randn(weight.shape, generator=generator))
    x = torch.randn(37, config.hidden_size, generator=generator).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(37)])
    weights = torch.rand(37, 2, generator=generator)
    looped = experts.looped(x, ids, weights).detach()
    # fp32 accumulation inside each bf16 matmul; the path's four bf16 roundings (gate_up, the gated product,
    # down, the weighted sum) may each land one bf16 ulp apart between the two orders
    bound = 2 * rounding_bound(torch.bfloat16, terms=4, magnitude=float(looped.abs().max()))
    torch.testing.assert_close(experts.grouped(x, ids, weights), looped, rtol=0, atol=bound)


def test_tp_slice_that_splits_an_int4_group_names_the_tensor(reference, tmp_path):
    """moe_intermediate_size 64 over 4 ranks: 16 inputs of down_proj per rank, half a group of 32."""
    hf, config, _ = reference
    path = save_kimi_checkpoint(hf, config, tmp_path, int4=True)
    model = empty_target(load_config(path), TensorParallel(rank=0, size=4), device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"experts\.0\.down_proj\.weight"):
        load_weights(model, CheckpointReader(path, model.config.quantization))


def test_compute_bound_nodes_is_the_first_tree_past_the_ridge():
    """The smallest N whose absorbed attention reaches the ridge intensity, and no smaller one does."""
    from kdtree_lib.model.costs import compute_bound_nodes, verify_attention_cost
    config = load_config(REPO_ROOT / "data" / "configs" / "kimi-k2.6.json")

    def intensity(n):
        cost = verify_attention_cost(config, 4096, n, heads=8)["absorbed"]
        return cost["flops"] / cost["bytes"]
    ridge = intensity(20)
    first = compute_bound_nodes(config, 4096, ridge, heads=8)
    assert first is not None and intensity(first) >= ridge and all(intensity(n) < ridge for n in range(1, first))
    assert compute_bound_nodes(config, 4096, 1e9, heads=8, max_nodes=8) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_slots_combine_in_slot_order_whatever_the_row_order(dtype):
    """model.combine_slots: a token's slots are summed in fp32 in slot order, so the result does not depend
    on the order its rows arrive in (index_add_ on a GPU added them in whatever order atomics landed),
    and it is the fp32 weighted sum rounded once."""
    from kdtree_lib.model.model import combine_slots
    generator = torch.Generator().manual_seed(3)
    tokens, k, hidden = 11, 4, 24
    rows = torch.randn(tokens * k, hidden, generator=generator).to(dtype)   # assignment order n*k + j
    weights = torch.rand(tokens, k, generator=generator)
    results = []
    for seed in (0, 1, 2):
        order = torch.randperm(tokens * k, generator=torch.Generator().manual_seed(seed))
        results.append(combine_slots(rows[order], order, weights, dtype))  # row i of y is assignment order[i]
    assert all(torch.equal(results[0], r) for r in results[1:])
    products = rows.double().view(tokens, k, hidden) * weights.double()[..., None]
    exact = products.sum(1)
    # k fp32 products and k - 1 fp32 additions, each operand at most the sum of the products' sizes
    # (per output), then one rounding to dtype
    bound = rounding_bound(torch.float32, terms=k, magnitude=1.0) * products.abs().sum(1) + \
        torch.finfo(dtype).eps * exact.abs()
    assert ((results[0].double() - exact).abs() <= bound).all()
