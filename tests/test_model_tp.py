"""Tensor parallelism on the CPU: TP=2 over gloo equals TP=1, and each rank reads only its shard."""
import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import kdtree_lib.model.checkpoint as checkpoint
from kdtree_lib.model import CheckpointReader, ModelConfig, TensorParallel, load_config
from kdtree_lib.model.model import Experts
from kdtree_lib.pairs import tiny_config
from kdtree_lib.model.reference import random_model, save_kimi_checkpoint
from kdtree_lib.model.sharded import tp_logits
from kdtree_lib.contracts import tree_from_parents
from tolerances import logit_bound

PARENTS = np.array([[-1, 0, 0, 1, 2, 2, -1], [-1, 0, 1, 1, 3, -1, -1]])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    config = tiny_config()
    model = random_model(config, seed=11)
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path)
    return model, config, path


@pytest.mark.parametrize("moe_parallel, layout", [("tp", "kimi-int4"), ("ep", "hf")])
def test_tp2_over_gloo_equals_tp1(reference, tmp_path, moe_parallel, layout):
    hf, config, path = reference
    if layout == "kimi-int4":  # column slices of packed INT4 down_proj weights
        path = save_kimi_checkpoint(hf, config, tmp_path, int4=True)
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(12))
    tree = tree_from_parents(PARENTS, np.random.default_rng(13).integers(0, 256, PARENTS.shape))
    one = tp_logits(path, prompt, tree, world_size=1, moe_parallel=moe_parallel)
    two = tp_logits(path, prompt, tree, world_size=2, moe_parallel=moe_parallel)
    for phase in ("prefill", "verify"):
        torch.testing.assert_close(two[phase], one[phase], atol=logit_bound(ModelConfig.from_dict(config), one[phase]),
                                   rtol=0)


class CountingSafeOpen:
    """safe_open that counts the bytes of every slice it hands out (independently of the reader)."""
    bytes = 0

    def __init__(self, *args, **kwargs):
        self.inner = REAL_SAFE_OPEN(*args, **kwargs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def keys(self):
        return self.inner.keys()

    def get_slice(self, name):
        inner = self.inner.get_slice(name)

        class Slice:
            def get_shape(self):
                return inner.get_shape()

            def __getitem__(self, index):
                tensor = inner[index]
                CountingSafeOpen.bytes += tensor.numel() * tensor.element_size()
                return tensor
        return Slice()


REAL_SAFE_OPEN = checkpoint.safe_open


def bytes_read(path, tp, monkeypatch):
    config = load_config(path)
    model = checkpoint.empty_target(config, tp, device="cpu", dtype=torch.float32)
    CountingSafeOpen.bytes = 0
    monkeypatch.setattr(checkpoint, "safe_open", CountingSafeOpen)
    reader = CheckpointReader(path)
    checkpoint.load_weights(model, reader)
    assert CountingSafeOpen.bytes == reader.bytes_read
    return model, reader.bytes_read


def test_each_rank_reads_only_its_shard(reference, monkeypatch):
    _, _, path = reference
    whole, full = bytes_read(path, TensorParallel(), monkeypatch)
    ranks = [bytes_read(path, TensorParallel(rank=r, size=2), monkeypatch)[1] for r in range(2)]
    replicated = sum(t.numel() * 4 for name, t in [*whole.named_parameters(), *whole.named_buffers()]
                     if getattr(whole.get_submodule(name.rsplit(".", 1)[0]), "tp_dim", None) is None
                     and not isinstance(whole.get_submodule(name.rsplit(".", 1)[0]), Experts))
    file_bytes = (path / "model.safetensors").stat().st_size
    assert full <= file_bytes < full + 20_000  # TP=1 reads every tensor once (plus the header)
    assert ranks[0] == ranks[1] == (full + replicated) / 2
    assert ranks[0] < 0.6 * full
