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
    verify = projection.verify_kernel_inputs([], heads=8, assumed_time=ASSUMED_VERIFY).time
    experts = projection.moe_kernel_inputs([], tp=8, assumed_time=ASSUMED_MOE).time
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
    fit = projection.moe_kernel_inputs([], tp=8, assumed_time=ASSUMED_MOE)  # no moe_int4.csv rows
    inputs, used = fit.inputs, fit.rows
    other_slice = [r for r in read_rows("moe_int4") if r.get("tp") != "8"]  # rows, but none of the box's TP=8 slice
    assert projection.moe_kernel_inputs(other_slice, tp=8, assumed_time=ASSUMED_MOE).rows == []
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
    fit = projection.moe_kernel_inputs(rows, tp=8, assumed_time=ASSUMED_MOE)
    fitted, inputs, used = fit.time, fit.inputs, fit.rows
    assert len(used) == 4 and all(i.measured for i in inputs) and max(map(abs, fit.residuals)) < 1e-9
    assert fitted.fixed == pytest.approx(12e-6, rel=1e-6) and fitted.bytes_efficiency == pytest.approx(0.7, rel=1e-6)
    with pytest.raises(ValueError, match="measured_seconds: expected at least 2"):
        projection.fit_kernel_time([1e-6], [2e-6])
    with pytest.raises(ValueError, match="do not grow with the bytes"):
        projection.fit_kernel_time([0.0, 0.0, 0.0], [1e-6, 2e-6, 3e-6])


def test_the_verify_kernel_model_reproduces_its_rows_within_their_spread():
    rows = read_rows("verify_attn")
    fit = projection.verify_kernel_inputs(rows, heads=8, assumed_time=ASSUMED_VERIFY)
    time, inputs, used = fit.time, fit.inputs, fit.rows  # used: the rows kept, none faster than its roofline
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
    start = dict(source="service", overlap=0.5, batch=8, context=4096, placement="sharded")  # the headline's settings
    opened = projection_explorer(K26, [STAND_IN, projection.service_acceptance()], drafters=drafters,
                                 overlaps=projection.OVERLAPS, batches=[1, 8], contexts=[4096], start=start, **options)
    assert {w.description: w.value for w in opened.kwargs_widgets} == {
        "acceptance": "service", "overlap": 0.5, "batch": 8, "context": 4096, "drafter": "sharded"}
    assert (opened.result["source"], opened.result["correlation"], opened.result["batch"]) == ("service", 0.5, 8)
    with pytest.raises(ValueError, match="start: batch=3"):
        projection_explorer(K26, [STAND_IN], drafters=drafters, overlaps=projection.OVERLAPS, batches=[1, 8],
                            contexts=[4096], start={"batch": 3}, **options)
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


# ----------------------------------------------------------------------------------------------
# physics: every input is one some hardware can produce, or it is refused naming its rows

def verify_row(batch, time_us, *, nodes=8, bytes_=1e9, flops=1e9, config="rows32_keys32_stages2", **extra):
    return {"date": "2026-12-01T00:00:00Z", "commit": "abc", "device": "H200", "run": "r", "provider": "kernel",
            "config": config, "heads": "8", "rows": "64", "batch": str(batch), "nodes": str(nodes), "length": "4096",
            "bytes": str(bytes_), "flops": str(flops), "copy_tbps": "4.0", "matmul_tflops": "800",
            "time_us": str(time_us), **extra}


