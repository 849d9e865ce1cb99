"""The real pair's formats at tiny dims: K2.6's checkpoint layout (text_config keys, `language_model.`
prefix, index, INT4 experts) loads and decodes, each TP rank reads only its bytes; the real
drafter's config keys parse to DESIGN.md §4's values and a made drafter with them equals an
independent reference of z-lab's forward (transformers' YaRN); Kimi's tiktoken files; bad paths and
configs are refused naming the file or key."""
import json
import math

import pytest
import torch

import kdtree_lib.model.checkpoint as checkpoint
from kdtree_lib.decode import generate
from kdtree_lib.dflash import DFlashConfig, DFlashDrafter, load_drafter, read_drafter_weights
from kdtree_lib.model import CheckpointReader, ModelConfig, TensorParallel, load_config, load_target
from kdtree_lib.memory import plan
from kdtree_lib.model.reference import CONFIG_DIR, kimi_text_config, save_random_kimi_checkpoint
from kdtree_lib.pair_reference import qwen3_rope, save_kimi_pair, tiny_tiktoken_ranks, zlab_block_logits
from kdtree_lib.tokenizer import KIMI_RESERVED_SPECIAL_TOKENS, load_text_tokenizer, save_tiktoken
from tolerances import logit_bound

TEXT = "def forward(self, x):\n    return self.layers[0](x)  # é ✓ 漢字 [EOS]\n"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_kimi_pair(tmp_path_factory.mktemp("kimi-pair"))


@pytest.fixture(scope="module")
def loaded(pair):
    target = load_target(pair[0], dtype=torch.float32)
    return target, load_drafter(pair[1], target)


def test_made_target_has_k26s_layout_and_keys(pair):
    target, _ = pair
    raw = json.loads((target / "config.json").read_text())
    real = json.loads((CONFIG_DIR / "kimi-k2.6.json").read_text())
    assert set(raw["text_config"]) == set(real["text_config"]) and raw["text_config"]["model_type"] == "kimi_k2"
    index = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 3 and all(name.startswith("language_model.") for name in index
                                                  if not name.startswith("vision_tower"))
    assert "language_model.model.layers.1.mlp.experts.0.down_proj.weight_packed" in index
    assert load_config(target).quantization.group_size == 32


def test_made_target_decodes_lossless_from_text(pair, loaded):
    target, drafter = loaded
    tokenizer = load_text_tokenizer(pair[0])
    prompt = tokenizer.encode("def forward(self, x):\n    return")
    ar = generate(target, drafter, prompt, method="ar", max_new_tokens=8)
    tree = generate(target, drafter, prompt, method="ddtree", budget=12, max_new_tokens=8)
    assert tree.tokens[0].tolist() == ar.tokens[0].tolist() and len(set(ar.tokens[0].tolist())) > 3
    assert isinstance(tokenizer.decode(tree.tokens[0]), str)


def test_each_rank_reads_only_its_bytes(pair):
    path = pair[0]
    config = load_config(path)

    def bytes_read(tp):
        model = checkpoint.empty_target(config, tp, device="cpu", dtype=torch.float32)
        reader = CheckpointReader(path, config.quantization)
        checkpoint.load_weights(model, reader)
        return reader.bytes_read

    whole = bytes_read(TensorParallel())
    ranks = [bytes_read(TensorParallel(rank=r, size=2)) for r in range(2)]
    print(f"bytes read: TP=1 {whole}, TP=2 ranks {ranks}")
    assert ranks[0] == ranks[1] < 0.62 * whole   # shards are half; q_a/kv_a, norms and routers are whole
    drafter_config = DFlashConfig.load(pair[1])
    read = []
    for tp in (TensorParallel(), TensorParallel(rank=0, size=2), TensorParallel(rank=1, size=2)):
        drafter = DFlashDrafter(drafter_config, tp)
        state = read_drafter_weights(pair[1], drafter)
        assert {name: tuple(t.shape) for name, t in state.items()} == {
            name: tuple(t.shape) for name, t in drafter.state_dict().items()}
        read.append(sum(t.numel() * t.element_size() for t in state.values()))
    assert read[1] == read[2] < 0.62 * read[0]   # a sharded drafter's rank: its slices (fc and norms whole)


def test_real_drafter_config_parses_to_designs_values():
    raw = json.loads((CONFIG_DIR / "kimi-k2.6-dflash.json").read_text())
    config = DFlashConfig.from_dict(raw)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.intermediate_size, config.block_size, config.mask_token_id) == (
        7168, 6, 64, 8, 128, 18432, 8, 163838)
    assert config.target_layer_ids == (1, 12, 24, 35, 47, 58) and config.rms_norm_eps == 1e-5
    yarn = config.yarn
    assert (config.rope_theta, yarn.factor, yarn.original_max_position_embeddings, yarn.beta_fast, yarn.beta_slow,
            yarn.mscale, yarn.mscale_all_dim) == (50000.0, 64.0, 4096, 32.0, 1.0, 1.0, 1.0)
    assert yarn.attention_factor == 1.0   # transformers' value: mscale / mscale_all_dim
    legacy = DFlashConfig.from_dict(raw, yarn_attention="legacy")
    assert legacy.yarn.attention_factor == pytest.approx(0.1 * math.log(64) + 1)


