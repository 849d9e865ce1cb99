"""Training a stand-in pair: a tiny end-to-end CPU run in the real formats (K2.6's layout with INT4
experts, the real drafter's config keys), a run cut twice and resumed to the same pair, and the pieces
of the recipe (bias balancing, anchors, labels, position weights, metrics, schedule)."""
import csv
import json
import math
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from kdtree_lib import pairs, standin, train
from kdtree_lib.decode import generate
from kdtree_lib.dflash import load_drafter
from kdtree_lib.model import ModelConfig, load_target
from kdtree_lib.model.reference import CONFIG_DIR
from tolerances import logit_bound

REPO = Path(__file__).resolve().parent.parent
PAIR = standin.DEEP
FOLDERS = (PAIR, f"{PAIR}-dflash", f"{PAIR}-dflash-b16")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A corpus made of this repository's own source (train: the library, held out: the tests)."""
    folder = tmp_path_factory.mktemp("corpus")
    for split, source in (("train", "kdtree_lib"), ("heldout", "tests")):
        with open(folder / f"corpus-{split}.jsonl", "w") as f:
            for path in sorted((REPO / source).glob("*.py")):
                f.write(json.dumps({"package": source, "path": path.name, "text": path.read_text()}) + "\n")
    return folder


def tiny_args(corpus, out) -> list[str]:
    """The tiny run; its time budgets so large that the schedule follows the steps alone (a run that
    runs out of time anneals by the clock, which no two runs share), so runs repeat bit for bit."""
    return ["all", "--tiny", "--steps", "5", "--max-minutes", "1e9", "--drafter-minutes", "1e9", "--corpus", str(corpus),
            "--out", str(out), "--block-sizes", "8", "16"]


@pytest.fixture(scope="module")
def models(corpus, tmp_path_factory):
    """`train all --tiny` in one uncut call."""
    out = tmp_path_factory.mktemp("run") / "models"
    assert train.main(tiny_args(corpus, out)) == 0
    return out


def test_target_checkpoint_format(models):
    target = models / PAIR
    raw = json.loads((target / "config.json").read_text())
    config = ModelConfig.from_dict(raw)  # the project's own reader accepts it
    kimi = json.loads((CONFIG_DIR / "kimi-k2.6.json").read_text())
    assert set(raw) == {"architectures", "model_type", "text_config"} and raw["model_type"] == kimi["model_type"]
    assert set(raw["text_config"]) == set(kimi["text_config"])  # every K2.6 key, no other
    for key in ("scoring_func", "topk_method", "routed_scaling_factor", "norm_topk_prob", "rope_scaling", "rope_theta",
                "first_k_dense_replace", "n_shared_experts", "n_group", "topk_group", "kv_lora_rank", "qk_rope_head_dim"):
        assert raw["text_config"][key] == kimi["text_config"][key], key  # K2.6's routing, YaRN, MLA latent
    assert config.quantization is not None and config.rope_factor == 64 and config.first_k_dense_replace == 1
    index = json.loads((target / "model.safetensors.index.json").read_text()) if (
        target / "model.safetensors.index.json").is_file() else None
    shards = list(target.glob("*.safetensors"))
    assert shards and all(s.stat().st_size <= 16_000_000 for s in shards)
    names = {}
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            names.update({n: f.get_tensor(n) for n in f.keys()})
    assert index is None or set(index["weight_map"]) == set(names)
    assert all(n.startswith("language_model.") for n in names)
    bias = [t for n, t in names.items() if n.endswith("e_score_correction_bias")]
    assert bias and all(b.dtype == torch.float32 and b.abs().sum() > 0 for b in bias)  # balanced, kept fp32
    assert all(t.dtype == torch.bfloat16 for n, t in names.items() if n.endswith("q_a_proj.weight"))
    packed = [t for n, t in names.items() if n.endswith(".mlp.experts.0.gate_proj.weight_packed")]
    assert len(packed) == config.num_hidden_layers - 1 and all(t.dtype == torch.int32 for t in packed)
    assert not any(".experts.0.gate_proj.weight" == n[-len(".experts.0.gate_proj.weight"):] for n in names)
    assert any("shared_experts.gate_proj.weight" in n and names[n].dtype == torch.bfloat16 for n in names)
    assert (target / "tokenizer.json").is_file()


