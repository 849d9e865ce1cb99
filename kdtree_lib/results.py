"""Results rows: one CSV per topic in data/results/, append-only, safe under concurrent writers.

Every row carries date, commit and device next to its parameters and metrics, so runs on different
machines (the H200 here, the Blackwell box) can be compared and plotted from the files.

Writers of a folder take an advisory lock (flock on the folder's `.results.lock`, released by the
kernel when a writer dies) and append their rows in one write: two processes appending to a topic
keep every row, the header is written once, and a plain append creates no other file. Only rows
with a new column rewrite the file (a temp file in the same folder, renamed over it, the file's
mode kept; a killed rewrite's leftover is ignored by git and removed by the next writer).
A symbolic link, a read-only file and a topic that is not a plain file name are refused.
"""
from __future__ import annotations

import contextlib
import csv
import datetime as _dt
import fcntl
import io
import os
import re
import stat
import subprocess
import tempfile
import uuid
from collections import Counter
from pathlib import Path

from . import cli
from .backend import device_name
from .paths import REPO_ROOT, RESULTS_DIR  # $KDTREE_RESULTS_DIR overrides RESULTS_DIR (tests write elsewhere)

STAMP_COLUMNS = ("date", "commit", "device")
LOCK_NAME = ".results.lock"   # one per results folder; .gitignore names it
TEMP_SUFFIX = ".tmp"          # a rewrite's temp file: .<topic>.csv.<random>.tmp (.gitignore names them)
_TOPIC = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]*")


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


# ----------------------------------------------------------------------------------------------
# where rows go, and what is refused there

def topic_path(topic: str, results_dir: Path | None = None) -> Path:
    """<results folder>/<topic>.csv; ValueError naming `topic` when it is not a plain file name (a
    folder, an absolute path, '..' or a hidden name would put rows outside the results folder)."""
    if not isinstance(topic, str) or not _TOPIC.fullmatch(topic):
        raise ValueError(f"topic: expected a plain file name (letters, digits and _ . + = -, starting with a letter, "
                         f"digit or _; no folders), got {topic!r}")
    return resolve_results_dir(results_dir) / f"{topic}.csv"


def _refuse_unwritable_file(path: Path) -> None:
    """A results file rows may not go to: a symbolic link (it would be written through, or replaced by
    a file), something that is not a file, a file without write permission (root could still write it:
    the mode is the owner's word)."""
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(status.st_mode):
        raise ValueError(f"{path} is a symbolic link: rows are written to a plain file only "
                         f"(write to the link's target's folder instead)")
    if not stat.S_ISREG(status.st_mode):
        raise ValueError(f"{path} is not a plain file")
    if not status.st_mode & 0o222:
        raise PermissionError(f"{path} is read-only (mode {stat.S_IMODE(status.st_mode):o}): "
                              f"refusing to write rows to it")


def check_writable(results_dir: Path | None = None, topics=()) -> Path:
    """The results folder rows would go to, checked before anything is measured: ValueError naming
    the folder when it (or its nearest existing parent) is not a writable folder, or when one of
    `topics` has a file there that rows may not go to. Creates nothing."""
    directory = Path(resolve_results_dir(results_dir)).absolute()
    existing = directory
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"results_dir: cannot write rows to {directory}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"results_dir: cannot write rows to {directory}: {existing} is not writable")
    for topic in topics:
        try:
            _refuse_unwritable_file(topic_path(topic, directory))
        except (OSError, ValueError) as error:
            raise ValueError(f"results_dir: cannot write rows to {directory}: {error}") from None
    return directory


@contextlib.contextmanager
def _locked(directory: Path, *, shared: bool = False):
    """The folder's advisory lock for the duration: exclusive for a writer (creating the lock file),
    shared for a reader (a folder no writer has locked yet, without a lock file, is read unlocked)."""
    try:
        fd = os.open(directory / LOCK_NAME, (os.O_RDONLY if shared else os.O_RDWR | os.O_CREAT) | os.O_CLOEXEC, 0o666)
    except (FileNotFoundError, PermissionError) if shared else ():
        fd = None
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


# ----------------------------------------------------------------------------------------------
# writing