def test_a_row_faster_than_its_roofline_is_refused_naming_the_row():
    truth = projection.KernelTime(fixed=10e-6, bytes_efficiency=0.8, flops_efficiency=0.3)
    rows = []
    for i, (size, flops) in enumerate([(1e7, 1e9), (1e8, 1e12), (1e9, 1e10), (4e9, 4e13), (2e8, 1e11)]):
        seconds = truth.time(size / 4e12, flops / 800e12)
        rows.append(verify_row(i + 1, seconds * 1e6, bytes_=size, flops=flops))
    fast = verify_row(99, 0.5 * 4e9 / 4e12 * 1e6, bytes_=4e9)  # reads at twice the run's measured copy bandwidth
    fit = projection.verify_kernel_inputs(rows + [fast], heads=8, assumed_time=ASSUMED_VERIFY)
    assert [str(r.row["batch"]) for r in fit.refused] == ["99"] and len(fit.rows) == len(rows)
    line = fit.refused[0].line()
    assert "REFUSED data/results/verify_attn.csv" in line and "batch=99" in line and "2.000x the copy bandwidth" in line
    assert fit.time.bytes_efficiency == pytest.approx(0.8, rel=1e-2) and fit.time.flops_efficiency == pytest.approx(0.3, rel=1e-2)
    assert any(l.startswith("REFUSED") for l in fit.lines_at([1]))
    with pytest.raises(projection.Unphysical, match="faster than its roofline.*batch=99"):
        projection.verify_kernel_inputs([fast], heads=8, assumed_time=ASSUMED_VERIFY)


def test_an_efficiency_above_one_is_refused_wherever_it_comes_from():
    with pytest.raises(projection.Unphysical, match=r"efficiency.bytes_efficiency = 1.5 .*assumed_moe_time"):
        projection.moe_kernel_inputs([], tp=8, assumed_time=projection.KernelTime(1e-5, 1.5))
    with pytest.raises(projection.Unphysical, match="not positive"):
        projection.check_fraction("drafter_efficiency", 0.0, source="parameter drafter_efficiency")
    # layer rows faster than the model's roofline calibrate to an efficiency above 1: refused, naming a row
    ideal = layer_costs(K26, H200, batch=1, nodes=16, context=4096, moe_layer=True)
    rows = [{"batch": 1, "nodes": 16, "context": 4096, "moe_layer": "True", "device": "H200", "commit": "c",
             "attention_seconds": ideal["attention"] / 2, "moe_seconds": ideal["moe"] / 0.5}]
    with pytest.raises(projection.Unphysical, match=r"efficiency.attention = 2 .*nodes=16"):
        calibrate(rows, K26, H200)


def test_the_committed_verify_rows_give_no_efficiency_above_one():
    """The rows that gave bytes_efficiency 1.565 under the additive fit: the rows faster than the copy are refused,
    and the roofline fit of the rest is physical."""
    fit = projection.verify_kernel_inputs(read_rows("verify_attn"), heads=8, assumed_time=ASSUMED_VERIFY)
    if not fit.rows:
        pytest.skip("no portable verify rows committed")
    assert 0 < fit.time.bytes_efficiency <= 1 and 0 < fit.time.flops_efficiency <= 1
    for refusal in fit.refused:
        row = refusal.row
        assert float(row["time_us"]) * 1e-6 < float(row["bytes"]) / (float(row["copy_tbps"]) * 1e12)


@pytest.mark.parametrize("with_flops", [False, True])
def test_a_kernel_fit_reproduces_its_rows_within_their_spread(with_flops):
    """Rows of a known kernel time, five repeats per shape with ±3% noise: the fitted model lies within each
    shape's repeats (their spread), which is what fitting more than noise would break."""
    truth = projection.KernelTime(fixed=8e-6, bytes_efficiency=0.6, flops_efficiency=0.25 if with_flops else None)
    rng = np.random.default_rng(0)
    bytes_s = np.repeat(np.geomspace(1e-6, 1e-3, 8), 5)
    flops_s = np.repeat(np.geomspace(1e-7, 2e-3, 8)[::-1], 5) if with_flops else None
    measured = truth.time(bytes_s, 0.0 if flops_s is None else flops_s) * rng.uniform(0.97, 1.03, bytes_s.size)
    fitted = projection.fit_kernel_time(bytes_s, measured, flops_s)
    model = fitted.time(bytes_s, 0.0 if flops_s is None else flops_s)
    repeats = measured.reshape(8, 5)
    spread = np.max((repeats.max(axis=1) - repeats.min(axis=1)) / np.median(repeats, axis=1))
    assert 0 < spread < 0.07  # the rows' own noise (calibration_fit's definition)
    assert np.all(np.abs(model[::5] / np.median(repeats, axis=1) - 1) <= spread)


