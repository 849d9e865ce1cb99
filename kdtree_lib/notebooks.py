"""Run the numbered notebooks headless with papermill, and keep the committed ones output-free.

    python -m kdtree_lib.notebooks                                   # all of notebooks/NN_*.ipynb -> runs/<time>/
    python -m kdtree_lib.notebooks --only 01,02 --set 01_tree_build.budget=64
    python -m kdtree_lib.notebooks --params-file params.yaml         # {notebook: {parameter: value}}
    python -m kdtree_lib.notebooks --check-clean                     # exit 1 if a notebook carries outputs
    python -m kdtree_lib.notebooks --strip                           # clear outputs in place

A notebook states the values it asserts with `record(notebook, **values)`: they are printed, and in a
batch run (where $KDTREE_RUN_DIR names the run folder) written next to the executed notebook as
<notebook>.json, which the tests read. The rows a notebook measures go to the run folder too
(`store_rows`: <run dir>/results/<topic>.csv); they reach data/results/ only when the notebook's
`append_results` parameter asks, so a run leaves the checkout as git had it.
Overrides use YAML semantics: `--set 01.budget=64` gives the
int 64, `--set 01.interactive=false` the bool False, `--set 01.name=abc` the string "abc".
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import functools
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import cli
from .plots import FIGURES_DIR_ENV
from .paths import NOTEBOOKS_DIR, REPO_ROOT, RUNS_DIR

RUN_DIR_ENV = "KDTREE_RUN_DIR"
# progress bars in a headless kernel: off (nobody watches, and a stored tqdm widget reads "0%" forever); tqdm.auto
# would pick the widget, which ignores TQDM_DISABLE, so the kernel starts with tqdm.auto's tqdm the text one
NO_PROGRESS_BARS = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
TEXT_PROGRESS_BARS = "import tqdm.auto, tqdm.std; tqdm.auto.tqdm = tqdm.std.tqdm"
KERNEL_NAME = "python3"
NOTEBOOK_NAME = re.compile(r"^(?P<number>\d{2})_[A-Za-z0-9_-]+$")


@dataclass
class NotebookRun:
    """How one notebook's headless run went."""
    name: str
    ok: bool
    seconds: float
    output: Path
    error: str = ""
    cpu_seconds: float = 0.0  # the kernel's and its children's CPU time: how big the run is, whatever the machine's load


# ----------------------------------------------------------------------------------------------
# what notebooks call

def record(notebook: str, **values) -> None:
    """Print the values a notebook asserts; in a batch run also merge them into <run dir>/<notebook>.json.
    Returns nothing, so a cell ending in record(...) shows the values once (printed), not again as its result."""
    plain = json.loads(json.dumps(values, default=_plain))
    width = max(map(len, plain), default=0)
    for key, value in plain.items():
        print(f"{key:>{width}} : {value}")
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir:
        path = Path(run_dir) / f"{notebook}.json"
        earlier = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**earlier, **plain}, indent=1, sort_keys=True))


def this_run_dir() -> Path:
    """This run's folder: $KDTREE_RUN_DIR in a batch run, runs/interactive/ in an editor session."""
    return Path(os.environ.get(RUN_DIR_ENV) or RUNS_DIR / "interactive")


def store_rows(topic: str, rows: list[dict], *, append_results: bool = False) -> Path:
    """Write a notebook's measured rows to this run's folder (<run dir>/results/<topic>.csv), or, only
    when `append_results` asks, append them to data/results/ (a measurement to commit): a notebook run
    never changes a committed file by default. Returns the file written."""
    from .results import append_rows

    return append_rows(topic, rows, results_dir=rows_file(topic, append_results=append_results).parent)


def rows_file(topic: str, *, append_results: bool = False) -> Path:
    """Where store_rows puts a topic's rows: this run's folder, or data/results/ when asked."""
    from .results import resolve_results_dir
    return (resolve_results_dir(None) if append_results else this_run_dir() / "results") / f"{topic}.csv"