def append_rows(topic: str, rows: list[dict], *, results_dir: Path | None = None) -> Path:
    """Append rows (stamped with date/commit/device, unless they carry their own) to
    <results_dir>/<topic>.csv under the folder's lock, in one write. Earlier rows are never rewritten,
    except that new columns widen the file (earlier rows get empty cells): then the whole file is
    replaced by a renamed copy, so a crash leaves the old file or the new one."""
    path = topic_path(topic, results_dir)
    if not rows or not all(isinstance(row, dict) for row in rows):
        raise ValueError("rows: expected a non-empty list of dicts")
    stamp_values = stamp()
    new_rows = [{**stamp_values, **row} for row in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.parent):
        _write_locked(path, new_rows)
    return path


def _write_locked(path: Path, rows: list[dict], *, skip_present: bool = False) -> int:
    """Append `rows` to `path` (its folder's lock held); with skip_present, rows already in the file
    (see _row_key; counted, so a file's repeated rows are kept once each) are left out. Returns the
    rows written."""
    _remove_stale_temps(path)
    _refuse_unwritable_file(path)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        status = os.fstat(fd)
        header = _read_header(fd, path) if status.st_size else []
        if skip_present and header:
            present = Counter(_row_key(row) for row in read_results_file(path, require_stamps=False)[1])
            kept = []
            for row in rows:
                key = _row_key(row)
                if present[key]:
                    present[key] -= 1
                else:
                    kept.append(row)
            rows = kept
        if not rows:
            return 0
        columns = list(header or STAMP_COLUMNS)
        for row in rows:
            columns += [c for c in row if c not in columns]
        if header and columns != header:
            _rewrite_widened(path, status, columns, rows)
            return len(rows)
        text = io.StringIO()
        if header and os.pread(fd, 1, status.st_size - 1) != b"\n":
            # a writer killed mid-row left it unterminated: end it, so that it stays one (malformed,
            # visible to `merge`) row and the new rows are not glued onto it
            text.write("\r\n")
        writer = csv.DictWriter(text, fieldnames=columns, restval="")
        if not header:
            writer.writeheader()
        writer.writerows(rows)
        data = text.getvalue().encode()
        while data:
            data = data[os.write(fd, data):]
        return len(rows)
    finally:
        os.close(fd)


def _read_header(fd: int, path: Path) -> list[str]:
    """The column names: the file's first line (names hold no line breaks)."""
    data, offset = b"", 0
    while b"\n" not in data:
        chunk = os.pread(fd, 1 << 16, offset)
        if not chunk:
            break
        data, offset = data + chunk, offset + len(chunk)
    line = data.split(b"\n", 1)[0].decode()
    header = next(csv.reader([line.rstrip("\r")]), [])
    if not header or len(set(header)) != len(header) or "" in header:
        raise ValueError(f"path: {path} line 1: not a header of distinct column names: {line.rstrip()!r}")
    return header


