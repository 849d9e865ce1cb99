"""The CT200 cost model: structure, limits and calibration round trip; the box's inputs (measured or a
labelled assumption), the acceptance sources and the table."""
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kdtree_lib import projection
from kdtree_lib.model.config import load_config
from kdtree_lib.projection import (CT200, Efficiency, assumptions, calibrate, expected_distinct_experts,
                                   layer_costs, projected_speedup, step_costs)
from kdtree_lib.results import read_rows

K26 = load_config(Path(__file__).resolve().parent.parent / "data" / "configs" / "kimi-k2.6.json")
H200 = replace(CT200, name="H200", memory_bandwidth=4.2e12, matmul_flops=790e12, gpus=2)


def test_distinct_experts_limits():
    assert expected_distinct_experts(1, 384, 8) == pytest.approx(8)
    assert expected_distinct_experts(100_000, 384, 8) == pytest.approx(384)
    assert expected_distinct_experts(64, 384, 8, correlation=1.0) == pytest.approx(8)
    assert expected_distinct_experts(64, 384, 8, correlation=0.5) < expected_distinct_experts(64, 384, 8)


def test_step_time_grows_with_the_tree_and_tp1_has_no_allreduce():
    totals = [step_costs(K26, CT200, batch=1, nodes=n, context=4096, expert_bits=4.5)["total"]
              for n in (1, 8, 32, 128, 512)]
    assert all(a < b for a, b in zip(totals, totals[1:]))
    single = replace(CT200, gpus=1)
    assert step_costs(K26, single, batch=1, nodes=8, context=4096)["allreduce"] == 0
    # AR at batch 1 is memory-bound: the expert bytes dominate the MoE time
    layer = layer_costs(K26, CT200, batch=1, nodes=1, context=4096, moe_layer=True, expert_bits=4.5)
    expert_bytes = 8 * 3 * 7168 * 2048 / 8 * 4.5 / 8
    assert layer["moe"] >= expert_bytes / CT200.memory_bandwidth


def test_speedup_reflects_acceptance_and_cost():
    rows = projected_speedup(K26, CT200, {8: 4.5, 32: 5.5, 1024: 7.0}, batch=1, context=4096, expert_bits=4.5)
    assert [r["budget"] for r in rows] == [8, 32, 1024]
    assert all(r["speedup"] < r["acceptance"] for r in rows)
    assert rows[0]["speedup"] > 1 and rows[-1]["speedup"] < rows[1]["speedup"]  # huge trees cost too much
    none_accepted = projected_speedup(K26, CT200, {1: 1.0}, batch=1, context=4096)
    assert none_accepted[0]["speedup"] < 1


def test_calibration_recovers_known_efficiencies():
    truth = Efficiency(attention=0.4, moe=0.7)
    measured = []
    for nodes in (1, 16, 64):
        ideal = layer_costs(K26, H200, batch=1, nodes=nodes, context=32768, moe_layer=True)
        measured.append({"batch": 1, "nodes": nodes, "context": 32768, "moe_layer": "True",
                         "attention_seconds": ideal["attention"] / truth.attention,
                         "moe_seconds": ideal["moe"] / truth.moe})
    fitted = calibrate(measured, K26, H200)
    assert fitted.attention == pytest.approx(0.4) and fitted.moe == pytest.approx(0.7)
    assert any("allreduce_latency" in line for line in assumptions(CT200, fitted, expert_bits=4.5))
    with pytest.raises(ValueError, match="measured"):
        calibrate([], K26, H200)


# ----------------------------------------------------------------------------------------------
# the box's inputs and the table

ASSUMED_VERIFY, ASSUMED_MOE = projection.KernelTime(15e-6, 0.3, 0.1), projection.KernelTime(10e-6, 0.7)
STAND_IN = projection.measured_acceptance("stand-in", "data/results/acceptance.csv", read_rows("acceptance"), depth=7, block_size=8)


def acceptance_rows(curve, chain):
    """Rows in the kit's box_acceptance format (acceptance.oracle_rows' columns) for a known curve."""
    stamp = {"date": "2026-12-01T00:00:00Z", "commit": "abc", "device": "box", "source": "oracle", "temperature": "0.0",
             "package": "p", "block_size": "8", "pair": "real", "prompts": "8", "new_tokens": "256"}
    return ([{**stamp, "mode": "tree", "budget": str(b), "mean_acceptance": str(a)} for b, a in curve.items()]
            + [{**stamp, "mode": "chain", "budget": str(b), "mean_acceptance": str(chain)} for b in curve])


