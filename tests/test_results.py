"""Results files: append-only, stamped rows, safe under parallel and killed writers; merging rows made on
another machine keeps their stamps, adds each row once and refuses malformed files whole."""
import multiprocessing
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

from kdtree_lib import results
from kdtree_lib.paths import REPO_ROOT


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


# ----------------------------------------------------------------------------------------------
# concurrent writers, killed writers

def _append_many(results_dir, writer, count, start):
    start.wait()
    for index in range(count):
        results.append_rows("demo", [{"writer": writer, "index": index}], results_dir=results_dir)


def test_parallel_writers_lose_no_row_and_write_one_header(tmp_path, monkeypatch):
    monkeypatch.setenv("KDTREE_COMMIT", "abc1234")  # the forked writers run no git and touch no GPU
    monkeypatch.setattr(results, "device_name", lambda: "test-device")
    context = multiprocessing.get_context("fork")
    writers, count = 4, 40
    start = context.Barrier(writers)
    processes = [context.Process(target=_append_many, args=(tmp_path, w, count, start)) for w in range(writers)]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    assert [p.exitcode for p in processes] == [0] * writers
    rows = results.read_rows("demo", results_dir=tmp_path)
    assert sorted((int(r["writer"]), int(r["index"])) for r in rows) == \
        [(w, i) for w in range(writers) for i in range(count)]
    lines = (tmp_path / "demo.csv").read_text().splitlines()
    assert lines.count(lines[0]) == 1 and len(lines) == writers * count + 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [results.LOCK_NAME, "demo.csv"], "appends leave no other file"


def _rewrite_and_hang(results_dir, ready):
    def hang(*args):
        ready.set()
        time.sleep(3600)  # killed by the test long before
    os.replace = hang
    results.append_rows("demo", [{"x": 2, "new_column": 3}], results_dir=results_dir)


def test_a_writer_killed_mid_rewrite_leaves_nothing_git_tracks_and_the_next_writer_cleans_up(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "device_name", lambda: "test-device")  # the forked writer touches no GPU
    folder = tmp_path / "results"
    results.append_rows("demo", [{"x": 1}], results_dir=folder)
    before = (folder / "demo.csv").read_bytes()
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    writer = context.Process(target=_rewrite_and_hang, args=(folder, ready))
    writer.start()
    try:
        assert ready.wait(300), "the writer never reached its rename"
    finally:
        writer.kill()
        writer.join()
    assert (folder / "demo.csv").read_bytes() == before, "a killed rewrite leaves the old file"
    leftovers = sorted(p.name for p in folder.iterdir() if p.name not in ("demo.csv", results.LOCK_NAME))
    assert leftovers, "the killed writer was caught after writing its temp file"
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *(f"data/results/{name}" for name in leftovers)],
                             cwd=REPO_ROOT, capture_output=True, text=True).stdout.split()
    assert sorted(Path(p).name for p in ignored) == leftovers, "git must ignore what a killed writer leaves"
    results.append_rows("demo", [{"x": 3}], results_dir=folder)  # the lock died with the writer
    assert sorted(p.name for p in folder.iterdir()) == [results.LOCK_NAME, "demo.csv"]
    assert [r["x"] for r in results.read_rows("demo", results_dir=folder)] == ["1", "3"]


def test_a_torn_last_row_stays_one_row_and_merge_names_it(tmp_path):
    results.append_rows("demo", [{"x": 1, "y": 2}], results_dir=tmp_path)
    with open(tmp_path / "demo.csv", "a") as handle:
        handle.write("2026-01-01T00:00:00Z,abc,cpu,7")  # a writer killed mid-row
    results.append_rows("demo", [{"x": 3, "y": 4}], results_dir=tmp_path)
    assert [r["x"] for r in results.read_rows("demo", results_dir=tmp_path)] == ["1", "7", "3"]
    with pytest.raises(ValueError, match="demo.csv line 3: 4 fields where the header has 5"):
        results.merge_file(tmp_path / "demo.csv", results_dir=tmp_path / "home")


# ----------------------------------------------------------------------------------------------
# what is refused

@pytest.mark.parametrize("topic", ["../x", "/tmp/x", "a/b", "..", "", ".hidden", "a\\0b", 7])
def test_a_topic_outside_the_results_folder_is_refused(tmp_path, topic):
    folder = tmp_path / "results"
    with pytest.raises(ValueError, match="^topic: "):
        results.append_rows(topic, [{"x": 1}], results_dir=folder)
    with pytest.raises(ValueError, match="^topic: "):
        results.read_rows(topic, results_dir=folder)
    assert list(tmp_path.rglob("*.csv")) == []


