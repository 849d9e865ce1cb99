"""bench_decode.summary: two bars and the pair's draft-bound ceiling, from rows."""
import pytest

from kdtree_lib.bench import decode as bench_decode


def _row(impl, method, budget, graph, tokens_per_second, acceptance, ms_per_round):
    return {"impl": impl, "method": method, "batch": "1", "budget": str(budget), "cuda_graph": str(graph),
            "pair": "p", "tokens_per_second": str(tokens_per_second), "mean_acceptance": str(acceptance),
            "ms_per_round": str(ms_per_round)}


def test_summary_speedup_ceiling_and_reference_ratio():
    rows = [_row("kdtree", "ar", 1, True, 1000.0, 1.0, 1.0),
            _row("kdtree", "chain", 7, True, 1500.0, 3.0, 2.0),
            _row("kdtree", "ddtree", 8, True, 1600.0, 4.0, 2.5),
            _row("kdtree", "ddtree", 8, False, 160.0, 4.0, 25.0),
            _row("reference_style", "ddtree", 8, False, 200.0, 4.0, 20.0)]
    (line,) = bench_decode.summary(rows)
    assert line["speedup_vs_ar"] == pytest.approx(1.6)
    assert line["speedup_target"] == pytest.approx(3.2) and not line["meets_speedup_target"]
    assert line["draft_bound_ceiling"] == pytest.approx(4.0 * 1.0 / 2.0)     # acceptance x AR ms / chain ms
    assert line["vs_ceiling"] == pytest.approx(0.8)
    assert line["graph_gain"] == pytest.approx(10.0)
    assert line["vs_reference_style"] == pytest.approx(8.0)


def test_summary_takes_the_newest_row_of_each_setting():
    old = _row("kdtree", "ddtree", 8, True, 100.0, 4.0, 40.0)
    rows = [_row("kdtree", "ar", 1, True, 1000.0, 1.0, 1.0), old, _row("kdtree", "ddtree", 8, True, 2000.0, 4.0, 2.0)]
    (line,) = bench_decode.summary(rows)
    assert line["tokens_per_second"] == 2000.0