def test_calibration_reproduces_its_rows_within_their_spread():
    truth = Efficiency(attention=0.4, moe=0.7)
    rng = np.random.default_rng(1)
    rows = []
    for nodes in (1, 16, 64):
        ideal = layer_costs(K26, H200, batch=1, nodes=nodes, context=32768, moe_layer=True)
        for _ in range(5):  # five layers of one shape, ±2% apart
            rows.append({"batch": 1, "nodes": nodes, "context": 32768, "moe_layer": "True",
                         "attention_seconds": ideal["attention"] / truth.attention * rng.uniform(0.98, 1.02),
                         "moe_seconds": ideal["moe"] / truth.moe * rng.uniform(0.98, 1.02)})
    fitted = calibrate(rows, K26, H200)
    check = projection.calibration_fit(rows, K26, H200, fitted)
    for name, fit in check.items():
        assert fit["spread"] < 0.04 and -fit["spread"] <= fit["residual_low"] <= fit["residual_high"] <= fit["spread"], name


# ----------------------------------------------------------------------------------------------
# the tree stage by batch, from the rows of the path the box runs

def topk_row(batch, topk, time_us, **label):
    return {"date": "2026-12-01T00:00:00Z", "commit": "c", "device": "H200", "stage": "draft_topk", "batch": batch,
            "depth": 7, "topk": topk, "timing": "cuda_graph", "time_us": time_us, "roofline_us": 1.0 * batch, **label}


def stage_rows(topk_rows):
    build = [{"date": "2026-12-01T00:00:00Z", "commit": "c", "device": "H200", "stage": "build", "method": "kernel",
              "timing": "cuda_graph", "depth": 7, "batch": b, "budget": 32, "version": 2, "time_us": 10.0} for b in (1, 64)]
    accept = [{"date": "2026-12-01T00:00:00Z", "commit": "c", "device": "H200", "method": "accept_compact_kernel",
               "batch": b, "budget": 64, "time_us": 5.0} for b in (1, 64)]
    return topk_rows + build, accept


@pytest.mark.parametrize("label", [{"method": "kernel", "max_abs_diff_vs_torch": 1.9e-6},
                                   {"method": "kernel", "topk_path": "fused_v2"}])
def test_the_tree_stage_is_taken_at_the_batch_from_the_box_path(label):
    """Old rows (no `topk_path`: a kernel row that differs from torch's values ran the fused kernel) and new ones
    (labelled) are both read; rows of the exact path are not what the box runs (decode's GPU step and the drop-in
    launch the fused kernel); at B=8 between B=1 and B=64 the cost is interpolated, not B=64's."""
    exact_old = {"method": "kernel", "max_abs_diff_vs_torch": 0}  # the default launch then ran torch's ops
    exact_new = {"method": "torch", "topk_path": "exact"}
    rows = [topk_row(1, 64, 100.0, **label), topk_row(64, 64, 1360.0, **label),
            topk_row(1, 64, 1.0e4, **exact_old), topk_row(64, 64, 1.0e4, **exact_new)]
    build, accept = stage_rows(rows)
    stage = projection.tree_stage_cost(build, accept, depth=7, assumed_seconds=1.0)
    at8 = stage(8, 32)
    assert at8.measured and at8.value == pytest.approx((100 + 7 / 63 * 1260 + 10 + 5) * 1e-6)
    assert "interpolated between B=1 and B=64" in at8.source
    assert stage(64, 32).value == pytest.approx((1360 + 10 + 5) * 1e-6)
    assert stage(1, 32).value < at8.value < stage(64, 32).value


