"""Tensor-parallel decode on the CPU: greedy DDTree, chain and AR at TP=2 over gloo equal TP=1 and
each other token for token on a made-to-format real pair (K2.6 layout, INT4 experts, a YaRN
drafter, replicated or sharded), a sharded drafter's drafts equal the whole one's, prefill in chunks
equals one chunk, the launcher under torchrun, bad paths."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import numpy as np
import torch

from kdtree_lib.decode import generate, main
from kdtree_lib.decode_tp import generate_tp
from kdtree_lib.pairs import checkpoint_pair
from kdtree_lib.dflash import DFlashConfig, load_drafter
from kdtree_lib.model import launch, load_target
from kdtree_lib.memory import MemoryPlanError
from kdtree_lib.pair_reference import save_kimi_pair
from kdtree_lib.paths import REPO_ROOT
from tolerances import logit_bound

PROMPTS = [[257, 32, 102, 40, 120, 41, 58, 10, 258, 262, 114], [101, 414, 420, 557, 473]]
NEW_TOKENS = 8
RUNS = [dict(method="ddtree", budget=16, max_new_tokens=NEW_TOKENS, prefill_chunk=3),
        dict(method="chain", budget=16, max_new_tokens=NEW_TOKENS),
        dict(method="ar", max_new_tokens=NEW_TOKENS)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_kimi_pair(tmp_path_factory.mktemp("kimi-pair"))


def tokens_of(result):
    return [t.tolist() for t in result.tokens]


def test_tp2_over_gloo_equals_tp1_and_autoregressive(pair):
    """TP=2 with the drafter replicated (the sharded default runs in the launcher test)."""
    target, drafter = pair
    one = generate_tp(target, drafter, PROMPTS, tp=1, runs=RUNS)
    two = generate_tp(target, drafter, PROMPTS, tp=2, runs=RUNS, drafter_placement="replicated")
    ar = tokens_of(one[2])
    assert [len(t) for t in ar] == [NEW_TOKENS] * 2 and all(len(set(t)) > 3 for t in ar)
    for run, single, sharded in zip(RUNS, one, two):
        assert tokens_of(single) == ar, run["method"]
        assert tokens_of(sharded) == ar, run["method"]
        assert (sharded.method, sharded.budget) == (single.method, single.budget)
        assert [a.tolist() for a in sharded.acceptance] == [a.tolist() for a in single.acceptance], run["method"]


def draft_both_placements(tp, target_path, drafter_path):
    """A rank's drafts from the whole drafter and from its shard, on the same random features."""
    target = load_target(target_path, dtype=torch.float32, tp_group=tp.group)
    drafts = []
    for placement in ("replicated", "sharded"):
        drafter = load_drafter(drafter_path, target, placement=placement)
        features = torch.randn(2, 9, drafter.config.feature_size, generator=torch.Generator().manual_seed(3))
        drafts.append(drafter.draft(drafter.new_cache(2, 16), features, torch.tensor([5, 7]), torch.tensor([9, 4])))
    return drafts


def test_sharded_drafter_drafts_what_the_whole_one_drafts(pair):
    whole, sharded = launch(draft_both_placements, 2, str(pair[0]), str(pair[1]))
    assert whole.shape == (2, 7, 576)
    # two float32 forwards of one drafter whose sums run in other orders (the shards' partial sums, all-reduced)
    config = DFlashConfig.from_dict(json.loads((pair[1] / "config.json").read_text()))
    torch.testing.assert_close(sharded, whole, rtol=0, atol=logit_bound(config, whole))


def assert_near(config, got, want):
    """Equal up to float32 rounding of other summation orders (chunked and whole prefill): two forwards of one
    model, apart by at most logit_bound at the tensor's largest magnitude (a layer's cache or features are sums of
    fewer terms than the logits, so the forward's bound covers them). A wrong position, mask or commit in a chunk
    moves values by the order of that magnitude."""
    torch.testing.assert_close(got, want, rtol=0, atol=logit_bound(config, want))


