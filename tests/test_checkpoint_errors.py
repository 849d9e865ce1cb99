"""A damaged checkpoint file is a ValueError that names the file (safetensors' own error names none)."""
import pytest
import torch

pytest.importorskip("transformers")

from kdtree_lib.model import CheckpointReader, load_target
from kdtree_lib.model.reference import random_model, save_kimi_checkpoint
from kdtree_lib.pairs import tiny_config


@pytest.fixture(scope="module")
def hf_and_config():
    config = tiny_config()
    return random_model(config, seed=5), config


def truncate(path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


@pytest.mark.parametrize("keep", [4, 40, -100], ids=["header-too-small", "header-cut", "data-cut"])
def test_a_truncated_shard_names_the_file(hf_and_config, tmp_path, keep):
    hf, config = hf_and_config
    path = save_kimi_checkpoint(hf, config, tmp_path, int4=False)
    shard = path / "model-00002-of-00003.safetensors"
    truncate(shard, keep if keep > 0 else shard.stat().st_size + keep)
    with pytest.raises(ValueError, match=r"checkpoint: .*model-00002-of-00003\.safetensors is not a readable"):
        load_target(path, dtype=torch.float32)


def test_a_truncated_single_file_names_it(hf_and_config, tmp_path):
    hf, _ = hf_and_config
    hf.save_pretrained(tmp_path)
    single = tmp_path / "model.safetensors"
    truncate(single, single.stat().st_size - 100)
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file"):
        CheckpointReader(tmp_path)


# ----------------------------------------------------------------------------------------------
# a refusal names the file and the tensor or key (issue 28: raw SafetensorError, KeyError, json errors)

import json  # noqa: E402

from kdtree_lib.dflash import DFlashConfig  # noqa: E402
from kdtree_lib.model import load_config  # noqa: E402
from kdtree_lib.pairs import TINY_DRAFTER  # noqa: E402

INDEX = "model.safetensors.index.json"


def edit_json(path, change) -> None:
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def test_a_tensor_missing_from_its_shard_names_tensor_and_file(hf_and_config, tmp_path):
    hf, config = hf_and_config
    path = save_kimi_checkpoint(hf, config, tmp_path, int4=False)
    index = json.loads((path / INDEX).read_text())
    name = "language_model.model.norm.weight"
    elsewhere = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name])
    edit_json(path / INDEX, lambda raw: raw["weight_map"].update({name: elsewhere}))
    with pytest.raises(ValueError, match=rf"tensor {name} is not in .*{elsewhere}"):
        load_target(path, dtype=torch.float32)


def test_a_missing_expert_tensor_names_the_folder(hf_and_config, tmp_path):
    hf, config = hf_and_config
    path = save_kimi_checkpoint(hf, config, tmp_path, int4=True)
    name = "language_model.model.layers.1.mlp.experts.2.down_proj.weight_scale"
    edit_json(path / INDEX, lambda raw: raw["weight_map"].pop(name))
    with pytest.raises(ValueError, match=rf"experts\.2\.down_proj\.weight_scale .*no such tensor in {tmp_path}"):
        load_target(path, dtype=torch.float32)


def test_a_group_size_other_than_32_blames_the_config(hf_and_config, tmp_path):
    hf, config = hf_and_config
    path = save_kimi_checkpoint(hf, config, tmp_path, int4=True)
    edit_json(path / "config.json", lambda raw: raw["text_config"]["quantization_config"]["config_groups"]["group_0"]
              ["weights"].update(group_size=64))
    with pytest.raises(ValueError, match=r"config\.json: .*quantization_config\.config_groups\.group_0\.weights\."
                                         r"group_size: only 32 .*got 64"):
        load_target(path, dtype=torch.float32)


@pytest.mark.parametrize("file", ["config.json", INDEX])
def test_broken_json_names_the_file(hf_and_config, tmp_path, file):
    hf, config = hf_and_config
    path = save_kimi_checkpoint(hf, config, tmp_path, int4=False)
    (path / file).write_text('{"weight_map": ')
    with pytest.raises(ValueError, match=rf"{path / file}: not valid JSON"):
        load_target(path, dtype=torch.float32)


def test_an_index_without_weight_map_names_file_and_key(hf_and_config, tmp_path):
    hf, config = hf_and_config
    path = save_kimi_checkpoint(hf, config, tmp_path, int4=False)
    edit_json(path / INDEX, lambda raw: raw.pop("weight_map"))
    with pytest.raises(ValueError, match=rf"{path / INDEX}: expected a 'weight_map'"):
        load_target(path, dtype=torch.float32)


def test_a_drafter_config_without_hidden_size_names_file_and_key(tmp_path):
    raw = DFlashConfig(hidden_size=64, vocab_size=256, block_size=8, mask_token_id=2, target_layer_ids=(1,),
                       **TINY_DRAFTER).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert DFlashConfig.load(tmp_path).hidden_size == 64
    del raw["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'}: config: missing required keys \['hidden_size'\]"):
        DFlashConfig.load(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'}: expected a JSON object, got list"):
        DFlashConfig.load(tmp_path)


@pytest.mark.parametrize("key, value", [("num_hidden_layers", 0), ("rms_norm_eps", -1e-6), ("rms_norm_eps", 0.0),
                                        ("max_position_embeddings", 0), ("max_position_embeddings", -4096),
                                        ("hidden_size", "64"), ("vocab_size", True)])
def test_impossible_config_values_are_refused_naming_file_and_field(tmp_path, key, value):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(**{key: value})))
    with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'}: {key}: expected"):
        load_config(tmp_path)


@pytest.mark.parametrize("key, value", [("kv_lora_rank", 256), ("qk_rope_head_dim", 32)])
def test_latent_widths_the_absorbed_attention_cannot_take_are_refused_at_load(hf_and_config, tmp_path, key, value):
    """verify_attn fixes LATENT_DIM 512 / ROPE_DIM 64: refused when the config is read, not at the first forward."""
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(**{key: value})))
    assert not load_config(tmp_path).absorbable  # the naive path still takes it
    with pytest.raises(ValueError, match=rf"config\.json\.{key}: the absorbed attention \(verify_attn\) takes K2\.6's"):
        load_target(tmp_path, dtype=torch.float32)