def round_options(**overrides):
    verify, _, _ = projection.verify_kernel_inputs([], heads=8, assumed_time=ASSUMED_VERIFY)
    experts, _, _ = projection.moe_kernel_inputs([], tp=8, assumed_time=ASSUMED_MOE)
    stage = projection.tree_stage_cost([], [], depth=7, assumed_seconds=50e-6)
    drafter = projection.real_drafter_config(K26)
    return {"efficiency": projection.box_efficiency(Efficiency(0.5, 0.7, 0.8), verify, experts), "expert_bits": 4.5,
            "chain_budget": 7, "tree_stage": stage,
            "drafter": lambda b, c: projection.drafter_seconds(drafter, CT200, batch=b, context=c, head_shards=8,
                                                               efficiency=0.3), **overrides}


def test_each_acceptance_source_gives_the_table():
    box_source = projection.measured_acceptance("real pair", "box_acceptance.csv", acceptance_rows({8: 4.6, 16: 5.5, 32: 6.3}, 4.0),
                                                depth=7)
    assert box_source.chain.measured and box_source.chain.value == 4.0
    sources = [STAND_IN, projection.service_acceptance(), box_source]
    assert STAND_IN.measured and not sources[1].measured and sources[1].curve == projection.SERVICE_OBSERVED
    table = projection.projection_table(K26, sources, (0.0, 0.9), batches=(1, 8), contexts=(4096, 32768), **round_options())
    best = projection.best_table(table)
    assert {(r["source"], r["correlation"], r["context"], r["batch"]) for r in best} == {
        (s.name, c, L, b) for s in sources for c in (0.0, 0.9) for L in (4096, 32768) for b in (1, 8)}
    for row in best:
        assert row["budget"] in next(s.curve for s in sources if s.name == row["source"])
        assert row["speedup_vs_ar"] > 0 and row["speedup_vs_chain"] > 0
    # overlap saves expert bytes: the same budget's round is cheaper when tokens route alike
    pick = {(r["source"], r["correlation"], r["context"], r["batch"], r["budget"]): r["round_seconds"] for r in table}
    assert pick["service", 0.9, 4096, 8, 32] < pick["service", 0.0, 4096, 8, 32]
    band = projection.speedup_band(table)
    for row in table:
        low, high = band[row["context"], row["batch"]][row["budget"]]
        assert low <= row["speedup_vs_ar"] <= high


def test_a_replicated_real_drafter_costs_more_than_a_sharded_one():
    drafter = projection.real_drafter_config(K26)
    params = (drafter.num_hidden_layers * (drafter.hidden_size * drafter.head_dim * 2 * (drafter.num_attention_heads
              + drafter.num_key_value_heads) + 3 * drafter.hidden_size * drafter.intermediate_size)
              + drafter.feature_size * drafter.hidden_size)
    assert params * 2 / 2**30 == pytest.approx(6.5, abs=0.1)  # DESIGN.md §4: about 6.5 GiB bf16
    seconds = {placement: projection.drafter_seconds(drafter, CT200, batch=1, context=4096, head_shards=8,
                                                     shards=projection.drafter_shards(placement, 8))
               for placement in projection.DRAFTER_PLACEMENTS}
    assert seconds["replicated"] > 2 * seconds["sharded"]
    with pytest.raises(ValueError, match="placement"):
        projection.drafter_shards("everywhere", 8)


def test_absent_rows_are_loud_assumptions_naming_their_parameter():
    _, inputs, used = projection.moe_kernel_inputs([], tp=8, assumed_time=ASSUMED_MOE)  # no moe_int4.csv rows
    other_slice = [r for r in read_rows("moe_int4") if r.get("tp") != "8"]  # rows, but none of the box's TP=8 slice
    assert projection.moe_kernel_inputs(other_slice, tp=8, assumed_time=ASSUMED_MOE)[2] == []
    assert not used and inputs and all(not i.measured for i in inputs)
    assert all("ASSUMPTION" in i.line() and "assumed_moe_time" in i.line() for i in inputs)
    stage = projection.tree_stage_cost([], [], depth=7, assumed_seconds=50e-6)(1, 32)
    assert not stage.measured and "assumed_tree_stage_seconds" in stage.line()
    assert all(not i.measured and "PCIe" in i.source for i in projection.allreduce_inputs(CT200))
    assert all(not i.measured and "not measured" in i.source for i in projection.hardware_inputs(CT200))
    service = projection.service_acceptance(depth=7)  # no chain observed: the tree's at the first budget >= 7 drafts
    assert not service.chain.measured and service.chain.value == projection.SERVICE_OBSERVED[8]


