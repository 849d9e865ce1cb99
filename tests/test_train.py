"""Training the stand-in pair: a tiny end-to-end CPU run (both stages, both formats), and the
pieces of the recipe (bias balancing, anchors, labels, position weights, metrics, schedule)."""
import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import DeepseekV3ForCausalLM

from kdtree_lib import pairs, train
from kdtree_lib.dflash import load_drafter
from kdtree_lib.model import ModelConfig, load_target
from tolerances import logit_bound

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """`train all --tiny --steps 5` on a corpus made of this repository's own source."""
    root = tmp_path_factory.mktemp("run")
    corpus = root / "corpus"
    corpus.mkdir()
    for split, folder in (("train", "kdtree_lib"), ("heldout", "tests")):
        with open(corpus / f"corpus-{split}.jsonl", "w") as f:
            for path in sorted((REPO / folder).glob("*.py")):
                f.write(json.dumps({"package": folder, "path": path.name, "text": path.read_text()}) + "\n")
    assert train.main(["all", "--tiny", "--steps", "5", "--corpus", str(corpus), "--out", str(root / "models"),
                       "--block-sizes", "8", "16"]) == 0
    return root / "models"


def test_target_checkpoint_format(models):
    target = models / "k26-mini"
    raw = json.loads((target / "config.json").read_text())
    config = ModelConfig.from_dict(raw)  # the project's own reader accepts it
    assert raw["architectures"] == ["DeepseekV3ForCausalLM"] and raw["scoring_func"] == "sigmoid"
    assert config.first_k_dense_replace == 1 and config.n_shared_experts == 1 and config.rope_factor > 1
    shards = list(target.glob("*.safetensors"))
    assert shards and all(s.stat().st_size <= 16_000_000 for s in shards)
    with safe_open(str(shards[0]), "pt") as f:
        names = list(f.keys())
        bias = [f.get_tensor(n) for n in names if n.endswith("e_score_correction_bias")]
        weights = [f.get_tensor(n) for n in names if n.endswith("q_a_proj.weight")]
    assert bias and all(b.dtype == torch.float32 and b.abs().sum() > 0 for b in bias)  # balanced, kept fp32
    assert all(w.dtype == torch.bfloat16 for w in weights)
    assert any(".mlp.experts.0.gate_proj.weight" in n for n in names)  # per-expert tensors, as K2.6 ships
    assert (target / "tokenizer.json").is_file()


def test_transformers_and_kdtree_load_the_same_logits(models):
    path = models / "k26-mini"
    hf = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_target(path, dtype=torch.float32, attention="naive", attention_backend="torch")
    tokens = torch.randint(0, 8191, (2, 12))
    with torch.no_grad():
        want = hf(tokens).logits
    got = ours.prefill(tokens, ours.new_cache(2, 16)).logits
    torch.testing.assert_close(got, want, rtol=0, atol=logit_bound(ours.config, want))


def test_drafter_checkpoints(models):
    target = DeepseekV3ForCausalLM.from_pretrained(models / "k26-mini", dtype=torch.float32).eval()
    for folder, block in (("k26-mini-dflash", 8), ("k26-mini-dflash-b16", 16)):
        raw = json.loads((models / folder / "config.json").read_text())
        assert raw["block_size"] == block and raw["dflash_config"]["mask_token_id"] == 8191
        drafter = load_drafter(models / folder, target)
        features = torch.zeros(1, 3, drafter.config.feature_size)
        logits = drafter.draft(drafter.new_cache(1, 8), features, torch.tensor([5]))
        assert logits.shape == (1, block - 1, 8192) and torch.isfinite(logits).all()
        assert (models / folder / "tokenizer.json").resolve() == (models / "k26-mini" / "tokenizer.json").resolve()


def test_logs(models):
    for folder, accuracy_columns in (("k26-mini", 0), ("k26-mini-dflash", 7), ("k26-mini-dflash-b16", 15)):
        with open(models / folder / "train_log.csv") as f:
            rows = list(csv.DictReader(f))
        assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5]
        assert sum(c.startswith("acc_") for c in rows[0]) == accuracy_columns
        assert all(math.isfinite(float(r["loss"])) for r in rows)
        assert rows[-1].get("heldout_loss", rows[-1].get("heldout_accept_tf")) != ""
        result = json.loads((models / folder / "eval.json").read_text())
        assert result["steps"] == 5 and result["settings"]["tiny"] is True
        columns, same = train.read_stage(models / folder)
        assert same == result and columns["step"].tolist() == [1, 2, 3, 4, 5]
        heldout = columns.get("heldout_loss", columns.get("heldout_accept_tf"))
        assert np.isnan(heldout[0]) and np.isfinite(heldout[-1])
    assert train.read_stage(models / "absent") is None
    assert "heldout_perplexity" in json.loads((models / "k26-mini" / "eval.json").read_text())


class FakeRouter(torch.nn.Module):
    """Routes every token to experts 0 and 1: the balancer must push their bias down."""

    def __init__(self):
        super().__init__()
        self.e_score_correction_bias = torch.nn.Buffer(torch.zeros(4))

    def forward(self, x):
        ids = torch.tensor([[0, 1]]).expand(len(x), 2)
        return None, None, ids