def test_written_target_computes_what_was_trained(tmp_path):
    """The K2.6-format writer is faithful: the kdtree loader's logits on the INT4 checkpoint equal
    transformers' model rounded in place to what is stored (round_as_stored)."""
    torch.manual_seed(0)
    settings = train.Settings(out=tmp_path, corpus=tmp_path, tiny=True)
    text = train.text_config(settings, 512, 0)
    model = train.hf_target(text).eval()
    with torch.no_grad():
        for name, tensor in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(0.1 * torch.randn(tensor.shape))
    before = [t.clone() for n, t in model.named_parameters() if ".mlp.experts." in n]
    train.round_as_stored(model)
    after = [t for n, t in model.named_parameters() if ".mlp.experts." in n]
    assert all(not torch.equal(a, b) for a, b in zip(after, before))  # rounded
    train.write_target(model, text, tmp_path / "target")
    ours = load_target(tmp_path / "target", dtype=torch.float32, attention="naive", attention_backend="torch")
    assert ours.config.quantization is not None
    tokens = torch.randint(0, 512, (2, 12))
    with torch.no_grad():
        want = model(tokens).logits
    got = ours.prefill(tokens, ours.new_cache(2, 16)).logits
    torch.testing.assert_close(got, want, rtol=0, atol=logit_bound(ours.config, want))


def test_drafter_checkpoints(models):
    target = load_target(models / PAIR, dtype=torch.float32, attention="naive", attention_backend="torch")
    real = json.loads((CONFIG_DIR / "kimi-k2.6-dflash.json").read_text())
    for folder, block in ((f"{PAIR}-dflash", 8), (f"{PAIR}-dflash-b16", 16)):
        raw = json.loads((models / folder / "config.json").read_text())
        assert set(raw) == set(real) and raw["rope_scaling"] == real["rope_scaling"]  # the real drafter's keys, YaRN
        assert raw["block_size"] == block and raw["dflash_config"]["mask_token_id"] == 8191
        assert raw["num_target_layers"] == target.config.num_hidden_layers
        drafter = load_drafter(models / folder, target)
        assert drafter.config.yarn is not None and drafter.config.target_layer_ids == (1, 2)
        features = torch.zeros(1, 3, drafter.config.feature_size)
        logits = drafter.draft(drafter.new_cache(1, 8), features, torch.tensor([5]))
        assert logits.shape == (1, block - 1, 8192) and torch.isfinite(logits).all()
        assert (models / folder / "tokenizer.json").resolve() == (models / PAIR / "tokenizer.json").resolve()


def test_the_pair_loads_by_name_and_decodes_losslessly(models):
    chosen = pairs.pair_with_prompts(8, models_dir=models, pair=PAIR, prompt_tokens=12)
    assert chosen.stand_in and chosen.name == f"{PAIR}+{PAIR}-dflash"
    assert chosen.target.config.quantization is not None  # INT4 experts as stored
    prompt = chosen.prompts[0]
    runs = {method: generate(chosen.target, chosen.drafter, prompt, method=method, budget=1 if method == "ar" else 8,
                             temperature=0.0, max_new_tokens=10).tokens[0].tolist() for method in ("ar", "chain", "ddtree")}
    assert len(runs["ar"]) == 10 and runs["chain"] == runs["ar"] and runs["ddtree"] == runs["ar"]
    with pytest.raises(ValueError, match="pair"):
        pairs.stand_in_paths(8, models, pair="k26-nope")
    assert pairs.stand_in_paths(8)[0].name == pairs.DEFAULT_PAIR == "k26-mini"  # the committed pair stays the default