def test_kernel_fit_recovers_a_known_time_and_needs_rows_that_grow():
    truth = projection.KernelTime(fixed=12e-6, bytes_efficiency=0.7)
    sizes = np.array([1e6, 1e7, 5e7, 2e8])
    rows = [{"provider": "kernel_99kb", "tp": "8", "bytes": str(b), "copy_tbps": "1.5", "time_us": str(truth.time(b / 1.5e12) * 1e6),
             "date": "d", "commit": "c", "device": "box"} for b in sizes]
    fitted, inputs, used = projection.moe_kernel_inputs(rows, tp=8, assumed_time=ASSUMED_MOE)
    assert len(used) == 4 and all(i.measured for i in inputs)
    assert fitted.fixed == pytest.approx(12e-6, rel=1e-6) and fitted.bytes_efficiency == pytest.approx(0.7, rel=1e-6)
    with pytest.raises(ValueError, match="measured_seconds: expected at least 2"):
        projection.fit_kernel_time([1e-6], [2e-6])
    with pytest.raises(ValueError, match="do not grow with the bytes"):
        projection.fit_kernel_time([0.0, 0.0, 0.0], [1e-6, 2e-6, 3e-6])


def test_the_verify_kernel_model_reproduces_its_rows_within_their_spread():
    rows = read_rows("verify_attn")
    time, inputs, used = projection.verify_kernel_inputs(rows, heads=8, assumed_time=ASSUMED_VERIFY)
    assert used and all(i.measured for i in inputs)
    assert {r["config"] for r in used} == set(projection.PORTABLE_VERIFY_CONFIGS.values())
    terms = ([float(r["bytes"]) / (float(r["copy_tbps"]) * 1e12) for r in used], [float(r["time_us"]) * 1e-6 for r in used],
             [float(r["flops"]) / (float(r["matmul_tflops"]) * 1e12) for r in used])
    residuals = projection.fit_residuals(time, *terms)
    # the spread the source line states is the model's over every row it was fitted on
    assert f"{residuals.min():+.0%} .. {residuals.max():+.0%}" in inputs[0].source
    assert np.max(np.abs(residuals)) < 0.3 and abs(np.median(residuals)) < 0.1
    # one efficiency on the roofline (the old model) does not: its error is far outside that spread
    roofline = np.maximum(terms[0], terms[2])
    ratio = np.median(np.array(terms[1]) / roofline)
    assert np.max(np.abs(roofline * ratio / np.array(terms[1]) - 1)) > 2 * np.max(np.abs(residuals))


def test_the_latency_aware_stop_adds_a_node_only_while_it_pays():
    log_weights = np.array([[*np.log([1.0, 0.9, 0.5, 0.1]), -np.inf]])  # root, three drafts, a padding slot
    assert projection.latency_aware_budgets(log_weights, lambda n: 1.0, 4).tolist() == [3]  # free nodes: all, not the padding
    # T(n) = 1 + 0.2 n: a node of weight w pays while w (1 + 0.2 n) > 0.2 A: 0.9 and 0.5 do, 0.1 does not
    assert projection.latency_aware_budgets(log_weights, lambda n: 1 + 0.2 * n, 4).tolist() == [2]
    assert projection.latency_aware_budgets(log_weights, lambda n: 10.0 ** n, 4).tolist() == [0]


@pytest.fixture(scope="module")
def stand_in_records():
    from kdtree_lib.acceptance import record_oracle
    from kdtree_lib.model.tp import one_cpu_thread
    from kdtree_lib.pairs import pair_with_prompts
    chosen = pair_with_prompts(8, prompts_per_package=1, prompt_tokens=24)
    if not chosen.stand_in:
        pytest.skip("no stand-in checkpoint")
    with one_cpu_thread():  # a spinning OpenMP pool on a shared CPU slows these tiny ops tenfold
        return [r for prompts in chosen.packages.values()
                for r in record_oracle(chosen.target, chosen.drafter, prompts, 32, 16)]


def test_stop_rule_comparison_against_fixed_budgets(stand_in_records):
    from kdtree_lib.acceptance import mean_acceptance
    budgets = [1, 4, 16]
    flat = projection.stop_rule_comparison(stand_in_records, lambda n: 2.0, budgets)
    for budget in budgets:  # a fixed budget's rate is its mean acceptance over the round's time
        assert flat["fixed"][budget] == pytest.approx(mean_acceptance(stand_in_records, budget) / 2.0)
    # free nodes: the stop never halts, so it is the largest budget exactly
    assert flat["latency_aware"] == pytest.approx(flat["fixed"][16]) and flat["latency_aware_mean_budget"] == 16
    assert flat["best_fixed_budget"] == 16 and not flat["beats_best_fixed"]
    steep = projection.stop_rule_comparison(stand_in_records, lambda n: 1.0 + n, budgets)
    assert steep["latency_aware_mean_budget"] < 16 and steep["best_fixed_budget"] < 16