def test_the_command_line_refuses_a_topic_outside_the_folder_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KDTREE_RESULTS_DIR", str(tmp_path / "results"))
    source = results.append_rows("demo", [{"x": 1}], results_dir=tmp_path / "remote")
    assert results.main(["merge", str(source), "--topic", "../escaped"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("python -m kdtree_lib.results: topic: ") and "'../escaped'" in error and error.count("\n") == 1
    assert not (tmp_path / "escaped.csv").exists() and not (tmp_path / "results").exists()


def test_a_read_only_results_file_is_refused_not_replaced(tmp_path):
    path = results.append_rows("demo", [{"x": 1}], results_dir=tmp_path)
    before = path.read_bytes()
    path.chmod(0o444)
    for row in ({"x": 2}, {"x": 2, "new": 1}):  # an append and a widening rewrite
        with pytest.raises(PermissionError, match="read-only"):
            results.append_rows("demo", [row], results_dir=tmp_path)
    assert path.read_bytes() == before and stat.S_IMODE(path.stat().st_mode) == 0o444
    with pytest.raises(ValueError, match=f"^results_dir: .*{tmp_path}.*read-only"):
        results.check_writable(tmp_path, topics=("demo",))


def test_a_symlinked_results_file_is_refused_and_stays_a_link(tmp_path):
    target = results.append_rows("elsewhere", [{"x": 1}], results_dir=tmp_path / "other")
    link = tmp_path / "results" / "demo.csv"
    link.parent.mkdir()
    link.symlink_to(target)
    before = target.read_bytes()
    for row in ({"x": 2}, {"x": 2, "new": 1}):
        with pytest.raises(ValueError, match="symbolic link"):
            results.append_rows("demo", [row], results_dir=link.parent)
    assert link.is_symlink() and target.read_bytes() == before


def test_appends_and_rewrites_keep_the_files_permissions(tmp_path):
    path = results.append_rows("demo", [{"x": 1}], results_dir=tmp_path)
    path.chmod(0o664)
    results.append_rows("demo", [{"x": 2}], results_dir=tmp_path)
    results.append_rows("demo", [{"x": 3, "y": 4}], results_dir=tmp_path)  # widens: a rewrite
    assert stat.S_IMODE(path.stat().st_mode) == 0o664
    assert [(r["x"], r["y"]) for r in results.read_rows("demo", results_dir=tmp_path)] == [("1", ""), ("2", ""),
                                                                                            ("3", "4")]


def test_check_writable_names_the_folder_and_creates_nothing(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=f"^results_dir: cannot write rows to {blocker}/rows: {blocker} is not a"):
        results.check_writable(blocker / "rows")
    assert results.check_writable(tmp_path / "new" / "rows") == tmp_path / "new" / "rows"
    assert not (tmp_path / "new").exists()


# ----------------------------------------------------------------------------------------------
# merging

def remote_file(tmp_path, name="demo.csv", text=None):
    path = tmp_path / "remote" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(text if text is not None else
                    "date,commit,device,run,size\n"
                    "2026-01-01T00:00:00Z,abc1234,H200,big,8\n2026-01-01T00:00:00Z,abc1234,H200,big,8\n")
    return path


def test_a_second_merge_adds_nothing_and_the_largest_run_stays(tmp_path):
    local = tmp_path / "local"
    results.append_rows("demo", [{"run": "small", "size": 4}, {"run": "small", "size": 4},
                                 {"run": "small", "size": 4}], results_dir=local)
    path = remote_file(tmp_path)

    def largest():
        return {r["run"] for r in results.largest_run(results.read_rows("demo", results_dir=local),
                                                      lambda rows: sum(int(r["size"]) for r in rows))}
    results.merge_file(path, results_dir=local)
    assert largest() == {"big"}
    before = (local / "demo.csv").read_bytes()
    assert results.merge_files([path, path], results_dir=local) == [(path, local / "demo.csv", 0)] * 2
    assert (local / "demo.csv").read_bytes() == before and largest() == {"big"}
    rows = results.read_rows("demo", results_dir=local)
    assert [r["run"] for r in rows] == ["small"] * 3 + ["big"] * 2, "a file's own repeated rows are kept"


def test_a_file_is_not_merged_into_itself(tmp_path):
    path = results.append_rows("demo", [{"x": 1}], results_dir=tmp_path)
    before = path.read_bytes()
    with pytest.raises(ValueError, match="merged into"):
        results.merge_file(path, results_dir=tmp_path)
    with pytest.raises(ValueError, match="merged into"):
        results.merge_file(tmp_path / ".." / tmp_path.name / "demo.csv", results_dir=tmp_path)
    assert path.read_bytes() == before


STAMPS = "2026-01-01T00:00:00Z,abc1234,H200"


@pytest.mark.parametrize("body, message", [
    (f"{STAMPS},1\ndate,commit,device,x\n{STAMPS},2\n", "line 3: a second header line"),
    (f"{STAMPS},1\n{STAMPS},2,9\n", "line 3: 5 fields where the header has 4"),
    (f"{STAMPS},1\n{STAMPS}\n", "line 3: 3 fields where the header has 4"),
    (f"{STAMPS},1\n{STAMPS},\"2\n{STAMPS},3\n", "line 3: .*unterminated quote"),
    (f"{STAMPS},\"a\nb\"\n{STAMPS},1,2\n", "line 4: 5 fields"),  # a quoted line break counts its lines
    (f",abc1234,H200,1\n", "line 2: no date stamp"),
])
def test_malformed_files_are_refused_with_their_line_and_nothing_is_merged(tmp_path, body, message, capsys,
                                                                          monkeypatch):
    monkeypatch.setenv("KDTREE_RESULTS_DIR", str(tmp_path / "local"))
    good = remote_file(tmp_path, "good.csv")
    bad = remote_file(tmp_path, "bad.csv", "date,commit,device,x\n" + body)
    with pytest.raises(ValueError, match=f"^path: {bad} {message}"):
        results.merge_file(bad, results_dir=tmp_path / "local")
    assert results.main(["merge", str(good), str(bad), "--topic", "demo"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and str(bad) in error and "line" in error
    assert not (tmp_path / "local").exists()  # nothing half-merged: the good file waited for the bad one
