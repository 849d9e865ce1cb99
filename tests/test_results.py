"""Results files: append-only, stamped rows; merging rows made on another machine keeps their stamps."""
import pytest

from kdtree_lib import results


def test_append_is_append_only_and_widens_columns(tmp_path):
    results.append_rows("demo", [{"x": 1}], results_dir=tmp_path)
    results.append_rows("demo", [{"x": 2, "y": 3}], results_dir=tmp_path)
    rows = results.read_rows("demo", results_dir=tmp_path)
    assert [r["x"] for r in rows] == ["1", "2"]
    assert rows[0]["y"] == "" and rows[1]["y"] == "3"
    assert all(r["date"] and r["commit"] and r["device"] for r in rows)


def test_merge_keeps_the_remote_stamps(tmp_path):
    remote, local = tmp_path / "remote", tmp_path / "local"
    results.append_rows("demo", [{"x": 1}], results_dir=local)
    path = results.append_rows("demo", [{"date": "2026-01-01T00:00:00Z", "commit": "abc1234",
                                         "device": "NVIDIA H200", "x": 7}], results_dir=remote)
    results.merge_file(path, results_dir=local)
    rows = results.read_rows("demo", results_dir=local)
    assert [r["x"] for r in rows] == ["1", "7"]
    assert (rows[1]["commit"], rows[1]["device"]) == ("abc1234", "NVIDIA H200")


def test_merge_rejects_a_file_without_stamps(tmp_path):
    path = tmp_path / "plain.csv"
    path.write_text("x\n1\n")
    with pytest.raises(ValueError, match="path"):
        results.merge_file(path, results_dir=tmp_path / "out")


def test_latest_run_picks_the_newest_run_or_the_newest_holding_a_row():
    def row(run, date, provider, config):
        return {"run": run, "date": date, "commit": "c", "device": "H200", "provider": provider, "config": config,
                "time_us": "1.5"}
    rows = [row("r1", "d1", "kernel", "a"), row("r1", "d1", "kernel_variant", "b"),
            row("r2", "d2", "kernel", "a"), row("r3", "d3", "kernel", "c")]
    assert [r["run"] for r in results.latest_run(rows)] == ["r3"]
    older = results.latest_run(rows, provider="kernel_variant", config="b")
    assert [r["config"] for r in older] == ["a", "b"] and older[0]["time_us"] == 1.5  # numbers parsed
    assert results.latest_run(rows, config="z") == []


def test_recent_runs_newest_first_by_their_newest_row():
    rows = [{"run": run, "date": date, "commit": "c", "device": "H200", "provider": "kernel"}
            for run, date in (("r1", "d1"), ("r2", "d2"), ("r1", "d3"), ("r3", "d0"))]
    assert [[r["date"] for r in run] for run in results.recent_runs(rows)] == [["d1", "d3"], ["d2"], ["d0"]]
    assert [run[0]["run"] for run in results.recent_runs(rows, 2)] == ["r1", "r2"]
    assert results.recent_runs(rows, provider="sdpa") == []


def test_parse_number_reads_cells_back():
    assert [results.parse_number(x) for x in ("3", "2.5", "True", "False", "", "bf16")] == [3, 2.5, True, False, None,
                                                                                         "bf16"]


def test_largest_run_tells_two_commands_of_the_same_second_apart():
    """Rows of one stamp but two run ids are two measurements; without a run id the stamp groups them."""
    from kdtree_lib.results import largest_run, new_run_id
    first, second = new_run_id(), new_run_id()
    assert first != second
    stamp = {"date": "2026-12-01T00:00:00Z", "commit": "abc", "device": "cpu"}
    rows = [{**stamp, "run": first, "size": 8}, {**stamp, "run": first, "size": 8}, {**stamp, "run": second, "size": 4}]
    picked = largest_run(rows, lambda run_rows: sum(r["size"] for r in run_rows))
    assert {r["run"] for r in picked} == {first}
    assert len(largest_run([{**r, "run": ""} for r in rows], len)) == 3