def test_made_drafter_equals_zlabs_forward(pair, loaded):
    """The drafter read from the real keys (YaRN at factor 64) against the written-out reference with
    transformers' Qwen3 RoPE of the same config.json, over three rounds."""
    _, drafter = loaded
    raw = json.loads((pair[1] / "config.json").read_text())
    features = torch.randn(1, 14, drafter.config.feature_size, generator=torch.Generator().manual_seed(5))
    cache = drafter.new_cache(1, 24)
    committed = 0
    for new, bonus in ((6, 11), (3, 40), (4, 7)):
        got = drafter.draft(cache, features[:, committed:committed + new], torch.tensor([bonus]))
        committed += new
        want = zlab_block_logits(drafter, features[0, :committed], bonus, rope=lambda p: qwen3_rope(raw, p))
        torch.testing.assert_close(got[0], want, rtol=0, atol=logit_bound(drafter.config, want))


def test_tiktoken_tokenizer(tmp_path):
    ranks = tiny_tiktoken_ranks()
    base = len(ranks)
    folder = save_tiktoken(tmp_path, ranks, {base: "[BOS]", base + 1: "[EOS]", base + 7: "<|im_end|>"},
                           bos="[BOS]", eos="[EOS]")
    tokenizer = load_text_tokenizer(folder)
    assert tokenizer.vocab_size == base + KIMI_RESERVED_SPECIAL_TOKENS
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.special["<|im_end|>"]) == (base, base + 1, base + 7)
    assert tokenizer.special[f"<|reserved_token_{base + 2}|>"] == base + 2 and len(tokenizer.special) == 256
    ids = tokenizer.encode(TEXT)
    assert tokenizer.decode(ids) == TEXT and max(ids) < base          # "[EOS]" in text stays text
    assert len(ids) < len(TEXT.encode())                               # the merges apply
    assert tokenizer.encode("[EOS]", allow_special=True) == [base + 1]
    (folder / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"5": {"content": "[X]"}}}))
    with pytest.raises(ValueError, match="tokenizer_config.json: added_tokens_decoder ids \\[5\\]"):
        load_text_tokenizer(folder)
    (folder / "tiktoken.model").write_text("not base64 at all\n")
    with pytest.raises(ValueError, match="tiktoken.model"):
        load_text_tokenizer(folder)
    with pytest.raises(ValueError, match="folder: neither tiktoken.model nor tokenizer.json"):
        load_text_tokenizer(tmp_path / "empty")


def test_bad_files_and_keys_are_named(pair, tmp_path):
    target, drafter = pair
    text = kimi_text_config()
    with pytest.raises(ValueError, match="some_new_switch"):
        ModelConfig.from_dict(text | {"some_new_switch": True})
    raw = json.loads((drafter / "config.json").read_text())
    with pytest.raises(ValueError, match="rope_parameters.*low_freq_factor"):
        DFlashConfig.from_dict(raw | {"rope_scaling": raw["rope_scaling"] | {"low_freq_factor": 1.0}})
    with pytest.raises(ValueError, match="path: no drafter config"):
        DFlashConfig.load(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in target.iterdir():
        if file.name != "model-00002-of-00003.safetensors":
            (broken / file.name).symlink_to(file)
    with pytest.raises(ValueError, match="model-00002-of-00003.safetensors"):
        load_target(broken, dtype=torch.float32)


def test_random_real_format_checkpoint_matches_the_memory_plan(tmp_path):
    """save_random_kimi_checkpoint (what the GPU run writes at K2.6's shapes) at tiny dims: it loads
    and runs, and the bytes it stores are the memory plan's TP=1 weights exactly."""
    text = kimi_text_config()
    path = save_random_kimi_checkpoint(tmp_path, text)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    config = load_config(path)
    assert len(set(index["weight_map"].values())) == config.num_hidden_layers + 1
    shape_records = 16 * sum(name.endswith("_shape") for name in index["weight_map"])
    # the plan also holds what loading adds beside the stored bytes: each router's fp32 copy of its weight
    routers_fp32 = 4 * config.n_routed_experts * config.hidden_size * sum(
        config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    assert plan(config, 1, 1, 16, 4).weights - routers_fp32 == index["metadata"]["total_size"] - shape_records
    model = load_target(path, dtype=torch.float32)
    logits = model.prefill(torch.tensor([[1, 2, 3]]), model.new_cache(1, 8), logits="last").logits
    assert logits.shape == (1, 1, config.vocab_size) and torch.isfinite(logits).all()
