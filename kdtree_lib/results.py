"""Results rows: one CSV per topic in data/results/, append-only, written atomically.

Every row carries date, commit, device and backend next to its parameters and metrics, so runs on
different machines (the H200 here, the Blackwell box) can be compared and plotted from the files.
"""
from __future__ import annotations

import csv
import datetime as _dt
import os
import subprocess
import tempfile
import uuid
from pathlib import Path

from . import cli
from .backend import device_name
from .paths import REPO_ROOT, RESULTS_DIR  # $KDTREE_RESULTS_DIR overrides RESULTS_DIR (tests write elsewhere)

STAMP_COLUMNS = ("date", "commit", "device")


def git_commit() -> str:
    """The commit being measured: $KDTREE_COMMIT (set where the tree travels without .git), else git."""
    if os.environ.get("KDTREE_COMMIT"):
        return os.environ["KDTREE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def new_run_id() -> str:
    """A stamp for the rows of one command: its start time and a random suffix, so two commands in the
    same second are still two runs."""
    return f"{_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')}-{uuid.uuid4().hex[:8]}"


def stamp() -> dict:
    return {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": git_commit(), "device": device_name()}


def append_rows(topic: str, rows: list[dict], *, results_dir: Path | None = None) -> Path:
    """Append rows (stamped with date/commit/device) to <results_dir>/<topic>.csv atomically.

    Earlier rows are never rewritten: the file is copied with the new rows added and renamed over
    the old one, so a crash leaves either the old file or the new one. New columns widen the file
    (earlier rows get empty cells).
    """
    if not rows:
        raise ValueError("rows: expected at least one row")
    directory = resolve_results_dir(results_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{topic}.csv"
    stamp_values = stamp()
    new_rows = [{**stamp_values, **row} for row in rows]
    old_rows = read_rows(topic, results_dir=directory) if path.exists() else []
    columns = list(STAMP_COLUMNS)
    for row in old_rows + new_rows:
        columns += [c for c in row if c not in columns]
    with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False, newline="") as tmp:
        writer = csv.DictWriter(tmp, fieldnames=columns)
        writer.writeheader()
        writer.writerows(old_rows + new_rows)
    os.replace(tmp.name, path)
    return path


def read_rows(topic: str, *, results_dir: Path | None = None) -> list[dict]:
    """All rows of a topic as dicts of strings (empty list when there is no file yet)."""
    path = resolve_results_dir(results_dir) / f"{topic}.csv"
    if not path.exists():
        return []
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def parse_number(text):
    """A CSV cell as what it holds: int, float, bool ("True"/"False"), None (empty), else the text."""
    if text in ("", None):
        return None
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def matches(value, wanted) -> bool:
    """Whether a cell (text from a file, or a parsed value) holds `wanted`: numbers compare as numbers
    ("8", 8 and 8.0 are one value), a boolean as its text or 0/1, everything else as text."""
    if isinstance(wanted, bool):
        return str(value) in (str(wanted), str(int(wanted)))
    if isinstance(wanted, (int, float)):
        try:
            return float(value) == float(wanted)
        except (TypeError, ValueError):
            return False
    return str(value) == str(wanted)


def select(rows: list[dict], **where) -> list[dict]:
    """The rows whose every column in `where` holds the given value (see `matches`)."""
    return [row for row in rows if all(matches(row.get(column), wanted) for column, wanted in where.items())]


def newest_per(rows: list[dict], keys: tuple[str, ...], **where) -> list[dict]:
    """Of the rows matching `where`, the last one (in file order: the newest) per value of `keys`."""
    newest = {}
    for row in select(rows, **where):
        newest[tuple(str(row.get(k)) for k in keys)] = row
    return list(newest.values())


def largest_run(rows: list[dict], size, **where) -> list[dict]:
    """The rows matching `where` of the biggest measurement by size(its rows), the newest of equal ones:
    the numbers to report, whatever smaller runs were appended since. A measurement is its `run` stamp,
    else the rows written together (one date/commit/device stamp, to the second)."""
    runs: dict[tuple, list[dict]] = {}
    for row in select(rows, **where):
        key = (row["run"],) if row.get("run") else tuple(row.get(k) for k in STAMP_COLUMNS)
        runs.setdefault(key, []).append(row)
    if not runs:
        return []
    return max(runs.values(), key=lambda run_rows: (size(run_rows), max(r.get("date") or "" for r in run_rows)))


def as_float(cell) -> float:
    """A cell as a float, nan when empty or not a number (for arithmetic and plotting)."""
    try:
        return float(cell)
    except (TypeError, ValueError):
        return float("nan")


def latest_run(rows: list[dict], **fixed) -> list[dict]:
    """The rows of the newest run, numbers parsed; with `fixed` (column=value, see `matches`), of the
    newest run holding such a row. A run is its `run` stamp (rows from before that
    column existed are grouped by commit and device)."""
    runs = recent_runs(rows, 1, **fixed)
    return runs[0] if runs else []


def recent_runs(rows: list[dict], count: int | None = None, **fixed) -> list[list[dict]]:
    """The rows of the `count` newest runs (all runs if None), newest first, numbers parsed;
    `fixed` as in latest_run. A run's age is its newest row's date."""
    newest = {}
    for row in rows:
        if all(matches(row.get(k), v) for k, v in fixed.items()):
            run = _run_id(row)
            newest[run] = max(newest.get(run, ""), row["date"])
    order = sorted(newest, key=newest.get, reverse=True)[:count]
    by_run = {run: [] for run in order}
    for row in rows:
        if _run_id(row) in by_run:
            by_run[_run_id(row)].append({k: parse_number(v) for k, v in row.items()})
    return [by_run[run] for run in order]


def _run_id(row) -> str:
    return row.get("run") or f"{row['commit']}@{row['device']}"


def merge_file(path, *, topic: str | None = None, results_dir: Path | None = None) -> Path:
    """Append the rows of a results CSV made elsewhere (e.g. brought back from the GPU machine) to
    the topic of the same name here, keeping their own date/commit/device stamps."""
    path = Path(path)
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    missing = [c for c in STAMP_COLUMNS if rows and c not in rows[0]]
    if missing:
        raise ValueError(f"path: {path} has no {missing} columns; expected a results file")
    return append_rows(topic or path.stem, rows, results_dir=results_dir)


@cli.command
def main(argv=None) -> int:
    """python -m kdtree_lib.results merge FILE.csv [--topic T]: append a results file's rows."""
    parser = cli.ArgumentParser(prog="python -m kdtree_lib.results", description=main.__doc__)
    parser.add_argument("command", choices=("merge",))
    parser.add_argument("files", type=Path, nargs="+")
    parser.add_argument("--topic", default=None, help="default: each file's name without .csv")
    args = parser.parse_args(argv)
    for path in args.files:
        print(f"{path} -> {merge_file(path, topic=args.topic)}")
    return 0


def resolve_results_dir(results_dir) -> Path:
    """`results_dir`, else $KDTREE_RESULTS_DIR, else data/results/."""
    if results_dir is not None:
        return Path(results_dir)
    return Path(os.environ.get("KDTREE_RESULTS_DIR") or RESULTS_DIR)


if __name__ == "__main__":
    raise SystemExit(main())