def test_router_balancer():
    router = FakeRouter().train()
    balancer = train.RouterBalancer(router, rate=0.01)
    router(torch.zeros(6, 3))
    violation = balancer.update()
    assert torch.equal(router.e_score_correction_bias, torch.tensor([-0.01, -0.01, 0.01, 0.01]))  # 0 +- rate: exact
    assert violation.item() == pytest.approx(1.0)  # load (6, 6, 0, 0): max/mean - 1
    router.eval()(torch.zeros(6, 3))  # evaluation forwards are not counted
    assert balancer.loads[0].sum() == 0


def test_anchors_labels_weights_metrics():
    anchors = train.sample_anchors(3, 20, 5, torch.Generator().manual_seed(0))
    assert anchors.shape == (3, 5) and anchors.min() >= 1 and anchors.max() <= 18
    assert all(len(set(row.tolist())) == 5 and row.tolist() == sorted(row.tolist()) for row in anchors)

    rows = torch.arange(10)[None] + 100                       # token at position p is 100 + p
    greedy = torch.arange(10)[None] + 200                     # target's prediction for p + 1 is 200 + p
    anchors = torch.tensor([[2, 7]])
    data, valid = train.block_labels(rows, greedy, anchors, 4, "data")
    target, _ = train.block_labels(rows, greedy, anchors, 4, "target")
    assert data[0, 0].tolist()[1:] == [103, 104, 105] and target[0, 0].tolist()[1:] == [202, 203, 204]
    assert valid.tolist() == [[[False, True, True, True], [False, True, True, False]]]

    weights = train.position_weights(8, "cpu")
    assert weights[0] == 0 and weights[1] == 1 and weights[2] == pytest.approx(math.exp(-1 / 4))
    assert train.position_weights(16, "cpu")[3] == pytest.approx(math.exp(-2 / 7))

    labels = torch.tensor([[[9, 1, 2, 3], [9, 1, 2, 3]]])
    logits = torch.nn.functional.one_hot(torch.tensor([[[0, 1, 0, 3], [0, 1, 2, 3]]]), 10).float()
    metrics = train.block_metrics(logits, labels, torch.ones(1, 2, 4, dtype=torch.bool))
    assert metrics["accuracy"] == [1.0, 0.5, 1.0]
    assert metrics["accept_tf"] == pytest.approx(1 + (1 + 3) / 2)


def test_schedule_and_batches():
    assert train.learning_rate(1.0, 0, 100, 10, 0, 60) == pytest.approx(0.1)
    assert train.learning_rate(1.0, 10, 100, 10, 0, 60) == pytest.approx(1.0)
    assert train.learning_rate(1.0, 99, 100, 10, 0, 60) == pytest.approx(0.1, abs=1e-3)
    assert train.learning_rate(1.0, 20, 100, 10, 60, 60) == pytest.approx(0.1)  # out of time: annealed
    tokens = np.arange(1000, dtype=np.uint16)
    first = train.Batches(tokens, 16, 4, seed=3).next("cpu")
    assert torch.equal(first, train.Batches(tokens, 16, 4, seed=3).next("cpu"))
    assert first.shape == (4, 17) and torch.equal(first[:, 1:] - first[:, :-1], torch.ones(4, 16, dtype=torch.long))
    assert train.fixed_windows(tokens, 16, 3)[:, 0].tolist() == [0, 491, 982]


def test_full_size_pair_fits_the_issue_budget():
    """K2.6-shaped target of 10-30M parameters; target + block-8 drafter at most 48 MB in bf16."""
    settings = train.Settings(out=Path(), corpus=Path())
    config = train.target_config(settings, 8192, 0)
    with torch.device("meta"):
        target = DeepseekV3ForCausalLM(config)
        drafter = train.DFlashDrafter(train.drafter_config(settings, config, 8, 8191))
    target_params = sum(p.numel() for p in target.parameters())
    drafter_params = sum(p.numel() for p in drafter.parameters())
    assert 10e6 <= target_params <= 30e6
    assert 2 * (target_params + drafter_params) <= 48e6
    assert drafter.config.target_layer_ids == (1, 2, 3, 4) and config.first_k_dense_replace == 1
    # the absorbed cache entry and the softmax scale are K2.6's own (what the verify kernels assume)
    ours, kimi = (ModelConfig.from_dict(raw) for raw in (
        config.to_dict(), json.loads((REPO / "data" / "configs" / "kimi-k2.6.json").read_text())))
    assert ours.cache_dim == kimi.cache_dim == 576 and ours.softmax_scale == pytest.approx(kimi.softmax_scale)


def test_acceptance_rows_on_committed_prompts(models, tmp_path, monkeypatch):
    prompts = pairs.load_prompts(3, 20)
    assert len(prompts) == 3 and all(p.dtype == np.int64 and len(p) == 20 for p in prompts)
    with pytest.raises(ValueError, match="count"):
        pairs.load_prompts(65, 20)
    monkeypatch.setenv("KDTREE_RESULTS_DIR", str(tmp_path))
    assert train.main(["acceptance", "--out", str(models), "--block-sizes", "8", "32", "--prompts", "2",
                       "--prompt-tokens", "16", "--new-tokens", "6"]) == 0
    with open(tmp_path / "acceptance.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["mode"], int(r["budget"])) for r in rows] == [(m, b) for m in ("chain", "tree") for b in (8, 32, 128)]
    for row in rows:
        assert row["package"] == "heldout" and row["pair"] == "k26-mini+k26-mini-dflash" and row["new_tokens"] == "6"
        assert 1 <= float(row["mean_acceptance"]) <= 8