def test_the_explorer_redraws_for_each_choice():
    import matplotlib
    matplotlib.use("Agg")
    from kdtree_lib.plots.projection import projection_explorer
    drafter = projection.real_drafter_config(K26)
    drafters = projection.drafter_costs(drafter, CT200, efficiency=0.3)
    options = round_options()
    options.pop("drafter")
    panel = projection_explorer(K26, [STAND_IN, projection.service_acceptance()], drafters=drafters,
                                overlaps=projection.OVERLAPS, batches=[1, 8], contexts=[4096], **options)
    replicated = panel.result
    assert replicated["source"] == "stand-in" and replicated["batch"] == 1
    placement = next(w for w in panel.kwargs_widgets if w.description == "drafter")
    placement.value = "sharded"
    assert panel.result["speedup_vs_ar"] > replicated["speedup_vs_ar"]  # a cheaper drafter, a faster round


def test_drafter_costs_are_drafter_seconds_per_placement():
    drafter = projection.real_drafter_config(K26)
    costs = projection.drafter_costs(drafter, CT200, efficiency=0.3)
    assert set(costs) == set(projection.DRAFTER_PLACEMENTS)
    for placement, seconds in costs.items():
        assert seconds(8, 32768) == projection.drafter_seconds(
            drafter, CT200, batch=8, context=32768, shards=projection.drafter_shards(placement, CT200.gpus),
            head_shards=CT200.gpus, efficiency=0.3)
    assert costs["replicated"](1, 4096) > 2 * costs["sharded"](1, 4096)
    assert projection.drafter_costs(drafter, CT200, efficiency=0.6)["sharded"](1, 4096) < costs["sharded"](1, 4096)
    with pytest.raises(ValueError, match="placement"):
        projection.drafter_costs(drafter, CT200, efficiency=0.3, placements=("everywhere",))


def test_round_seconds_of_nodes_is_a_batch_one_round():
    options = round_options()
    drafter, stage = options["drafter"], options["tree_stage"]
    seconds = projection.round_seconds_of_nodes(K26, CT200, context=4096, correlation=0.5, efficiency=options["efficiency"],
                                                expert_bits=4.5, drafter=drafter, tree_stage=stage)
    for nodes in (1, 2, 33):
        step = step_costs(K26, CT200, batch=1, nodes=nodes, context=4096, expert_bits=4.5, correlation=0.5,
                          efficiency=options["efficiency"],
                          fixed_seconds=drafter(1, 4096) + stage(1, max(nodes - 1, 1)).value)
        assert seconds(nodes) == step["total"]
    assert all(seconds(a) < seconds(b) for a, b in ((1, 8), (8, 64), (64, 256)))
    # the round rows of a budget pay the same at batch 1: budget b is a tree of b + 1 nodes
    row = next(r for r in projection.round_rows(K26, CT200, projection.service_acceptance(), batch=1, context=4096,
                                                correlation=0.5, **options) if r["budget"] == 16)
    assert row["round_seconds"] == pytest.approx(seconds(17), rel=1e-12)


def test_nearest_overlap():
    assert projection.nearest_overlap(projection.OVERLAPS, 0.31) == 0.25
    assert projection.nearest_overlap(projection.OVERLAPS, 0.0) == 0.0
    assert projection.nearest_overlap([0.0, 0.5], 0.25) == 0.0  # the first of equals
    with pytest.raises(ValueError, match="overlaps"):
        projection.nearest_overlap([], 0.3)


def test_assumptions_print_hardware_with_units():
    """The footer reads 1.5 TB/s, not 1500000000000.0."""
    from kdtree_lib.projection import CT200, Efficiency, assumptions
    lines = assumptions(CT200, Efficiency())
    assert "memory_bandwidth = 1.5 TB/s" in lines and "matmul_flops = 500 TFLOP/s" in lines
    assert "allreduce_latency = 24 us" in lines and "allreduce_bus_bandwidth = 40 GB/s" in lines
    assert not any("e+" in line or "000000" in line for line in lines if line.startswith(("memory", "matmul", "allreduce")))
