"""Commands that measure for long (the box kit, the acceptance sweep) check where their rows go before
measuring, and the acceptance sweep writes each measurement's rows as it completes."""
import pytest

from kdtree_lib import acceptance, box, results
from kdtree_lib.pairs import stand_in_paths


@pytest.fixture
def unwritable(tmp_path):
    """A results folder that cannot be made (its parent is a file), whoever runs the test (root too)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    return blocker / "rows"


def refused(call, capsys) -> str:
    """The one-line message a command refuses with: its ValueError, or what it printed on exiting non-zero."""
    try:
        code = call()
    except ValueError as error:
        return str(error)
    assert code != 0
    return capsys.readouterr().err


def test_the_box_kit_checks_its_results_folder_before_loading_or_measuring(unwritable, monkeypatch, capsys):
    target, drafter = stand_in_paths(8)
    monkeypatch.setattr(box, "kit_rank", lambda *args, **kwargs: pytest.fail("measured before checking the folder"))
    settings = box.KitSettings(target=str(target), drafter=str(drafter), results_dir=str(unwritable), device="cpu")
    with pytest.raises(ValueError, match=f"^results_dir: cannot write rows to {unwritable}: .* is not a folder"):
        box.run_kit(settings)
    code = box.main(["--target", str(target), "--drafter", str(drafter), "--results-dir", str(unwritable),
                     "--device", "cpu"])
    assert code == 2 and f"results_dir: cannot write rows to {unwritable}" in capsys.readouterr().err


def test_the_box_kit_refuses_a_read_only_topic_file_before_measuring(tmp_path, monkeypatch):
    target, drafter = stand_in_paths(8)
    path = results.append_rows(box.TOPICS["union"], [{"x": 1}], results_dir=tmp_path)
    path.chmod(0o444)
    monkeypatch.setattr(box, "kit_rank", lambda *args, **kwargs: pytest.fail("measured before checking the folder"))
    with pytest.raises(ValueError, match="^results_dir: .*read-only"):
        box.run_kit(box.KitSettings(target=str(target), drafter=str(drafter), results_dir=str(tmp_path), device="cpu"))


TINY = ["--block-sizes", "8", "--budgets", "2", "--live-budgets", "2", "--prompt-tokens", "16", "--new-tokens", "4",
        "--prompts-per-package", "1", "--temperature", "0"]


def test_the_acceptance_sweep_checks_its_results_folder_before_measuring(unwritable, monkeypatch, capsys):
    monkeypatch.setattr(acceptance, "pair_with_prompts", lambda *a, **k: pytest.fail("measured before checking"))
    message = refused(lambda: acceptance.main(TINY + ["--results-dir", str(unwritable)]), capsys)
    assert f"results_dir: cannot write rows to {unwritable}" in message


def test_an_acceptance_sweep_stopped_mid_way_keeps_what_it_measured(tmp_path, monkeypatch):
    class Stopped(Exception):
        pass

    def stop(*args, **kwargs):  # the run is killed once the oracle is measured, before the live decodes end
        raise Stopped

    monkeypatch.setattr(acceptance, "live_rows", stop)
    with pytest.raises(Stopped):
        acceptance.main(TINY + ["--results-dir", str(tmp_path)])
    rows = results.read_rows(acceptance.TOPIC, results_dir=tmp_path)
    assert sorted(r["mode"] for r in rows) == ["chain", "tree"] and {r["source"] for r in rows} == {"oracle"}
    assert len({r["run"] for r in rows}) == 1 and {(r["prompt_tokens"], r["new_tokens"]) for r in rows} == {("16", "4")}