def test_a_topk_row_faster_than_reading_its_logits_is_refused():
    rows = [topk_row(1, 64, 100.0, method="kernel"), topk_row(64, 64, 1360.0, method="kernel"),
            topk_row(8, 64, 4.0, method="kernel")]  # 4 us below its roofline of 8 us
    build, accept = stage_rows(rows)
    stage = projection.tree_stage_cost(build, accept, depth=7, assumed_seconds=1.0)
    assert [r.row["batch"] for r in stage.refused] == [8] and "batch=8" in stage.refused[0].line()
    assert "interpolated" in stage(8, 32).source


# ----------------------------------------------------------------------------------------------
# where the tree's tokens come from, the external lines and the takeaway

def sibling_record(positions: int = 12, depth: int = 3, topk: int = 2):
    """An oracle record where depth 1's right token is always the drafter's second choice and deeper ones its
    first; ranks from 2 on are tokens off the truth, far less likely (log-probability -10 and below)."""
    from kdtree_lib.acceptance import OracleRecord
    from kdtree_lib.contracts import DraftTopK
    tokens = np.arange(1, positions + depth + 2, dtype=np.int32)
    ids = np.zeros((positions, depth, topk), np.int32)
    logp = np.zeros((positions, depth, topk), np.float32)
    logp[..., :2] = [-0.1, -2.5]
    logp[..., 2:] = -10.0 - np.arange(topk - 2)
    for t in range(positions):
        right = tokens[t + 1:t + 1 + depth]
        ids[t, 0, :2] = [1000 + t, right[0]]
        ids[t, 1:, 0], ids[t, 1:, 1] = right[1:], 2000 + t
        ids[t, :, 2:] = 5000 + np.arange(topk - 2)
    return OracleRecord(DraftTopK(logp, ids), tokens)


def test_depth_structure_splits_rank0_nodes_from_siblings():
    """The chain accepts the root alone, a full tree the root, the sibling and two rank-0 nodes after it."""
    record = sibling_record()
    s = projection.depth_structure([record], 14, chain_depth=3)
    assert (s.tree_mean, s.prefix_mean, s.sibling_mean, s.chain_mean) == (4.0, 0.0, 3.0, 1.0)
    assert s.rounds == 12 // 4 and s.sibling_share_of_gain == 1.0
    assert s.sibling[1] == s.rounds and s.rank0[1] == 0 and s.rank0[2] == s.rank0[3] == s.rounds
    assert s.after_sibling[2] == (s.rounds, s.rounds) and s.after_rank0[3] == (s.rounds, s.rounds)
    assert "100% of the tree's gain over the chain" in s.lines()[0]


