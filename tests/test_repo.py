"""Repository plumbing: committed notebooks are clean and well-formed, the batch runner reports pass/fail
with the right exit code and applies overrides, and the set-up files agree with each other."""
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import nbformat
import pytest
import yaml
from nbformat.v4 import new_code_cell, new_notebook, new_output

from kdtree_lib import notebooks
from kdtree_lib.paths import NOTEBOOKS_DIR, REPO_ROOT
from kdtree_lib.notebooks import discover, main, output_problems, read_record

COMMITTED = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))


def write_notebook(path: Path, parameters: str, *cells: str) -> Path:
    notebook = new_notebook(cells=[new_code_cell(parameters, metadata={"tags": ["parameters"]})]
                            + [new_code_cell(source) for source in cells])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, str(path))
    return path


@pytest.fixture
def tiny_notebooks(tmp_path):
    """Two tiny notebooks: 00_ok records its parameters and asserts x > 0; 01_broken always raises."""
    folder = tmp_path / "notebooks"
    folder.mkdir()
    write_notebook(folder / "00_ok.ipynb", 'x = 1  # a number that must be positive\nlabel = "a"  # any text',
                   "from kdtree_lib.notebooks import record\n"
                   "record('00_ok', x=x, label=label, x_type=type(x).__name__)",
                   "assert x > 0, 'x must be positive'")
    write_notebook(folder / "01_broken.ipynb", "y = 0  # unused", "raise RuntimeError('deliberate failure')")
    write_notebook(folder / "scratch.ipynb", "z = 0  # not numbered: not part of the walk")
    return folder


# ----------------------------------------------------------------------------------------------
# committed notebooks

def test_committed_notebooks_carry_no_outputs():
    assert COMMITTED, "notebooks/ holds no notebooks"
    problems = {path.name: output_problems(path) for path in COMMITTED}
    assert not {name: p for name, p in problems.items() if p}, "run `make strip-notebooks`"


@pytest.mark.parametrize("path", COMMITTED, ids=[path.stem for path in COMMITTED])
def test_committed_notebook_format(path):
    assert notebooks.NOTEBOOK_NAME.match(path.stem), f"{path.name}: expected NN_name.ipynb"
    notebook = nbformat.read(str(path), as_version=4)
    nbformat.validate(notebook)
    assert notebook.metadata.get("kernelspec", {}).get("name") == "python3"
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code_cells and "parameters" in code_cells[0].metadata.get("tags", []), \
        "the first code cell must be tagged `parameters`"
    assert notebooks.declared_parameters(path), "the parameters cell declares nothing papermill can parse"


def test_notebook_numbers_are_unique():
    numbers = [path.stem[:2] for path in discover()]
    assert len(numbers) == len(set(numbers))


# ----------------------------------------------------------------------------------------------
# the batch runner

def test_runner_table_and_exit_code_on_failure(tiny_notebooks, tmp_path):
    output = tmp_path / "run"
    finished = subprocess.run([sys.executable, "-m", "kdtree_lib.notebooks", "--notebooks-dir", str(tiny_notebooks),
                               "--output-dir", str(output), "--no-progress"],
                              capture_output=True, text=True, cwd=REPO_ROOT, timeout=1800)
    assert finished.returncode == 1, finished.stdout + finished.stderr
    rows = {line.split()[0]: line.split()[1] for line in finished.stdout.splitlines()
            if line[:2].isdigit() and "_" in line.split()[0]}
    assert rows == {"00_ok": "pass", "01_broken": "FAIL"}, finished.stdout
    assert "RuntimeError: deliberate failure" in finished.stdout
    assert "1 passed, 1 failed" in finished.stdout
    assert (output / "00_ok.ipynb").exists() and (output / "01_broken.ipynb").exists()
    assert read_record(output, "00_ok") == {"x": 1, "label": "a", "x_type": "int"}


def test_runner_overrides_and_selection(tiny_notebooks, tmp_path, capsys):
    params_file = tmp_path / "params.yaml"
    params_file.write_text("00_ok:\n  x: 7\n  label: from-file\n")
    run_dir = tmp_path / "run"
    code = main(["--notebooks-dir", str(tiny_notebooks), "--output-dir", str(run_dir), "--no-progress",
                 "--only", "00", "--params-file", str(params_file), "--set", "00_ok.label=from set"])
    assert code == 0, capsys.readouterr().out
    assert read_record(run_dir, "00_ok") == {"x": 7, "label": "from set", "x_type": "int"}
    assert not (run_dir / "01_broken.ipynb").exists(), "--only must skip the other notebooks"

    code = main(["--notebooks-dir", str(tiny_notebooks), "--output-dir", str(tmp_path / "negative"), "--no-progress",
                 "--only", "0", "--set", "0.x=-1"])
    assert code == 1, "an override that makes a notebook fail must fail the run"
    assert "x must be positive" in capsys.readouterr().out