def test_chunked_prefill_equals_one_chunk(pair):
    model = load_target(pair[0], dtype=torch.float32)
    tokens = torch.tensor([PROMPTS[0], PROMPTS[1] + [0] * 6])
    n_valid = torch.tensor([11, 5], dtype=torch.int32)

    def prefill(chunk, logits):
        cache = model.new_cache(2, 16)
        out = model.prefill(tokens, cache, n_valid=n_valid, feature_layers=(1, 2), logits=logits, chunk=chunk)
        return out, cache

    whole, whole_cache = prefill(64, "all")
    for chunk in (1, 4):
        part, cache = prefill(chunk, "all")
        assert cache.lengths.tolist() == whole_cache.lengths.tolist() == [11, 5]
        for b, length in enumerate(n_valid.tolist()):  # the committed rows (padding rows are not)
            for got, want in [(part.logits, whole.logits), (part.features, whole.features),
                              *zip(cache.kv, whole_cache.kv)]:
                assert_near(model.config, got[b, :length], want[b, :length])
        last, _ = prefill(chunk, "last")
        assert last.logits.shape == (2, 1, model.config.vocab_size)
        assert_near(model.config, last.logits[:, 0], whole.logits[[0, 1], [10, 4]])
    assert prefill(3, "none")[0].logits is None
    with pytest.raises(ValueError, match="logits"):
        prefill(3, "every")
    with pytest.raises(ValueError, match="chunk"):
        prefill(0, "all")


def test_launcher_in_process_and_under_torchrun(pair, capsys):
    target, drafter = pair
    argv = ["--target", str(target), "--drafter", str(drafter), "--prompt", "def forward(self, x):",
            "--max-new-tokens", "4", "--budget", "8", "--device", "cpu"]
    assert main(argv + ["--tp", "1"]) == 0
    alone = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert alone[0]["new_tokens"] == 4 and isinstance(alone[0]["text"], str) and alone[-1]["tp"] == 1
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this python")
    done = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "kdtree_lib.decode",
                           *argv, "--tp", "2"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    ranked = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert ranked[0]["ids"] == alone[0]["ids"] and ranked[-1]["tp"] == 2   # rank 0 prints, once
    assert len(ranked) == len(alone)


def test_bad_paths_name_the_argument(pair, tmp_path):
    target, drafter = pair
    with pytest.raises(ValueError, match="target_path: no checkpoint"):
        generate_tp(tmp_path / "nowhere", drafter, PROMPTS, tp=1)
    with pytest.raises(ValueError, match="drafter_path: no checkpoint"):
        generate_tp(target, tmp_path, PROMPTS, tp=1)
    with pytest.raises(ValueError, match="tp"):
        generate_tp(target, drafter, PROMPTS, tp=0)
    with pytest.raises(ValueError, match="prompt_ids"):
        generate_tp(target, drafter, [[10 ** 6]], tp=1)
    with pytest.raises(MemoryPlanError, match="DOES NOT FIT"):  # refused before anything loads
        generate_tp(target, drafter, PROMPTS, tp=1, gpu_bytes=10 ** 6)


def test_checkpoint_pair_for_the_notebooks(pair, tmp_path):
    target, drafter = pair
    chosen, run = checkpoint_pair(target, drafter, prompt_tokens=6, device="cpu")
    assert run is generate and chosen.target.config.vocab_size == 576 and chosen.drafter.config.yarn is not None
    assert len(chosen.packages) >= 2 and all(len(p) == 6 and p.max() < 320 for p in chosen.prompts)
    spawned, run = checkpoint_pair(target, drafter, tp=2, prompt_tokens=6, device="cpu")
    assert run is not generate and spawned.drafter.config == chosen.drafter.config
    with pytest.raises(ValueError, match="folder: neither tiktoken.model nor tokenizer.json"):
        checkpoint_pair(target, drafter, tokenizer_path=tmp_path)