def test_depth_rows_hold_the_structure_and_packages_add_up(tmp_path):
    """acceptance.depth_rows writes counts a reader turns back into the same structure; two packages' rows of
    one run combine (counts add, means stay); the biggest run is the one read; the projection's line says how
    much of the gain over the chain the siblings give, from those rows."""
    from kdtree_lib import acceptance, results
    record = sibling_record(topk=16)  # budget 14 is within the recorded top-k: an exact tree
    rows = acceptance.depth_rows([record], (4, 14, 32), package="a", block_size=4, pair="toy", n_new_tokens=12,
                                 progress=False)
    assert [int(r["budget"]) for r in rows] == [4, 14], "no row past the recorded top-k"
    direct = projection.depth_structure([record], 14, chain_depth=3)
    for package in ("a", "b"):
        results.append_rows(acceptance.DEPTH_TOPIC, [{**r, "package": package, "run": "big"} for r in rows],
                            results_dir=tmp_path)
    small = acceptance.depth_rows([sibling_record(positions=4, topk=16)], (14,), package="a", block_size=4,
                                  pair="toy", n_new_tokens=4, progress=False)
    results.append_rows(acceptance.DEPTH_TOPIC, [{**r, "run": "small"} for r in small], results_dir=tmp_path)
    on_disk = results.read_rows(acceptance.DEPTH_TOPIC, results_dir=tmp_path)
    assert projection.DepthStructure.from_row(on_disk[1]) == direct
    combined = projection.depth_structures(on_disk, block_size=4)
    assert sorted(combined) == [4, 14], "the small run appended later is not the one read"
    both = combined[14]
    assert both.rounds == 2 * direct.rounds and both.sibling[1] == 2 * direct.sibling[1]
    assert both.after_sibling[2] == tuple(2 * v for v in direct.after_sibling[2])
    assert (both.tree_mean, both.sibling_mean, both.chain_mean) == (direct.tree_mean, direct.sibling_mean, direct.chain_mean)
    source = projection.depth_source("toy pair", "acceptance_depth.csv", on_disk, block_size=4)
    assert source.at(16).budget == 14 and source.at(9).budget == 4  # nearest, the smaller on a tie
    line = source.gain_line(16)
    assert line.startswith("toy pair, budget 14 (the rows' nearest to 16): siblings give 100% of DDTree's gain in tokens "
                           "per round over the chain")
    assert "chain of 3 1.00 tokens per round" in line and "acceptance_depth.csv" in line
    assert projection.depth_source("none", "x.csv", []) is None
    behind = replace(direct, chain_tokens=10 * direct.chain_rounds)  # a chain that accepts more per round
    assert "the tree accepts no more tokens per round than the chain (-6.000)" in \
        projection.DepthSource("toy", {14: behind}, "made").gain_line(14)
    with pytest.raises(ValueError, match="lacks"):
        projection.DepthStructure.from_row({"budget": "4"})
    with pytest.raises(ValueError, match="one budget"):
        projection.DepthStructure.combine([combined[4], combined[14]])


def test_takeaway_and_reference_lines_come_from_the_table():
    sources = [STAND_IN, projection.service_acceptance()]
    table = projection.projection_table(K26, sources, (0.0, 0.5), batches=(1,), contexts=(4096, 32768), **round_options())
    best = projection.headline(projection.best_table(table), source="service", correlation=0.5)
    refs = projection.references([["no speculation AR", "short", 1, 1e-3], ["DFlash chain", "short", 1, 1e9],
                                  ["Eagle3", "32768", 1, 93]])
    assert [r.kind for r in refs] == ["ar", "chain", ""]
    lines = projection.reference_lines(best, refs)
    short, long_ = best[4096, 1], best[32768, 1]
    assert f"projected DDTree (budget {short['budget']}) {short['tokens_per_second']:.0f} tokens/s beats no speculation AR" in lines[0]
    assert "the model's own AR" in lines[1] and "does not beat DFlash chain" in lines[2] and "the model's own DFlash chain" in lines[3]
    assert len(lines) == 5 and "L=32768" in lines[4] and "Eagle3" in lines[4]  # each reference at its own context only
    takeaway = projection.takeaway_lines(table, source="service", correlation=0.5, refs=refs,
                                         alternatives={"overlap 0": [r for r in projection.best_table(table)
                                                                     if r["source"] == "service" and r["correlation"] == 0.0]})
    assert takeaway[0].startswith(f"L=4096, B=1: best budget {short['budget']}: {short['tokens_per_second']:.0f} tokens/s, "
                                  f"{short['speedup_vs_ar']:.2f}x AR")
    assert any("band over sources x overlaps" in line for line in takeaway)
    assert any("would change it: overlap 0" in line for line in takeaway) and takeaway[-5:] == lines
    with pytest.raises(ValueError, match="external_references"):
        projection.references([["AR", "long", 1, 92]])
    with pytest.raises(ValueError, match="source/correlation"):
        projection.headline(projection.best_table(table), source="service", correlation=0.9)


def test_expert_counts_against_uniform_count_float_noise_as_on_the_curve():
    assert projection.uniform_sides([384, 8, 100, 200], [383.9999998, 8.0, 120.0, 180.3]) == {"below": 1, "on": 2, "above": 1}


