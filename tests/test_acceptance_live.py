"""The offline oracle against live decoding on a tiny random pair: exactly equal at T = 0, the
Monte-Carlo replay within statistical error of live runs at T > 0; rows, files and plots; the pair
and prompts the notebooks run always agree."""
import json

import matplotlib
import numpy as np
import pytest
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kdtree_lib import results
from kdtree_lib.pairs import pair_with_prompts, random_pair
from kdtree_lib.decode import generate
from kdtree_lib.plots.acceptance import plot_acceptance_histogram, plot_acceptance_vs_budget
from kdtree_lib.acceptance import (SampledRecord, accepted_at_every_position, latest, live_rows,
                                   monte_carlo_acceptance, monte_carlo_rows, oracle_rows, record_oracle,
                                   record_sampled, round_lengths, sampled_accepted)

from tolerances import logit_bound, rounding_bound  # noqa: E402

VOCAB, NEW_TOKENS = 32, 40
PROMPTS = [np.array([5, 9, 2, 30, 11, 7, 1]), np.array([17]), np.array([3, 3, 8])]


@pytest.fixture(scope="module")
def pair():
    return random_pair(vocab=VOCAB, block_size=5, seed=3, draft_sharpness=0.05)


@pytest.fixture(scope="module")
def records(pair):
    target, drafter = pair
    return record_oracle(target, drafter, PROMPTS, NEW_TOKENS, k_max=64)


def test_record_layout(pair, records):
    target, drafter = pair
    depth = drafter.config.draft_depth
    ar = generate(target, drafter, PROMPTS, method="ar", max_new_tokens=NEW_TOKENS + depth)
    for prompt, record, greedy in zip(PROMPTS, records, ar.tokens):
        assert record.draft.logp.shape == (NEW_TOKENS, depth, VOCAB)  # k_max capped at the vocabulary
        assert record.tokens[0] == prompt[-1] and record.tokens[1:].tolist() == greedy.tolist()


@pytest.mark.parametrize("budget", [1, 4, 16, 48])
@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_oracle_equals_live_decode_at_t0(pair, records, budget, mode):
    target, drafter = pair
    live = generate(target, drafter, PROMPTS, method="ddtree" if mode == "tree" else "chain", budget=budget,
                    max_new_tokens=NEW_TOKENS)
    oracle = [round_lengths(accepted_at_every_position(record, budget, mode=mode), NEW_TOKENS) for record in records]
    assert oracle == [a.tolist() for a in live.acceptance]
    if mode == "tree" and budget == 48:
        assert min(min(r) for r in oracle) >= 2


def test_oracle_on_torch_tensors_equals_numpy(records):
    on_torch = records[0].to_torch("cpu")
    assert isinstance(on_torch.tokens, torch.Tensor)
    for budget in (3, 40):
        assert (accepted_at_every_position(on_torch, budget) == accepted_at_every_position(records[0], budget)).all()


# ----------------------------------------------------------------------------------------------
# T > 0

def test_monte_carlo_walk_matches_its_exact_expectation():
    """Root with children a (p .5) and b (p .3); a has child c (p .6): E[length] = 1 + .8 + .5 * .6."""
    parents = np.array([[-1, 0, 0, 1]] * 5, np.int32)
    probs = np.array([[1.0, 0.5, 0.3, 0.6]] * 5, np.float32)
    record = SampledRecord(parents, np.array([[0, 1, 2, 3]] * 5, np.int32), probs, temperature=1.0)
    lengths = sampled_accepted(record, 3, 4000, np.random.default_rng(0))
    assert abs(lengths.mean() - 2.1) < 4 * lengths.std() / np.sqrt(lengths.size)
    one_node = sampled_accepted(record, 1, 4000, np.random.default_rng(0))  # budget 1: a alone, E = 1.5
    assert abs(one_node.mean() - 1.5) < 4 * one_node.std() / np.sqrt(one_node.size)
    with pytest.raises(ValueError, match="budget: at most the recorded budget 3"):
        sampled_accepted(record, 4, 10, np.random.default_rng(0))


def test_sampled_record_holds_the_targets_probabilities(pair):
    target, drafter = pair
    temperature = 2.0
    record = record_sampled(target, drafter, [PROMPTS[0]], 3, budget=40, temperature=temperature)[0]
    prompt = torch.as_tensor(PROMPTS[0])[None]
    logits = target.prefill(prompt, target.new_cache(1, len(PROMPTS[0]))).logits[0, -1]
    probs = torch.softmax(logits / temperature, -1).numpy()
    depth_one = record.parents[0] == 0
    assert depth_one.sum() > 1 and record.node_probs[0, 0] == 1
    # the record's verify and this prefill are two float32 forwards: logits apart by at most logit_bound,
    # so probabilities by at most 2 p dz / T (d softmax(z / T)_i = p_i (dz_i - sum_j p_j dz_j) / T)
    bound = 2 * float(probs.max()) * logit_bound(target.config, logits) / temperature
    error = np.abs(record.node_probs[0, depth_one] - probs[record.tokens[0, depth_one]]).max()
    assert error <= bound, (error, bound)
    # siblings' probabilities are part of one softmax: their float32 sum passes 1 only by its rounding
    assert record.node_probs[0, depth_one].sum() <= 1 + rounding_bound(np.float32, terms=VOCAB, magnitude=1)


