"""The TP verify-step benchmark at a tiny config over gloo, the router-overlap fit, the CT200 projection."""
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from kdtree_lib import pairs, projection
from kdtree_lib.bench import tp_step
from kdtree_lib.bench.inputs import RandomWeights, random_target
from kdtree_lib.bench.tp_step import BenchSettings, drafter_config, run_tp_bench
from kdtree_lib.projection import acceptance_curve, calibrate_on_rows, drafter_efficiency, drafter_seconds, select_rows
from kdtree_lib.routing import fit_correlation, routed_experts, union_curve
from kdtree_lib.model import ModelConfig, TensorParallel, load_config
from kdtree_lib.projection import CT200, Efficiency, expected_distinct_experts, layer_costs, step_costs
from kdtree_lib.results import read_rows
from tolerances import logit_bound, rounding_bound

K26 = load_config(Path(__file__).resolve().parent.parent / "data" / "configs" / "kimi-k2.6.json")
NODES = (1, 6)


def tiny_model_config() -> ModelConfig:
    """The one tiny config, with K2.6's switches."""
    return ModelConfig.from_dict(pairs.tiny_config())


@pytest.fixture(scope="module")
def tiny():
    return tiny_model_config()


def tiny_settings(**overrides) -> BenchSettings:
    config = tiny_model_config()
    drafter = drafter_config(config, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate=32, block_size=4,
                             feature_layers=1)
    settings = BenchSettings(config=config, layers=3, batches=(1, 2), nodes=NODES, contexts=(8,), device="cpu",
                             dtype="float32", graphs=False, repeats=2, warmup=1, drafter=drafter, topic=None,
                             check=True)
    return replace(settings, **overrides)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    results_dir = tmp_path_factory.mktemp("results")
    one = run_tp_bench(tiny_settings(), world_size=1)
    two = run_tp_bench(tiny_settings(topic="tp_verify_step", results_dir=str(results_dir)), world_size=2)
    return one, two, results_dir


def test_tp2_over_gloo_equals_tp1_and_the_segmented_step_is_the_model(runs, tiny):
    one, two, _ = runs
    for run in (one, two):
        torch.testing.assert_close(run["check"]["segmented"], run["check"]["verify"], rtol=0,
                                   atol=logit_bound(tiny, run["check"]["verify"]))
    torch.testing.assert_close(two["check"]["segmented"], one["check"]["segmented"], rtol=0,
                               atol=logit_bound(tiny, one["check"]["segmented"]))
    assert one["check"]["verify"].shape == (1, max(NODES), tiny.vocab_size)


def test_timing_rows_are_well_formed(runs, tiny):
    one, two, results_dir = runs
    for run, degree in ((one, 1), (two, 2)):
        rows = run["rows"]
        for batch in (1, 2):
            for nodes in NODES:
                mine = [r for r in rows if (r["batch"], r["nodes"]) == (batch, nodes)]
                layers = sorted((r for r in mine if r["scope"] == "layer"), key=lambda r: r["layer"])
                assert [r["moe_layer"] for r in layers] == [False, True, True]  # the dense first layer
                for row in layers:
                    assert row["tp"] == degree and row["graph"] is False and row["attention_backend"] == "torch"
                    parts = [row[f"{c}_seconds"] for c in projection.COMPONENTS]
                    assert all(p >= 0 for p in parts) and row["attention_seconds"] > 0 and row["moe_seconds"] > 0
                    assert (row["allreduce_seconds"] > 0) == (degree > 1)
                    assert sum(parts) == pytest.approx(row["layer_seconds"], rel=0.5)  # medians of sums vs sums
                for row in layers[1:]:
                    k, experts = tiny.num_experts_per_tok, tiny.n_routed_experts
                    assert k <= row["experts_touched"] <= min(experts, batch * nodes * k)
                    assert row["router_seconds"] > 0 and row["experts_seconds"] > 0 and row["shared_seconds"] > 0
                assert layers[0]["router_seconds"] == ""
                [step] = [r for r in mine if r["scope"] == "step"]
                assert step["step_seconds"] > 0 and step["head_seconds"] > 0
                drafts = [r for r in mine if r["scope"] == "draft"]
                assert len(drafts) == (nodes > 1) and all(r["drafter_seconds"] > 0 for r in drafts)
    written = read_rows("tp_verify_step", results_dir=results_dir)
    assert len(written) == len(two["rows"]) and {r["scope"] for r in written} == {"layer", "step", "draft"}
    hardware = replace(CT200, name="test", gpus=2)
    fitted = projection.calibrate(select_rows(written, "layer", graph=False), tiny, hardware)
    assert fitted.attention > 0 and fitted.moe > 0