def test_growth_is_judged_against_the_layers_spread():
    def layer(nodes, layer, moe, attention):
        return {"scope": "layer", "moe_layer": "True", "graph": "True", "batch": "1", "context": "4096",
                "nodes": str(nodes), "layer": str(layer), "moe_seconds": str(moe), "attention_seconds": str(attention)}
    rows = [layer(64, 1, 1.00, 0.10), layer(64, 2, 1.10, 0.10), layer(256, 1, 1.05, 0.20), layer(256, 2, 1.12, 0.20)]
    rounds = [{"batch": 1, "context": 4096, "nodes": n, "moe": m, "attention": a} for n, m, a in ((64, 1.05, 0.1), (256, 1.085, 0.2))]
    moe, attention = projection.growth_lines(rows, rounds, graph=True, components=("moe", "attention"))
    assert moe.endswith("flat within the rows' spread") and "+3% against the layers' spread 9.5%" in moe
    assert attention.endswith("still grows") and "x2.00" in attention


# ----------------------------------------------------------------------------------------------
# the box kit's real-shape timing rows: what notebook 13 calibrates on when they land

KIT_TRUTH = dict(attention=0.4, moe=0.7, rest=0.5, drafter=0.3)  # the efficiencies the fixture rows are made with
KIT_HARDWARE = projection.measured_hardware([{"device": "NVIDIA H200", "copy_bandwidth": "4.2e12",
                                              "matmul_flops": "7.9e14"}], tp=1)


def kit_real_shape_rows(*, pair: str = "real-shapes-4L:kimi-k2.6+kimi-k2.6-dflash", ceilings: bool = True) -> list[dict]:
    """Fixture rows in the box kit's box_verify_step format (bench.tp_step's segments, the kit's stamps) of a
    one-GPU real-shape run with INT4 experts, timed as K2.6 at the KIT_TRUTH efficiencies would time them."""
    stamp = {"date": "2026-12-02T07:00:00Z", "commit": "f1x7ure", "device": "NVIDIA H200", "run": "2026-12-02T06:58:00Z",
             "pair": pair, "tp": "1", "gpus": "1", "drafter_placement": "sharded", "real_shape": "True", "layers": "4",
             "dtype": "bfloat16", "expert_bits": "4.5",
             **({"copy_bandwidth": "4.2e12", "matmul_flops": "7.9e14"} if ceilings else {})}
    drafter = projection.real_drafter_config(K26)
    rows = []
    for context in (4096, 32768):
        for batch in (1, 8):
            for nodes in (1, 8, 32, 128):
                where = {**stamp, "batch": str(batch), "nodes": str(nodes), "context": str(context)}
                for graph in ("False", "True"):
                    for layer in range(4):
                        moe = layer >= K26.first_k_dense_replace
                        ideal = layer_costs(K26, KIT_HARDWARE, batch=batch, nodes=nodes, context=context, moe_layer=moe,
                                            expert_bits=4.5)
                        rows.append({**where, "graph": graph, "scope": "layer", "layer": str(layer), "moe_layer": str(moe),
                                     "attention_seconds": str(ideal["attention"] / KIT_TRUTH["attention"]),
                                     "moe_seconds": str(ideal["moe"] / KIT_TRUTH["moe"]), "allreduce_seconds": "0.0",
                                     "rest_seconds": "1e-05"})
                    head = step_costs(K26, KIT_HARDWARE, batch=batch, nodes=nodes, context=context)["rest"]
                    rows.append({**where, "graph": graph, "scope": "step", "head_seconds": str(head / KIT_TRUTH["rest"]),
                                 "step_seconds": "0.01"})
                if nodes > 1:
                    seconds = projection.drafter_seconds(drafter, KIT_HARDWARE, batch=batch, context=context, head_shards=1)
                    rows.append({**where, "scope": "draft", "drafter_seconds": str(2 * seconds / KIT_TRUTH["drafter"]),
                                 "drafter_graph_seconds": str(seconds / KIT_TRUTH["drafter"]), "draft_topk_seconds": "2e-05",
                                 "tree_build_seconds": "1e-05", "accept_compact_seconds": "1e-05", "tree_timing": "cuda_graph"})
    return rows