@pytest.mark.parametrize("arguments, message", [
    (["--set", "00_ok.typo=1"], "unknown parameter(s) typo"),
    (["--set", "nope.x=1"], "no such notebook"),
    (["--set", "00_ok.x"], "expected NOTEBOOK.PARAMETER=VALUE"),
    (["--only", "7"], "no such notebook"),
])
def test_runner_rejects_bad_arguments_before_running(tiny_notebooks, tmp_path, capsys, arguments, message):
    code = main(["--notebooks-dir", str(tiny_notebooks), "--output-dir", str(tmp_path / "run"), "--no-progress",
                 *arguments])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists(), "nothing may run when the arguments are wrong"


def test_discover_sorts_by_number_and_skips_unnumbered(tmp_path):
    for name in ("10_later", "02_second", "00_first", "scratch", "3_bad"):
        write_notebook(tmp_path / f"{name}.ipynb", "a = 1  # value")
    assert [path.stem for path in discover(tmp_path)] == ["00_first", "02_second", "10_later"]
    assert [path.stem for path in discover(tmp_path, ["10", "00_first"])] == ["00_first", "10_later"]


def test_check_clean_and_strip(tmp_path, capsys):
    path = write_notebook(tmp_path / "00_dirty.ipynb", "a = 1  # value", "print(a)")
    notebook = nbformat.read(str(path), as_version=4)
    notebook.cells[1].outputs = [new_output("stream", name="stdout", text="1\n")]
    notebook.cells[1].execution_count = 3
    notebook.metadata["papermill"] = {"duration": 1.0}
    nbformat.write(notebook, str(path))

    assert main(["--notebooks-dir", str(tmp_path), "--check-clean"]) == 1
    assert "cell 1 has outputs" in capsys.readouterr().out
    assert main(["--notebooks-dir", str(tmp_path), "--strip"]) == 0
    assert output_problems(path) == []
    stripped = nbformat.read(str(path), as_version=4)
    assert [cell.source for cell in stripped.cells] == ["a = 1  # value", "print(a)"], "sources are kept"


def test_a_default_run_writes_only_what_git_ignores(tmp_path, capsys):
    """`make notebooks` (no --output-dir): the executed copy, its record and its rows under runs/<time>/ and the
    figures in data/figures/ are all ignored, so `git status` stays clean; each real notebook's run is checked
    for the files git sees in tests/test_notebooks.py."""
    folder = tmp_path / "notebooks"
    folder.mkdir()
    write_notebook(folder / "00_writes.ipynb", "x = 1  # a value to record",
                   "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
                   "from kdtree_lib.notebooks import record, store_rows\nfrom kdtree_lib.plots import save_figure\n"
                   "record('00_writes', x=x)\nstore_rows('demo_topic', [{'x': x}])\n"
                   "save_figure(plt.figure(), '00_writes', 'demo')")
    assert main(["--notebooks-dir", str(folder), "--no-progress"]) == 0
    run_dir = Path(capsys.readouterr().out.split("executed notebooks in ")[-1].strip())
    figures = list((REPO_ROOT / "data" / "figures").glob("00_writes-*"))
    written = [p for p in run_dir.rglob("*") if p.is_file()] + figures
    try:
        expected = {"00_writes.ipynb", "00_writes.json", "demo_topic.csv", "00_writes-demo.png"}
        assert {p.name for p in written} >= expected
        relative = [str(p.relative_to(REPO_ROOT)) for p in written]
        ignored = subprocess.run(["git", "check-ignore", "--no-index", *relative], cwd=REPO_ROOT, capture_output=True,
                                 text=True).stdout.split()
        assert sorted(ignored) == sorted(relative), set(relative) - set(ignored)
    finally:
        shutil.rmtree(run_dir)
        for path in written:
            path.unlink(missing_ok=True)