def test_layers_scale_to_the_whole_model(runs):
    _, two, results_dir = runs
    written = read_rows("tp_verify_step", results_dir=results_dir)  # the same rows as CSV strings
    for rows in (two["rows"], written):
        whole = projection.whole_model_rows(rows, K26)
        assert {(r["batch"], r["nodes"]) for r in whole} == {(b, n) for b in (1, 2) for n in NODES}
        for row in whole:
            layers = [r for r in two["rows"] if r["scope"] == "layer"
                      and (r["batch"], r["nodes"]) == (row["batch"], row["nodes"])]
            dense, moe = layers[0], layers[1:]
            want = dense["attention_seconds"] + 60 * np.mean([r["attention_seconds"] for r in moe])
            assert row["attention"] == pytest.approx(want)
            assert (row["draft"] > 0) == (row["nodes"] > 1)
            assert row["total"] == pytest.approx(sum(row[k] for k in (*projection.COMPONENTS, "head", "draft")))


def test_random_weights_give_every_rank_its_slice_of_one_model():
    reader = RandomWeights("cpu", torch.float32, seed=3)
    full = reader.read("model.layers.1.self_attn.q_b_proj.weight", (12, 5))
    assert torch.equal(reader.read("model.layers.1.self_attn.q_b_proj.weight", (12, 5), 0, 4, 8), full[4:8])
    assert torch.equal(reader.read("model.layers.1.self_attn.o_proj.weight", (5, 12), 1, 6, 12),
                       reader.read("model.layers.1.self_attn.o_proj.weight", (5, 12))[:, 6:])
    assert not torch.equal(reader.read("model.layers.2.self_attn.q_b_proj.weight", (12, 5)), full)
    assert torch.equal(reader.read("model.norm.weight", (5,)), torch.ones(5))
    assert float(full.std()) == pytest.approx(5 ** -0.5, rel=0.5)


@pytest.fixture(scope="module")
def routes(tiny):
    model = random_target(tiny, TensorParallel(), device="cpu", dtype=torch.float32, seed=1)
    tokens = np.random.default_rng(0).integers(0, tiny.vocab_size, (6, 40))
    return routed_experts(model, tokens)


def test_router_union_grows_with_the_tree_and_is_bounded(routes, tiny):
    k, experts = tiny.num_experts_per_tok, tiny.n_routed_experts
    assert len(routes) == 2 and routes[0].shape == (6, 40, k)  # the two MoE layers of three
    rows = union_curve(routes, [1, 2, 8, 32], batch=2, windows=16)
    for layer in (0, 1):
        curve = [r["distinct_mean"] for r in rows if r["moe_layer_index"] == layer]
        rounding = rounding_bound(np.float64, terms=16, magnitude=experts)  # means of 16 windows' counts
        assert curve[0] >= k and all(a <= b + rounding for a, b in zip(curve, curve[1:])) and curve[-1] <= experts
    single = union_curve(routes, [1], windows=8)
    assert all(r["distinct_mean"] == k for r in single)
    with pytest.raises(ValueError, match="batch"):
        union_curve(routes, [1], batch=7)
    with pytest.raises(ValueError, match="nodes"):
        union_curve(routes, [41])


def test_correlation_fit_recovers_a_known_overlap():
    rows = [{"tokens": t, "distinct_mean": expected_distinct_experts(t, 384, 8, 0.6)} for t in (1, 8, 32, 128, 512)]
    assert fit_correlation(rows, 384, 8) == pytest.approx(0.6, abs=2e-3)
    uniform = [{"tokens": t, "distinct_mean": expected_distinct_experts(t, 16, 4)} for t in (2, 16)]
    assert fit_correlation(uniform, 16, 4) == pytest.approx(0.0, abs=2e-3)
    with pytest.raises(ValueError, match="rows"):
        fit_correlation([], 384, 8)


def h200_rows(truth: Efficiency, *, tp: int = 2) -> list[dict]:
    """Layer rows as the GPU bench writes them (CSV strings), made from the model with known efficiencies."""
    bandwidth, flops = 4.2e12, 700e12
    hardware = replace(CT200, memory_bandwidth=bandwidth, matmul_flops=flops, gpus=tp)
    rows = []
    for nodes in (1, 16, 64, 256):
        for moe in (False, True):
            ideal = layer_costs(K26, hardware, batch=1, nodes=nodes, context=4096, moe_layer=moe)
            rows.append({"scope": "layer", "tp": str(tp), "graph": "True", "batch": "1", "nodes": str(nodes),
                         "context": "4096", "moe_layer": str(moe), "device": "NVIDIA H200",
                         "copy_bandwidth": str(bandwidth), "matmul_flops": str(flops),
                         "attention_seconds": str(ideal["attention"] / truth.attention),
                         "moe_seconds": str(ideal["moe"] / truth.moe)})
    return rows


