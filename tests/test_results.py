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
