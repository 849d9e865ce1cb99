"""The stand-in pairs' shapes and the drafter/target step-time ratio (kdtree_lib.standin): the layer-time
model on hand-made rows, the proposal against the real pair's ratio as the CT200 projection computes it,
and the command that prints them."""
import re

import pytest

from kdtree_lib import standin

PAIR = "k26-mini+k26-mini-dflash"


def decode_row(method: str, ms: float, *, date="2026-12-02T00:00:00Z", graph_column=True, **extra) -> dict:
    row = {"date": date, "commit": "abc1234", "device": "NVIDIA H200", "impl": "kdtree", "method": method,
           "batch": "1", "cuda_graph": "True", "pair": PAIR, "ms_per_round": str(ms * 1.01),
           "graph_step_ms": str(ms) if graph_column else ""}
    return row | extra


def test_layer_times_from_rows():
    """Per-layer seconds = (measured step - bytes / bandwidth) / layers, the newest rows of the pair
    only, the graph step where a row has it."""
    configs = standin.current_configs()
    bandwidth = 4e12
    rows = [decode_row("ar", 1.2), decode_row("chain", 2.4),
            decode_row("ar", 9.0, date="2026-11-01T00:00:00Z"),                      # older: not read
            decode_row("chain", 9.0, pair="other+pair"), decode_row("ar", 9.0, batch="8"),
            decode_row("chain", 9.0, cuda_graph="False")]
    times = standin.fit_layer_times(rows, bandwidth, configs, PAIR)
    target_bytes = standin.target_step_bytes(configs.target)
    drafter_bytes = standin.drafter_step_bytes(configs.drafter)
    assert times.target_layer == pytest.approx((1.2e-3 - target_bytes / bandwidth) / 6, rel=1e-12)
    assert times.drafter_layer == pytest.approx((2.4e-3 - 1.2e-3 - drafter_bytes / bandwidth) / 5, rel=1e-12)
    # the fitted pair's own steps come back, so its ratio is the measured one
    assert times.target_seconds(configs.target) == pytest.approx(1.2e-3, rel=1e-12)
    assert times.ratio(configs) == pytest.approx((2.4 - 1.2) / 1.2, rel=1e-12)
    # a pair with twice the target's layers and a fifth of the drafter's: its ratio follows the layers
    deep = standin.pair_configs(standin.shape_of(standin.DEEP))
    expected = ((2 * times.drafter_layer + standin.drafter_step_bytes(deep.drafter) / bandwidth)
                / (16 * times.target_layer + standin.target_step_bytes(deep.target) / bandwidth))
    assert standin.standin_ratio(deep, times) == pytest.approx(expected, rel=1e-12)
    older_format = [decode_row("ar", 1.2, graph_column=False), decode_row("chain", 2.4, graph_column=False)]
    assert standin.fit_layer_times(older_format, bandwidth, configs, PAIR).target_layer == pytest.approx(
        (1.212e-3 - target_bytes / bandwidth) / 6, rel=1e-12)


def test_layer_times_refuse_missing_or_impossible_rows():
    configs = standin.current_configs()
    with pytest.raises(ValueError, match="chain"):
        standin.fit_layer_times([decode_row("ar", 1.2)], 4e12, configs, PAIR)
    with pytest.raises(ValueError, match="no per-layer time"):
        standin.fit_layer_times([decode_row("ar", 1.2), decode_row("chain", 1.2)], 4e12, configs, PAIR)


def test_step_bytes_count_the_touched_experts_only():
    deep = standin.pair_configs(standin.shape_of(standin.DEEP)).target
    stored, step = standin.target_bytes(deep), standin.target_step_bytes(deep)
    routed = 15 * 32 * 3 * 256 * 64 * (0.5 + 2 / 32)   # 15 MoE layers of 32 INT4 experts
    embedding = 8192 * 256 * 2
    assert stored - step == pytest.approx(routed * (1 - 8 / 32) + embedding, rel=1e-12)


def test_the_proposal_against_the_real_pair():
    """The committed rows: the fit returns the current pair's own measured ratio, (chain round - AR step) /
    AR step (0.84 on the H200 at 24eeaaa; about 1.0 before the RMSNorm kernel and the op cuts); k26-deep's
    modelled ratio lies between the real pair's at DDTree's budgets (32 and 8) and below its AR-step ratio."""
    times = standin.committed_layer_times()
    ar, chain = (float(part.split(" ms")[0]) for part in re.findall(r"(?:AR step|chain round) ([\d.]+ ms)", times.source))
    assert times.ratio(standin.current_configs()) == pytest.approx((chain - ar) / ar, abs=0.002)  # ms printed to 3 places
    assert times.ratio(standin.current_configs()) < 1.0  # the current drafter: most of a target step
    proposed = times.ratio(standin.pair_configs(standin.shape_of(standin.DEEP)))
    real = standin.real_pair_ratios()
    assert real["budget 32"] < real["budget 8"] < real["AR step"]
    assert real["budget 32"] <= proposed <= real["budget 8"] and 0.1 <= proposed <= 0.2


def test_command_prints_sizes_and_ratios(capsys):
    assert standin.main([]) == 0
    out = capsys.readouterr().out
    assert "together 44.5 MB (budget 48 MB)" in out
    assert "k26-deep drafter" in out and "real pair on the box" in out and "ms/step" in out