def test_logs(models):
    for folder, accuracy_columns in ((PAIR, 0), (f"{PAIR}-dflash", 7), (f"{PAIR}-dflash-b16", 15)):
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
    result = json.loads((models / PAIR / "eval.json").read_text())
    assert "heldout_perplexity" in result and math.isfinite(result["stored_heldout_loss"])
    assert sorted(p.name for p in models.iterdir()) == sorted(FOLDERS)  # published, the work folder gone


def tensors(folder: Path) -> dict:
    out = {}
    for shard in folder.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            out.update({n: f.get_tensor(n) for n in f.keys()})
    return out


def cut_after(calls: int):
    """A function that raises KeyboardInterrupt (a cut) on its `calls`-th call, else calls `original`."""
    def wrap(original):
        count = [0]

        def cut(*args, **kwargs):
            count[0] += 1
            if count[0] == calls:
                raise KeyboardInterrupt
            return original(*args, **kwargs)
        return cut
    return wrap


def sigterm_on_block_16_step(step: int, original):
    """drafter_step_outputs that sends this process SIGTERM during the block-16 drafter's `step`."""
    count = [0]

    def outputs(target, drafter, *args):
        if drafter.config.block_size == 16:
            count[0] += 1
            if count[0] == step:
                os.kill(os.getpid(), signal.SIGTERM)
        return original(target, drafter, *args)
    return outputs


def test_a_cut_run_resumes_to_the_same_pair(models, corpus, tmp_path, monkeypatch, capsys):
    """Cut hard in the target's step 4 and in the block-8 drafter's step 4 (states saved at step 2),
    then stopped by SIGTERM in the block-16 drafter's step 3 (its state saved there): the same
    command then finishes, and the pair is the uncut run's, tensor for tensor."""
    out = tmp_path / "models"
    args = tiny_args(corpus, out)
    work = out / f".{PAIR}.training"
    with monkeypatch.context() as patch:
        patch.setattr(train.RouterBalancer, "update", cut_after(4)(train.RouterBalancer.update))
        with pytest.raises(KeyboardInterrupt):
            train.main(args)
    assert not (out / PAIR).exists() and torch.load(work / "target.state.pt", weights_only=False)["step"] == 2
    assert train.main([*args[:-3], "--block-sizes", "8"]) == 2  # other settings: refused, the cut run kept
    assert "--restart" in capsys.readouterr().err
    with monkeypatch.context() as patch:
        patch.setattr(train, "sample_anchors", cut_after(4)(train.sample_anchors))
        with pytest.raises(KeyboardInterrupt):
            train.main(args)
    assert (work / PAIR / "config.json").is_file() and not (out / PAIR).exists()  # staged, not published
    with monkeypatch.context() as patch:  # SIGTERM in the block-16 drafter's step 3: saved there, status 3
        patch.setattr(train, "drafter_step_outputs", sigterm_on_block_16_step(3, train.drafter_step_outputs))
        assert train.main(args) == train.EXIT_STOPPED
    assert torch.load(work / f"{PAIR}-dflash-b16.state.pt", weights_only=False)["step"] == 3
    assert (work / f"{PAIR}-dflash" / "config.json").is_file() and not (out / PAIR).exists()
    assert train.main(args) == 0
    assert "resuming at step 3" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == sorted(FOLDERS)
    for folder in FOLDERS:
        want, got = tensors(models / folder), tensors(out / folder)
        assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want), folder
        logs = [list(csv.DictReader(open(root / folder / "train_log.csv"))) for root in (models, out)]
        assert [{k: v for k, v in r.items() if k != "elapsed_s"} for r in logs[0]] == \
            [{k: v for k, v in r.items() if k != "elapsed_s"} for r in logs[1]]
    assert train.main(args) == 2  # a trained pair is replaced only with --retrain
    assert "--retrain" in capsys.readouterr().err
    elsewhere = tmp_path / "elsewhere"
    assert train.main(["all", "--tiny", "--corpus", str(tmp_path / "no-corpus"), "--out", str(elsewhere)]) == 2
    assert "corpus-train.jsonl" in capsys.readouterr().err and not elsewhere.exists()  # refused, nothing made


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
    """k26-deep: K2.6's layout at 16 layers, checkpoints of at most 48 MB together (INT4 experts as
    stored), the drafter's features spread over the depth, K2.6's cache entry and softmax scale."""
    from kdtree_lib.dflash import DFlashDrafter
    from kdtree_lib.model.costs import parameter_table
    from kdtree_lib.moe import plan_moe
    shape = standin.shape_of(PAIR)
    configs = standin.pair_configs(shape)
    target, drafter = configs.target, configs.drafter
    mini = standin.current_configs().target
    assert target.num_hidden_layers == 16 > mini.num_hidden_layers  # deeper, and narrower but in the hidden size
    assert all(getattr(target, k) < getattr(mini, k) for k in ("num_attention_heads", "q_lora_rank", "intermediate_size",
                                                                "moe_intermediate_size"))
    assert target.first_k_dense_replace == 1 and target.n_shared_experts == 1 and target.quantization is not None
    assert standin.target_bytes(target) + standin.drafter_bytes(drafter) <= standin.CHECKPOINT_BUDGET_BYTES
    with torch.device("meta"):  # the byte count covers every parameter the trained models have
        hf = train.hf_target(shape.text_config(8192, 0))
        assert sum(p.numel() for p in hf.parameters()) == sum(r["params"] for r in parameter_table(target))
        assert sum(p.numel() for p in DFlashDrafter(drafter).parameters()) * 2 == standin.drafter_bytes(drafter)
    assert drafter.target_layer_ids == (1, 4, 6, 9, 11, 14) and drafter.yarn is not None
    assert drafter.num_hidden_layers / target.num_hidden_layers <= 0.2  # the real pair's 6 / 61 = 0.10
    kimi = ModelConfig.from_dict(json.loads((CONFIG_DIR / "kimi-k2.6.json").read_text()))
    assert target.cache_dim == kimi.cache_dim == 576 and target.softmax_scale == pytest.approx(kimi.softmax_scale)
    assert target.absorbable  # the verify kernels run it
    for smem in (99 * 1024, 227 * 1024):  # the INT4 MoE kernel has a plan for every verify size, box and H200
        for tokens in (1, 8, 9, 33, 8 * 33, 8 * 129):
            plan_moe(tokens, target.hidden_size, target.moe_intermediate_size, smem_per_block=smem)
    settings = train.Settings(out=Path(), corpus=Path())
    assert settings.max_minutes + settings.drafter_minutes <= 8  # training time: the run fits a 10-minute command