def test_the_kits_real_shape_rows_replace_the_sweeps_for_calibration_and_the_drafter():
    """K2.6's real-shape rows measured on a GPU are the rows read; the experts' width is the rows' (INT4 here: read as
    bf16 the MoE efficiency would come out wrong); the drafter is fitted as the real drafter's shapes. Rows of a CPU dry
    run (no ceilings) or of other shapes are not read: the sweep's rows stay."""
    sweep = read_rows("tp_verify_step")
    kit = kit_real_shape_rows()
    timing = projection.timing_rows(sweep, kit + kit_real_shape_rows(ceilings=False)[:3],
                                    kit_file="runs/box/box_verify_step.csv")
    assert timing.real_drafter and timing.source.startswith("runs/box/box_verify_step.csv: the box kit's real-shape run")
    assert "4 layers of K2.6" in timing.source and "expert_bits 4.5" in timing.source
    assert len(timing.rows) == len(kit)
    efficiency, hardware, used = projection.calibrate_on_rows(timing.rows, K26, graph=True)
    assert (efficiency.attention, efficiency.moe, efficiency.rest) == pytest.approx(
        (KIT_TRUTH["attention"], KIT_TRUTH["moe"], KIT_TRUTH["rest"]))
    assert projection.rows_expert_bits(used) == 4.5 and hardware.gpus == 1
    check = projection.calibration_fit(used, K26, hardware, efficiency)  # the rows' own width, so it reproduces them
    assert all(abs(fit["residual_low"]) < 1e-9 and abs(fit["residual_high"]) < 1e-9 for fit in check.values()), check
    drafts = projection.select_rows(timing.rows, "draft")
    fitted = projection.drafter_efficiency(drafts, projection.real_drafter_config(K26), hardware)
    assert fitted == pytest.approx(KIT_TRUTH["drafter"])  # the graph time, what a captured decode pays
    for others in ([], kit_real_shape_rows(ceilings=False), kit_real_shape_rows(pair="real-shapes-2L:target+drafter")):
        fallback = projection.timing_rows(sweep, others, kit_file="runs/box/box_verify_step.csv")
        assert not fallback.real_drafter and fallback.rows == projection.latest_rows(sweep)
        assert fallback.source.startswith("data/results/tp_verify_step.csv")
    with pytest.raises(ValueError, match="several expert_bits"):
        projection.rows_expert_bits([{"expert_bits": "4.5"}, {"expert_bits": "16"}])


def test_notebook_13_reads_the_kits_real_shape_rows(tmp_path):
    """Notebook 13 run with box_results_dir holding the fixture rows: it calibrates on them (their efficiencies
    come back), fits the drafter as the real one's, and says so."""
    from kdtree_lib import results
    from kdtree_lib.notebooks import discover, read_record, run_notebook
    box_dir = tmp_path / "box"
    results.append_rows("box_verify_step", kit_real_shape_rows(), results_dir=box_dir)
    path = discover(only=["13"])[0]
    run = run_notebook(path, tmp_path / "run", {"box_results_dir": str(box_dir), "depth_budgets": [8],
                                                "stop_rule_tokens": 16}, cell_timeout=1800)
    assert run.ok, f"{path.name} failed (executed copy: {run.output}): {run.error}"
    values = read_record(tmp_path / "run", path.stem)
    assert values["timing_from_kit"] and values["timing_source"].startswith(f"{box_dir}/box_verify_step.csv")
    assert values["calibrated"] and values["efficiency"]["attention"] == pytest.approx(KIT_TRUTH["attention"])
    assert values["efficiency"]["moe"] == pytest.approx(KIT_TRUTH["moe"])
    assert values["drafter_efficiency"] == pytest.approx(KIT_TRUTH["drafter"])
