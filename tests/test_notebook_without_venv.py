"""Notebook 07 under Run All in a kernel that finds no ``torchrun`` on ``PATH``.

JupyterLab started by a virtual environment's Python without activating it (``.venv/bin/jupyter
lab``, ``.venv/bin/python -m jupyterlab``) hands its kernels a ``PATH`` without the environment's
``bin/``: a cell that runs a bare ``torchrun`` stops there with FileNotFoundError. Notebook 07
runs it through the kernel's own interpreter (``python -m torch.distributed.run``); this runs 07's
cells up to its ``torchrun`` run, and the checks on it, under nbval, its kernel started with such
a ``PATH`` (the rest of 07, the cost model, runs with the other notebooks).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def path_without_torchrun(path: str) -> str:
    """``path`` without this interpreter's scripts directory, nor any other that holds a
    ``torchrun`` (a pyenv shim, another environment's)."""
    scripts = {os.path.realpath(sysconfig.get_path("scripts")), os.path.realpath(os.path.dirname(sys.executable))}
    return os.pathsep.join(p for p in path.split(os.pathsep)
                           if p and os.path.realpath(p) not in scripts and not shutil.which("torchrun", path=p))


def test_the_path_left_holds_no_torchrun():
    here = os.path.dirname(sys.executable)
    path = path_without_torchrun(os.pathsep.join(["/usr/bin", here, sysconfig.get_path("scripts"), "/bin"]))
    assert path.split(os.pathsep) == [p for p in ("/usr/bin", "/bin") if not shutil.which("torchrun", path=p)]
    assert shutil.which("torchrun", path=path) is None


def up_to_torchrun(notebook: dict) -> dict:
    """Notebook 07 up to its cell that runs torchrun, and then the closing cell's checks on that run."""
    cells = notebook["cells"]
    last = max(i for i, c in enumerate(cells) if "torch.distributed.run" in "".join(c["source"]))
    checks = [line for line in "".join(cells[-2]["source"]).splitlines()
              if line.startswith("assert") and ("run." in line or "checksum" in line)]
    assert len(checks) == 2, "07's closing cell checks the torchrun run and its checksum: " + repr(checks)
    closing = {"cell_type": "code", "execution_count": None, "id": "torchrun-checks", "metadata": {},
               "outputs": [], "source": "\n".join(checks)}
    return dict(notebook, cells=[*cells[:last + 1], closing])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_notebook_07_runs_torchrun_in_a_kernel_without_the_environments_scripts_on_path(tmp_path):
    env = dict(os.environ, PATH=path_without_torchrun(os.environ.get("PATH", "")))
    assert shutil.which("torchrun", path=env["PATH"]) is None  # as a lab started without activating
    # the cells in a folder beside which the course is (its first cell finds exercises/ there)
    for name in ("exercises", "solutions"):
        (tmp_path / name).symlink_to(REPO / name)
    notebook = json.loads((REPO / "notebooks" / "07_beyond_one_machine.ipynb").read_text())
    (tmp_path / "07_up_to_torchrun.ipynb").write_text(json.dumps(up_to_torchrun(notebook)))
    # pytest itself by its full path; nbval (--nbval-current-env) starts the kernel with this
    # interpreter, and the kernel inherits this PATH
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
                          "--nbval-current-env", "07_up_to_torchrun.ipynb"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=550)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout
