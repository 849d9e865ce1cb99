"""`make lab`: the command line it runs (--allow-root exactly when root: Jupyter refuses root without it,
and containers run as root), and that command starting a JupyterLab that answers on 127.0.0.1 (jupyterlab
is in the dev extras, so CI runs it)."""
import os
import secrets
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kdtree_lib.paths import REPO_ROOT


def lab_command(venv, *, uid=None, args: str = "") -> list[str]:
    """What `make lab` runs, without making its prerequisites (the venv and the jupyterlab install)."""
    variables = [f"VENV={venv}", f"ARGS={args}"] + ([f"LAB_UID={uid}"] if uid is not None else [])
    dry_run = subprocess.run(["make", "--no-print-directory", "-s", "-n", "-o", f"{venv}/bin/jupyter-lab", "lab",
                              *variables], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    (line,) = dry_run.stdout.splitlines()
    return shlex.split(line)


def test_make_lab_allows_root_only_for_root():
    assert lab_command(".venv", uid=0) == [".venv/bin/jupyter-lab", "--notebook-dir=notebooks", "--allow-root"]
    assert lab_command(".venv", uid=1000, args="--no-browser --port 8889") == [
        ".venv/bin/jupyter-lab", "--notebook-dir=notebooks", "--no-browser", "--port", "8889"]
    assert ("--allow-root" in lab_command(".venv")) == (os.getuid() == 0), "by default: the user running make"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_lab_starts_and_answers_on_loopback(tmp_path):
    """KDTREE_LAB_VENV names a venv with jupyterlab (default: this interpreter's)."""
    venv = Path(os.environ.get("KDTREE_LAB_VENV", sys.prefix))
    if not (venv / "bin" / "jupyter-lab").is_file():
        pytest.skip(f"jupyterlab is not installed in {venv} (make lab installs it)")
    token, port = secrets.token_hex(16), free_port()
    command = lab_command(venv, args=f"--no-browser --ip=127.0.0.1 --port={port} --ServerApp.port_retries=0 "
                                     f"--IdentityProvider.token={token}")
    # Jupyter's per-user files go to the test's folder, not the home directory
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "run"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces")}
    log = tmp_path / "lab.log"
    with open(log, "w") as output:
        lab = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline, status = time.monotonic() + 180, None  # a generous start-up bound, not a speed target
        while status is None and time.monotonic() < deadline:
            assert lab.poll() is None, f"jupyter-lab exited with {lab.returncode}:\n{log.read_text()[-3000:]}"
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/api/status", headers={"Authorization": f"token {token}"},
                                   timeout=10)
            except httpx.TransportError:
                time.sleep(0.5)
        assert status is not None, f"jupyter-lab did not answer within 180 s:\n{log.read_text()[-3000:]}"
        assert status.status_code == 200 and "started" in status.json(), status.text
        contents = httpx.get(f"http://127.0.0.1:{port}/api/contents", headers={"Authorization": f"token {token}"},
                             timeout=10).json()
        names = {entry["name"] for entry in contents["content"]}
        assert any(name.endswith(".ipynb") for name in names), f"the lab is not on notebooks/: {sorted(names)[:5]}"
    finally:
        lab.terminate()
        try:
            lab.wait(30)
        except subprocess.TimeoutExpired:
            lab.kill()
            lab.wait()