def _rewrite_widened(path: Path, status: os.stat_result, columns: list[str], rows: list[dict]) -> None:
    """The file's rows and `rows` under the wider `columns`, written to a temp file in the same folder
    with the file's mode (and owner, where allowed), then renamed over it."""
    old_rows = read_results_file(path, require_stamps=False)[1]
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    try:
        with open(fd, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns, restval="")
            writer.writeheader()
            writer.writerows(old_rows + rows)
            handle.flush()
            os.fchmod(handle.fileno(), stat.S_IMODE(status.st_mode))
            with contextlib.suppress(PermissionError):
                os.fchown(handle.fileno(), status.st_uid, status.st_gid)
            os.fsync(handle.fileno())
        os.replace(temp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


def _remove_stale_temps(path: Path) -> None:
    """A rewrite's temp files left by a writer killed before its rename (the lock is held: no live
    writer owns one)."""
    for leftover in path.parent.glob(f".{path.name}.*{TEMP_SUFFIX}"):  # topic names hold no glob characters
        with contextlib.suppress(FileNotFoundError):
            leftover.unlink()


def _row_key(row: dict) -> tuple:
    """What makes a row the same row in two files: its stamps and every other filled cell (empty cells
    and column order do not count, so a widened file's rows still match)."""
    return tuple(sorted((str(k), str(v)) for k, v in row.items() if v not in ("", None)))


# ----------------------------------------------------------------------------------------------
# reading

def read_rows(topic: str, *, results_dir: Path | None = None) -> list[dict]:
    """All rows of a topic as dicts of strings (empty list when there is no file yet), read under the
    folder's shared lock (no half-appended row)."""
    path = topic_path(topic, results_dir)
    if not path.exists():
        return []
    with _locked(path.parent, shared=True), open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def read_results_file(path, *, require_stamps: bool = True) -> tuple[list[str], list[dict]]:
    """A results CSV's columns and rows, checked: ValueError naming the file and line of a second
    header, a row with more or fewer cells than the header, an unterminated quote, and (require_stamps)
    a missing date/commit/device column or stamp. Blank lines are skipped."""
    path = Path(path)
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.reader(handle, strict=True)
        line = 1
        try:
            header = next(reader, None)
            if header is None:
                return [], []
            if not header or "" in header or len(set(header)) != len(header):
                raise ValueError(f"path: {path} line 1: not a header of distinct column names: {header!r}")
            missing = [c for c in STAMP_COLUMNS if c not in header]
            if require_stamps and missing:
                raise ValueError(f"path: {path} has no {missing} columns; expected a results file")
            rows = []
            line = reader.line_num + 1
            for record in reader:
                if record == header:
                    raise ValueError(f"path: {path} line {line}: a second header line")
                if record and len(record) != len(header):
                    raise ValueError(f"path: {path} line {line}: {len(record)} fields where the header has "
                                     f"{len(header)}")
                if record:
                    row = dict(zip(header, record))
                    unstamped = [c for c in STAMP_COLUMNS if require_stamps and not row[c]]
                    if unstamped:
                        raise ValueError(f"path: {path} line {line}: no {unstamped[0]} stamp")
                    rows.append(row)
                line = reader.line_num + 1
        except csv.Error as error:
            raise ValueError(f"path: {path} line {line}: {error} (an unterminated quote?)") from None
        except UnicodeDecodeError as error:
            raise ValueError(f"path: {path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    return header, rows


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
    the topic of the same name here, keeping their own date/commit/device stamps (see merge_files)."""
    return merge_files([path], topic=topic, results_dir=results_dir)[0][1]


def merge_files(paths, *, topic: str | None = None, results_dir: Path | None = None) -> list[tuple[Path, Path, int]]:
    """Merge results files into their topics (`topic`, else each file's name without .csv): every file
    and destination is read and checked before anything is written (a malformed one refuses the whole
    merge, see read_results_file), and rows already in the destination are not added again (a row is
    its stamps and cells), so merging a file twice adds nothing. A file is not merged into itself.
    Returns (file, destination, rows added) per file."""
    plans = []
    for path in map(Path, paths):
        destination = topic_path(topic if topic is not None else path.stem, results_dir)
        if destination.exists() and path.exists() and os.path.samefile(path, destination):
            raise ValueError(f"path: {path} is the results file it would be merged into")
        rows = read_results_file(path)[1]
        _refuse_unwritable_file(destination)
        if destination.exists():
            read_results_file(destination, require_stamps=False)
        plans.append((path, destination, rows))
    merged = []
    for path, destination, rows in plans:
        destination.parent.mkdir(parents=True, exist_ok=True)
        with _locked(destination.parent):
            added = _write_locked(destination, rows, skip_present=True) if rows else 0
        merged.append((path, destination, added))
    return merged


@cli.command
def main(argv=None) -> int:
    """python -m kdtree_lib.results merge FILE.csv... [--topic T]: add the rows of results files made
    elsewhere (those not already there)."""
    parser = cli.ArgumentParser(prog="python -m kdtree_lib.results", description=main.__doc__)
    parser.add_argument("command", choices=("merge",))
    parser.add_argument("files", type=Path, nargs="+")
    parser.add_argument("--topic", default=None, help="default: each file's name without .csv")
    args = parser.parse_args(argv)
    for path, destination, added in merge_files(args.files, topic=args.topic):  # refusals: cli.command's one line
        print(f"{path} -> {destination}: {added} rows added")
    return 0


def resolve_results_dir(results_dir) -> Path:
    """`results_dir`, else $KDTREE_RESULTS_DIR, else data/results/."""
    if results_dir is not None:
        return Path(results_dir)
    return Path(os.environ.get("KDTREE_RESULTS_DIR") or RESULTS_DIR)


if __name__ == "__main__":
    raise SystemExit(main())
