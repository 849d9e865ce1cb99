"""The CT200 cost model: structure, limits and calibration round trip."""
from dataclasses import replace
from pathlib import Path

import pytest

from kdtree_lib.model.config import load_config
from kdtree_lib.projection import (CT200, Efficiency, assumptions, calibrate, expected_distinct_experts,
                                   layer_costs, projected_speedup, step_costs)

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