def read_record(run_dir: Path, notebook: str) -> dict:
    """The values `record` wrote for one notebook in a run folder ({} when it recorded none)."""
    path = Path(run_dir) / f"{notebook}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _plain(value):
    """JSON for NumPy scalars/arrays and paths (what notebooks tend to record)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"record: cannot store a {type(value).__name__} as JSON")


# ----------------------------------------------------------------------------------------------
# finding notebooks and parameters

def discover(notebooks_dir: Path = NOTEBOOKS_DIR, only: list[str] | None = None) -> list[Path]:
    """The NN_name.ipynb files of a folder, sorted by number; `only` keeps those named (NN or NN_name)."""
    paths = sorted((p for p in Path(notebooks_dir).glob("*.ipynb") if NOTEBOOK_NAME.match(p.stem)),
                   key=lambda p: (int(p.stem[:2]), p.stem))
    if only is None:
        return paths
    chosen = [match_notebook(selector, paths) for selector in only]
    return [p for p in paths if p in chosen]


def match_notebook(selector: str, paths: list[Path]) -> Path:
    """The notebook a selector names: its full stem ("01_tree_build") or its number ("01" or "1")."""
    for path in paths:
        if selector == path.stem or (selector.isdigit() and int(selector) == int(path.stem[:2])):
            return path
    names = ", ".join(p.stem for p in paths) or "none"
    raise ValueError(f"notebook {selector!r}: no such notebook (have: {names})")


def parse_overrides(settings: list[str], paths: list[Path], params_file: Path | None = None) -> dict[str, dict]:
    """{notebook stem: {parameter: value}} from a YAML/JSON params file and `NB.param=value` settings.

    Settings win over the file. Values are parsed as YAML scalars (64 -> int, false -> bool).
    """
    import yaml

    overrides: dict[str, dict] = {}
    if params_file is not None:
        loaded = yaml.safe_load(Path(params_file).read_text()) or {}
        if not isinstance(loaded, dict) or not all(isinstance(v, dict) for v in loaded.values()):
            raise ValueError(f"params file {params_file}: expected a mapping of notebook -> {{parameter: value}}")
        for selector, values in loaded.items():
            overrides.setdefault(match_notebook(str(selector), paths).stem, {}).update(values)
    for setting in settings:
        key, equals, text = setting.partition("=")
        selector, dot, parameter = key.partition(".")
        if not (equals and dot and selector and parameter):
            raise ValueError(f"--set {setting!r}: expected NOTEBOOK.PARAMETER=VALUE, e.g. 01_tree_build.budget=64")
        overrides.setdefault(match_notebook(selector, paths).stem, {})[parameter] = yaml.safe_load(text)
    return overrides


def declared_parameters(path: Path) -> dict:
    """The parameters a notebook's `parameters` cell declares (name -> papermill's description)."""
    import papermill

    return papermill.inspect_notebook(str(path))


def check_parameters(path: Path, parameters: dict) -> None:
    """ValueError naming any parameter the notebook does not declare (a typo must not pass silently)."""
    declared = declared_parameters(path)
    unknown = sorted(set(parameters) - set(declared))
    if unknown:
        raise ValueError(f"{path.stem}: unknown parameter(s) {', '.join(unknown)}; "
                         f"declared: {', '.join(declared) or 'none'}")


# ----------------------------------------------------------------------------------------------
# running

def run_notebook(path: Path, output_dir: Path, parameters: dict | None = None, *,
                 figures_dir: Path | None = None, cell_timeout: float | None = None,
                 kernel_name: str = KERNEL_NAME) -> NotebookRun:
    """Execute one notebook with papermill into output_dir/<name>.ipynb; failures are reported, not raised.

    Parameters the notebook does not declare are a ValueError, raised before anything runs.
    """
    import papermill

    path, output_dir = Path(path), Path(output_dir)
    parameters = dict(parameters or {})
    check_parameters(path, parameters)
    output_dir.mkdir(parents=True, exist_ok=True)
    output = output_dir / path.name
    # the kernel imports this checkout's kdtree_lib, installed or not, and records into the run folder
    python_path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    kernel_env = {RUN_DIR_ENV: str(output_dir.resolve()), "PYTHONPATH": python_path, **NO_PROGRESS_BARS}
    if figures_dir is not None:
        kernel_env[FIGURES_DIR_ENV] = str(Path(figures_dir).resolve())
    kernel_log = output_dir / f"{path.stem}.kernel.log"
    start, cpu_start = time.perf_counter(), _children_cpu_seconds()
    error = ""
    with _environment(kernel_env), tempfile.TemporaryDirectory(prefix="kdtree-kernel-") as sockets:
        try:
            papermill.execute_notebook(str(path), str(output), parameters=parameters, kernel_name=kernel_name,
                                       cwd=str(path.parent), progress_bar=False, log_output=False,
                                       execution_timeout=cell_timeout,
                                       config=_kernel_config(Path(sockets), kernel_log),
                                       kernel_manager_class=_logged_kernel_manager(),
                                       extra_arguments=[f"--IPKernelApp.exec_lines={TEXT_PROGRESS_BARS}"])
        except papermill.PapermillExecutionError as err:
            error = f"cell {err.exec_count}: {err.ename}: {err.evalue}"
        except Exception as err:  # kernel died, timeout, unreadable notebook: still one row of the table
            error = f"{type(err).__name__}: {err}"
    if kernel_log.exists() and not kernel_log.stat().st_size:
        kernel_log.unlink()
    return NotebookRun(path.stem, not error, time.perf_counter() - start, output, error,
                       cpu_seconds=_children_cpu_seconds() - cpu_start)


def _children_cpu_seconds() -> float:
    """User + system CPU time of this process's finished children (the kernel is one once papermill shuts it down)."""
    import resource
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_all(paths: list[Path], output_dir: Path, overrides: dict[str, dict] | None = None, *,
            figures_dir: Path | None = None, cell_timeout: float | None = None,
            progress: bool = True) -> list[NotebookRun]:
    """Run notebooks in order (each with its overrides), with a progress bar; returns one row each."""
    from tqdm.auto import tqdm

    overrides = overrides or {}
    for path in paths:  # every override is checked before the first (slow) run
        check_parameters(path, overrides.get(path.stem, {}))
    runs = []
    with tqdm(paths, unit="notebook", disable=not progress, file=sys.stderr) as bar:
        for path in bar:
            bar.set_postfix_str(path.stem)
            runs.append(run_notebook(path, output_dir, overrides.get(path.stem), figures_dir=figures_dir,
                                     cell_timeout=cell_timeout))
    return runs