def test_monte_carlo_replay_agrees_with_live_runs_at_t_positive():
    target, drafter = random_pair(vocab=VOCAB, block_size=5, seed=3, draft_sharpness=0.3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, size=int(n)) for n in rng.integers(1, 8, size=6)]
    temperature = 1.0
    sampled = [r for seed in (1, 2) for r in record_sampled(target, drafter, prompts, 48, budget=16,
                                                            temperature=temperature, seed=seed)]
    for budget in (4, 16):
        replay, replay_error, _ = monte_carlo_acceptance(sampled, budget, n_samples=32)
        live = [generate(target, drafter, prompts, budget=budget, max_new_tokens=48, temperature=temperature,
                         seed=seed).mean_acceptance for seed in range(4)]
        live_mean, live_error = np.mean(live), np.std(live, ddof=1) / 2
        print(f"budget {budget}: replay {replay:.3f} ± {replay_error:.3f}, live {live_mean:.3f} ± {live_error:.3f}")
        # the replay's error bar covers only the walk; one recorded trajectory per prompt adds a few %
        assert abs(replay - live_mean) < 4 * np.hypot(replay_error, live_error) + 0.05 * live_mean
        assert replay > 1.05


# ----------------------------------------------------------------------------------------------
# rows, files, plots

def test_rows_go_to_the_results_file_and_plot(pair, records, tmp_path):
    target, drafter = pair
    rows = oracle_rows(records, [1, 8, 48], package="random", block_size=5, n_new_tokens=NEW_TOKENS, progress=False)
    rows += live_rows(target, drafter, PROMPTS, [8, 48], package="random", max_new_tokens=NEW_TOKENS, progress=False)
    sampled = record_sampled(target, drafter, PROMPTS[:2], 12, budget=8, temperature=1.0)
    rows += monte_carlo_rows(sampled, [4, 8], package="random", block_size=5, n_samples=8, progress=False)
    path = results.append_rows("acceptance", rows, results_dir=tmp_path)
    stored = results.read_rows("acceptance", results_dir=tmp_path)
    assert path.exists() and len(stored) == len(rows) == 7
    oracle = {int(r["budget"]): float(r["mean_acceptance"]) for r in latest(stored, source="oracle")}
    live = {int(r["budget"]): float(r["mean_acceptance"]) for r in latest(stored, source="live")}
    assert oracle[8] == live[8] and oracle[48] == live[48] and oracle[48] > oracle[1] >= 1.0
    histogram = json.loads(latest(stored, source="oracle", budget=48)[0]["histogram"])
    assert sum(histogram) == int(latest(stored, source="oracle", budget=48)[0]["rounds"]) and histogram[0] == 0
    fig, axes = plt.subplots(1, 2)
    plot_acceptance_vs_budget(axes[0], latest(stored, temperature=0.0), title="t")
    plot_acceptance_histogram(axes[1], latest(stored, source="oracle"), title="h")
    assert len(axes[0].lines) >= 2 and len(axes[1].patches) > 0
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# the pair and its prompts, decided together

def test_without_checkpoints_a_random_pair_gets_random_prompts_in_its_vocabulary(tmp_path):
    chosen = pair_with_prompts(16, prompts_per_package=2, prompt_tokens=9, models_dir=tmp_path, vocab=48)
    assert not chosen.stand_in and "RANDOM" in chosen.description and list(chosen.packages) == ["random"]
    assert len(chosen.prompts) == 4 and all(len(p) == 9 and p.max() < 48 for p in chosen.prompts)
    assert chosen.drafter.config.block_size == 16 and chosen.target.config.vocab_size == 48
    assert generate(chosen.target, chosen.drafter, chosen.prompts, max_new_tokens=2).new_tokens == 8


def test_the_stand_in_pair_gets_the_held_out_prompts():
    chosen = pair_with_prompts(8, prompts_per_package=1, prompt_tokens=12)
    if not chosen.stand_in:
        pytest.skip("the stand-in pair's checkpoints are not in data/models")
    assert chosen.name == "k26-mini+k26-mini-dflash" and "random" not in chosen.packages
    vocab = chosen.target.config.vocab_size
    assert all(len(p) == 12 and 0 <= p.min() and p.max() < vocab for p in chosen.prompts)
    assert [p.tolist() for p in chosen.prompts[:len(chosen.packages)]] == \
        [group[0].tolist() for group in chosen.packages.values()], "packages interleaved"


def test_the_command_line_sweep_rows_carry_their_size(tmp_path):
    """python -m kdtree_lib.acceptance rows name prompt_tokens and new_tokens, so largest_measurement ranks
    a bigger sweep above a smaller one appended later."""
    from kdtree_lib import acceptance, results
    common = ["--block-sizes", "8", "--budgets", "2", "4", "--live-budgets", "2", "--prompt-tokens", "16",
              "--temperature", "0", "--results-dir", str(tmp_path)]
    assert acceptance.main(common + ["--prompts-per-package", "1", "--new-tokens", "8"]) == 0
    assert acceptance.main(common + ["--prompts-per-package", "1", "--new-tokens", "4"]) == 0
    rows = results.read_rows(acceptance.TOPIC, results_dir=tmp_path)
    assert all(r["new_tokens"] in ("8", "4") and r["prompt_tokens"] == "16" for r in rows)
    picked = acceptance.largest_measurement(rows, source="oracle", mode="tree", block_size=8)
    assert picked and {r["new_tokens"] for r in picked} == {"8"}