def test_full_size_checkpoints_on_disk(tmp_path):
    """The written full-size pair (fresh weights: the sizes do not depend on them): shards under 16 MB,
    target and drafter with the index at most 48 MB, and the target loads through the project's reader."""
    from kdtree_lib.dflash import DFlashDrafter, save_drafter
    settings = train.Settings(out=tmp_path, corpus=tmp_path)
    text = train.text_config(settings, 8192, 0)
    train.write_target(train.hf_target(text), text, tmp_path / PAIR)
    drafter = DFlashDrafter(standin.pair_configs(standin.shape_of(PAIR)).drafter)
    save_drafter(drafter, tmp_path / f"{PAIR}-dflash")
    shards = list(tmp_path.glob("*/*.safetensors"))
    assert len(shards) >= 4 and all(s.stat().st_size <= 16_000_000 for s in shards)
    total = train.checkpoint_mb(tmp_path / PAIR) + train.checkpoint_mb(tmp_path / f"{PAIR}-dflash")
    assert total <= standin.CHECKPOINT_BUDGET_BYTES / 1e6
    assert ModelConfig.from_dict(json.loads((tmp_path / PAIR / "config.json").read_text())).n_routed_experts == 32


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
        assert row["package"] == "heldout" and row["pair"] == f"{PAIR}+{PAIR}-dflash" and row["new_tokens"] == "6"
        assert 1 <= float(row["mean_acceptance"]) <= 8