def format_table(runs: list[NotebookRun]) -> str:
    """The pass/fail/time table printed at the end of a batch run."""
    width = max([len("notebook")] + [len(run.name) for run in runs])
    lines = [f"{'notebook':<{width}}  status  seconds  error", f"{'-' * width}  ------  -------  -----"]
    for run in runs:
        lines.append(f"{run.name:<{width}}  {'pass' if run.ok else 'FAIL':<6}  {run.seconds:7.1f}  "
                     f"{_one_line(run.error)}".rstrip())
    passed = sum(run.ok for run in runs)
    lines.append(f"{passed} passed, {len(runs) - passed} failed in {sum(r.seconds for r in runs):.1f} s")
    return "\n".join(lines)


def _one_line(text: str, limit: int = 120) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _kernel_config(sockets: Path, log: Path):
    """The kernel papermill starts talks over IPC sockets in `sockets` (over TCP ipykernel warns, once per
    kernel, that it runs unencrypted) and writes its own stdout/stderr to `log` (see RunKernelManager)."""
    from traitlets.config import Config

    config = Config()
    config.KernelManager.transport = "ipc"
    config.KernelManager.ip = str(sockets / "kernel")
    config.RunKernelManager.log_path = str(log.resolve())
    return config


@functools.lru_cache(maxsize=None)
def _logged_kernel_manager():
    """AsyncKernelManager whose kernel process writes its stdout/stderr to `log_path`: what bypasses the
    notebook (processes the kernel spawns, such as TP ranks, C libraries) lands in the run folder instead of
    the runner's terminal, whose output is its table and the run's real errors."""
    from jupyter_client import AsyncKernelManager
    from traitlets import Unicode

    class RunKernelManager(AsyncKernelManager):
        log_path = Unicode("", help="file for the kernel process's own output").tag(config=True)

        async def _async_launch_kernel(self, kernel_cmd, **kw):
            with open(self.log_path, "ab") as log:
                return await super()._async_launch_kernel(kernel_cmd, stdout=log, stderr=log, **kw)

    return RunKernelManager


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """Set environment variables (inherited by the kernel papermill starts) for one run."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# ----------------------------------------------------------------------------------------------
# committed notebooks: no outputs

def output_problems(path: Path) -> list[str]:
    """Why a notebook is not clean: code cells with outputs or execution counts, papermill leftovers."""
    import nbformat

    notebook = nbformat.read(str(path), as_version=4)
    problems = []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        if cell.get("outputs"):
            problems.append(f"cell {index} has outputs")
        if cell.get("execution_count") is not None:
            problems.append(f"cell {index} has an execution count")
        if "injected-parameters" in cell.get("metadata", {}).get("tags", []):
            problems.append(f"cell {index} is papermill's injected-parameters cell")
    if "papermill" in notebook.metadata:
        problems.append("notebook metadata holds a papermill run record")
    return problems


def strip_outputs(path: Path) -> bool:
    """Clear outputs, execution counts and papermill leftovers in place; True when the file changed."""
    import nbformat

    notebook = nbformat.read(str(path), as_version=4)
    before = nbformat.writes(notebook)
    notebook.metadata.pop("papermill", None)
    notebook.cells = [cell for cell in notebook.cells
                      if "injected-parameters" not in cell.get("metadata", {}).get("tags", [])]
    for cell in notebook.cells:
        for key in ("papermill", "execution"):
            cell.metadata.pop(key, None)
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    after = nbformat.writes(notebook)
    if after != before:
        Path(path).write_text(after)
    return after != before


# ----------------------------------------------------------------------------------------------
# command line

@cli.command
def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(prog="python -m kdtree_lib.notebooks", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--notebooks-dir", type=Path, default=NOTEBOOKS_DIR, help="where NN_name.ipynb live")
    parser.add_argument("--output-dir", type=Path, help="where executed notebooks go (default runs/<time>/)")
    parser.add_argument("--only", help="comma-separated numbers or names, e.g. 01,02")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="NB.PARAM=VALUE",
                        help="override one parameter of one notebook (repeatable)")
    parser.add_argument("--params-file", type=Path, help="YAML/JSON {notebook: {parameter: value}}")
    parser.add_argument("--figures-dir", type=Path, help="where figures go (default data/figures/)")
    parser.add_argument("--cell-timeout", type=cli.positive_float, help="seconds a single cell may run")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--check-clean", action="store_true", help="exit 1 if any notebook carries outputs")
    parser.add_argument("--strip", action="store_true", help="clear outputs of the notebooks in place")
    args = parser.parse_args(argv)
    only = None if args.only is None else [part.strip() for part in args.only.split(",")]
    if only is not None and not all(only):
        parser.error(f"argument --only: expected comma-separated notebook numbers or names, got {args.only!r}")

    all_notebooks = sorted(Path(args.notebooks_dir).glob("*.ipynb"))
    if args.check_clean or args.strip:
        return _clean_command(all_notebooks, strip=args.strip)
    paths = discover(args.notebooks_dir, only)
    overrides = parse_overrides(args.settings, paths, args.params_file)
    if not paths:
        raise ValueError(f"--notebooks-dir: no NN_name.ipynb notebooks in {args.notebooks_dir}")
    output_dir = args.output_dir or RUNS_DIR / _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    runs = run_all(paths, output_dir, overrides, figures_dir=args.figures_dir,
                   cell_timeout=args.cell_timeout, progress=not args.no_progress)
    print(format_table(runs))
    print(f"executed notebooks in {output_dir}")
    return 0 if all(run.ok for run in runs) else 1


def _clean_command(paths: list[Path], *, strip: bool) -> int:
    if strip:
        for path in paths:
            if strip_outputs(path):
                print(f"stripped {path}")
    dirty = {path: output_problems(path) for path in paths}
    dirty = {path: problems for path, problems in dirty.items() if problems}
    for path, problems in dirty.items():
        print(f"{path}: {'; '.join(problems)}")
    if not dirty:
        print(f"{len(paths)} notebooks clean")
    return 1 if dirty else 0


if __name__ == "__main__":
    sys.exit(main())