def test_calibration_on_bench_rows_and_the_projection():
    truth = Efficiency(attention=0.3, moe=0.6)
    rows = h200_rows(truth) + [dict(r, graph="False", moe_seconds="1.0") for r in h200_rows(truth)]
    efficiency, hardware, used = calibrate_on_rows(rows, K26, graph=True)
    assert efficiency.attention == pytest.approx(0.3) and efficiency.moe == pytest.approx(0.6)
    assert efficiency.rest == 1.0  # no step rows: the head stays at its roofline
    head = step_costs(K26, hardware, batch=1, nodes=16, context=4096)["rest"]
    step = {"scope": "step", "tp": "2", "graph": "True", "batch": "1", "nodes": "16", "context": "4096",
            "head_seconds": str(head / 0.2)}
    assert calibrate_on_rows(rows + [step], K26)[0].rest == pytest.approx(0.2)
    assert hardware.gpus == 2 and hardware.memory_bandwidth == 4.2e12 and len(used) == 8
    with pytest.raises(ValueError, match="tp=4"):
        calibrate_on_rows(rows, K26, tp=4)

    # the box is slower per layer than the ideal roofline the efficiencies scale
    for nodes in (1, 16, 64):
        assert step_costs(K26, CT200, batch=1, nodes=nodes, context=4096)["total"] < step_costs(
            K26, CT200, batch=1, nodes=nodes, context=4096, efficiency=efficiency)["total"]


def test_drafter_cost_model():
    drafter = drafter_config(K26)
    one = drafter_seconds(drafter, CT200, batch=1, context=4096)
    assert one > 0
    assert drafter_seconds(drafter, CT200, batch=1, context=32768) > one
    sharded = drafter_seconds(drafter, CT200, batch=1, context=4096, shards=8)
    assert sharded < one  # an eighth of the bytes, plus 13 small all-reduces
    assert drafter_seconds(drafter, CT200, batch=1, context=4096, efficiency=0.5) == pytest.approx(2 * one)
    measured = [{"batch": "1", "context": "4096", "tp": "1", "drafter_seconds": str(one / 0.25)}]
    assert drafter_efficiency(measured, drafter, CT200) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="drafter_seconds"):
        drafter_efficiency([{"batch": "1", "context": "4096", "tp": "1"}], drafter, CT200)
    faster = [dict(measured[0], drafter_seconds=str(one / 1.5))]  # faster than its roofline: refused, naming the row
    with pytest.raises(projection.Unphysical, match=r"drafter efficiency = 1\.5 .*batch=1"):
        drafter_efficiency(faster, drafter, CT200)


def test_acceptance_curve_from_rows():
    rows = [{"budget": "8", "mean_acceptance": "4.0", "mode": "tree"},
            {"budget": "8", "mean_acceptance": "5.0", "mode": "tree"},
            {"budget": "16", "mean_acceptance": "6.0", "mode": "tree"},
            {"budget": "16", "mean_acceptance": "2.0", "mode": "chain"}]
    assert acceptance_curve(rows, mode="tree") == {8: 4.5, 16: 6.0}
    with pytest.raises(ValueError, match="tokens_per_round"):
        acceptance_curve(rows, column="tokens_per_round")


@pytest.mark.gpu
def test_k26_layers_on_one_gpu_eager_and_graph():
    """Two real-shape layers (the dense one and one MoE layer: ~36 GB in bf16) on cuda:0."""
    settings = tp_step.k26_settings(layers=2, batches=(1,), nodes=(1, 16), contexts=(4096,), repeats=2, warmup=1,
                                     topic=None)
    rows = run_tp_bench(settings, world_size=1)["rows"]
    layers = [r for r in rows if r["scope"] == "layer"]
    assert {r["graph"] for r in layers} == {False, True}, "the CUDA-graph rows are missing"
    assert all(r["attention_backend"] == "cupy" and r["layer_seconds"] > 0 for r in layers)
    steps = [r for r in rows if r["scope"] == "step" and r["graph"]]
    assert all(r["graph_vs_eager_max_abs_diff"] < 1.0 for r in steps)
    drafts = [r for r in rows if r["scope"] == "draft"]
    assert drafts and all(r["tree_build_seconds"] > 0 and r["drafter_seconds"] > 0 for r in drafts)


def test_a_drafter_only_run_refreshes_the_draft_rows_alone(runs, tmp_path):
    _, _, results_dir = runs
    time.sleep(1.1)  # runs are told apart by their rows' date (whole seconds)
    settings = tiny_settings(verify_step=False, check=False, topic="tp_verify_step", results_dir=str(results_dir),
                             run="drafter-only")
    rows = run_tp_bench(settings, world_size=1)["rows"]
    assert rows and {r["scope"] for r in rows} == {"draft"} and all(r["drafter_seconds"] > 0 for r in rows)
    latest = projection.latest_rows(read_rows("tp_verify_step", results_dir=results_dir))
    assert {r["run"] for r in latest if r["scope"] == "draft"} == {"drafter-only"}
    assert all(r["run"] != "drafter-only" for r in latest if r["scope"] != "draft")
    assert {r["scope"] for r in latest} == {"layer", "step", "draft"}


def test_a_graph_round_takes_the_drafters_graph_time():
    row = {"drafter_seconds": "0.010", "drafter_graph_seconds": "0.002", "draft_topk_seconds": "1e-4",
           "tree_build_seconds": "2e-5", "accept_compact_seconds": ""}
    assert projection.draft_round_seconds(row, graph=True) == pytest.approx(0.002 + 1.2e-4)
    assert projection.draft_round_seconds(row, graph=False) == pytest.approx(0.010 + 1.2e-4)
    assert projection.draft_round_seconds({"drafter_seconds": "0.010"}, graph=True) == pytest.approx(0.010)
