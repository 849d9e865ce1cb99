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
