"""Notebooks 11 and 12 on a pair by path at TP=2 over gloo: the made-to-format real pair (K2.6's layout, INT4
experts, a YaRN DFlash drafter, random weights), as the box's operators run them on the real pair. Notebook 11
records the oracle on the ranks (every rank in lockstep, rank 0's records) and its rounds equal the live TP
decode's; notebook 12 times the pair's own verify step on the ranks and plots those rows."""
import pytest

from kdtree_lib.pair_reference import save_kimi_pair
from kdtree_lib.notebooks import read_record, run_notebook
from kdtree_lib.paths import NOTEBOOKS_DIR


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_kimi_pair(tmp_path_factory.mktemp("kimi-pair"))


def run(name, tmp_path, parameters):
    path = next(NOTEBOOKS_DIR.glob(f"{name}*.ipynb"))
    result = run_notebook(path, tmp_path, parameters, figures_dir=tmp_path / "figures", cell_timeout=1200)
    assert result.ok, f"{path.name} failed (executed copy: {result.output}): {result.error}"
    return read_record(tmp_path, path.stem)


def test_notebook_11_records_the_oracle_on_tp_ranks(pair, tmp_path):
    target, drafter = pair
    values = run("11", tmp_path, dict(target_path=str(target), drafter_path=str(drafter), tp=2, budgets=[1, 4],
                                      live_budgets=[4], prompts_per_package=1, prompt_tokens=12, new_tokens=6,
                                      temperature=0.0))
    assert values["tp"] == 2 and values["oracle_equals_live"]
    assert values["cases"] == 2 * len(values["packages"])  # tree and chain at one budget, per package


def test_notebook_12_times_the_pair_on_tp_ranks(pair, tmp_path):
    target, drafter = pair
    values = run("12", tmp_path, dict(target_path=str(target), drafter_path=str(drafter), tp=2, pair_nodes=[1, 4],
                                      pair_repeats=1))
    assert values["pair_rows"] > 0 and values["pair_tp"] == 2 and values["rounds_plotted"] > 0
    assert values["n_routed_experts"] != 384  # the pair's own config, not K2.6's