def test_a_headless_run_prints_its_table_and_stores_no_noise(tmp_path):
    """The runner's terminal shows its table, not ipykernel's TCP warning nor what the kernel's child processes
    (TP ranks) write to its descriptors (that goes to <run>/<notebook>.kernel.log); the executed copy stores
    no progress widget and each recorded value once."""
    folder = tmp_path / "notebooks"
    folder.mkdir()
    write_notebook(folder / "00_noise.ipynb", "x = 1  # a value to record",
                   "import multiprocessing\nworker = multiprocessing.get_context('spawn').Process(target=print, "
                   "args=('a worker line',))\nworker.start()\nworker.join()",
                   "from tqdm.auto import tqdm\nfor _ in tqdm(range(3)):\n    pass",
                   "from kdtree_lib.notebooks import record\nrecord('00_noise', x=x)")
    output = tmp_path / "run"
    finished = subprocess.run([sys.executable, "-m", "kdtree_lib.notebooks", "--notebooks-dir", str(folder),
                               "--output-dir", str(output), "--no-progress"],
                              capture_output=True, text=True, cwd=REPO_ROOT, timeout=1800)
    terminal = (finished.stdout + finished.stderr).splitlines()
    assert finished.returncode == 0, terminal
    table = {"notebook  status  seconds  error", "--------  ------  -------  -----", "1 passed, 0 failed"}
    noise = [line for line in terminal if not (line.startswith("00_noise  pass") or line.startswith(
        f"executed notebooks in {output}") or any(line.startswith(t) for t in table))]
    assert noise == []
    assert "a worker line" in (output / "00_noise.kernel.log").read_text()
    cells = nbformat.read(str(output / "00_noise.ipynb"), as_version=4).cells
    outputs = [out for cell in cells for out in cell.get("outputs", [])]
    assert not [out for out in outputs if "application/vnd.jupyter.widget-view+json" in out.get("data", {})]
    assert [out.get("text", "") for out in cells[-1].outputs] == ["x : 1\n"]


# ----------------------------------------------------------------------------------------------
# set-up files

def readme_commands() -> list[str]:
    """The commands in the README's fenced shell blocks."""
    text = (REPO_ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, re.S)
    return [line.strip() for block in blocks for line in block.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_ci_runs_the_readme_test_command():
    ci = REPO_ROOT / ".ci" / "run"
    assert ci.stat().st_mode & 0o111, ".ci/run must be executable"
    assert "make test" in readme_commands()
    assert "make notebooks" in readme_commands()
    ci_commands = [line.strip() for line in ci.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert ci_commands[-1] == "make test"


def test_make_lab_installs_jupyterlab_into_the_venv_and_starts_it(tmp_path):
    assert "make lab" in readme_commands()
    venv = tmp_path / "venv"
    dry_run = subprocess.run(["make", "-n", "lab", f"VENV={venv}"], cwd=REPO_ROOT, capture_output=True, text=True,
                             check=True).stdout.splitlines()
    install = [i for i, line in enumerate(dry_run) if line.startswith(f"{venv}/bin/python -m pip install")
               and '".[notebooks]"' in line]
    start = [i for i, line in enumerate(dry_run) if line.startswith(f"{venv}/bin/jupyter-lab")]
    assert install and start and install[0] < start[0], dry_run
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(re.split(r"[<>=!\s]", entry)[0] == "jupyterlab" for entry in extras["notebooks"])


def test_environment_yml_matches_the_design_card_and_pyproject():
    environment = yaml.safe_load((REPO_ROOT / "environment.yml").read_text())
    conda = [d for d in environment["dependencies"] if isinstance(d, str)]
    pip = next(d["pip"] for d in environment["dependencies"] if isinstance(d, dict))
    assert "python=3.12" in conda
    names = {re.split(r"[<>=!\s]", entry)[0].lower() for entry in conda + pip}
    for required in ("numpy", "torch", "cupy-cuda12x", "matplotlib", "papermill", "jupyterlab", "ipywidgets", "tqdm",
                     "safetensors", "tokenizers", "transformers"):
        assert required in names, required
    assert "transformers==5.17.0" in [entry.split("#")[0].strip() for entry in pip]
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    for dependency in project["dependencies"]:
        assert re.split(r"[<>=!\s\[]", dependency)[0].lower() in names, dependency


def test_makefile_installs_pinned_torch_first():
    makefile = (REPO_ROOT / "Makefile").read_text()
    for target in ("venv", "setup", "test", "notebooks", "wheelhouse", "check-notebooks-clean", "clean"):
        assert re.search(rf"^(\S+ )*{re.escape(target)}( \S+)*:", makefile, re.M), f"missing target {target}"
    assert "TORCH ?= torch==2.13.0" in makefile
    assert makefile.index('pip install --quiet "$(TORCH)"') < makefile.index('pip install --quiet -e ".[dev]"')
    assert "ipykernel install --sys-prefix --name python3" in makefile
