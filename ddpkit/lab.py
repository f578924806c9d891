"""``ddpkit lab``: JupyterLab on the course's first notebook, from a checkout of the repository.

    ddpkit lab                      # = jupyter lab notebooks/00_start_here.ipynb, served from the checkout
    ddpkit lab --port 8890 --no-browser   # anything else goes to jupyter lab as it is

The notebooks are not part of the installed package: they sit beside it in the checkout that
``pip install -e .`` installed (``notebooks/`` next to ``ddpkit/``), so this only works from
one, and says so otherwise. The server's root is the checkout, not ``notebooks/``: given a file
alone, jupyter lab serves that file's folder, and the file browser could not reach ``exercises/``
and ``solutions/``, which the notebooks ask the learner to edit. JupyterLab refuses to run as
root (Docker images, Colab-style machines) unless given ``--allow-root``: as root it is added,
and a line says so.

JupyterLab, its kernels and what the notebooks start inherit this process's ``PATH``, with this
interpreter's scripts directory (a venv's ``bin/``, where ``torchrun`` is) put first: started as
``.venv/bin/ddpkit lab`` without activating the venv, a notebook still finds them.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

START = Path("notebooks") / "00_start_here.ipynb"
ROOT_OPTIONS = ("--ServerApp.root_dir", "--ServerApp.notebook_dir", "--notebook-dir")  # the user chose one


def checkout_root() -> Path:
    """The folder that holds the ``ddpkit`` package: the checkout, for an editable install."""
    return Path(__file__).resolve().parent.parent


def start_page(root: Path | None = None) -> Path:
    """The course's first notebook in ``root`` (default: the checkout); FileNotFoundError, saying
    what to do, when it is not there (ddpkit installed from a wheel, not from a checkout)."""
    root = checkout_root() if root is None else Path(root)
    page = root / START
    if not page.is_file():
        raise FileNotFoundError(
            f"ddpkit lab opens the course's notebooks from a checkout of the repository, and there is no "
            f"{START} next to the installed package (looked in {root}). Clone the repository and install "
            "it from there: pip install -e '.[lab]' && ddpkit lab; or start JupyterLab yourself on its notebooks/.")
    return page


def running_as_root() -> bool:
    """True for the root user on a POSIX system (never on Windows, which has no euid)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def lab_command(extra=(), root: Path | None = None, as_root: bool | None = None) -> tuple[list[str], str | None]:
    """``(argv, note)``: the command that starts JupyterLab on the first notebook (run it in
    ``root``), and the line to print first, or None. ``extra`` goes to jupyter lab unchanged;
    ``as_root`` (default: whether this process is root) adds ``--allow-root``."""
    page = start_page(root)
    extra = list(extra)
    argv = [sys.executable, "-m", "jupyterlab", str(START), *extra]
    if not any(a.startswith(ROOT_OPTIONS) for a in extra):  # the checkout, so exercises/ is in reach
        argv.append(f"--ServerApp.root_dir={page.resolve().parent.parent}")
    as_root = running_as_root() if as_root is None else as_root
    note = None
    if as_root and "--allow-root" not in extra:
        argv.append("--allow-root")
        note = (f"ddpkit lab: running as root (a container?), so adding --allow-root, without which "
                f"jupyter lab refuses to start; opening {page}")
    return argv, note


def lab_environment(environ=None) -> dict:
    """``environ`` (default: this process's) with this interpreter's scripts directory first on
    ``PATH`` (once): where pip put ``jupyter`` and ``torchrun`` for this Python, activated or not."""
    env = dict(os.environ if environ is None else environ)
    scripts = sysconfig.get_path("scripts")
    rest = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != scripts]
    env["PATH"] = os.pathsep.join([scripts, *rest])
    return env


def lab(extra=(), out=print) -> int:
    """Start JupyterLab on the first notebook, in the checkout; returns jupyter lab's exit status
    (on POSIX this process *becomes* jupyter lab, so Ctrl-C reaches it as it would directly)."""
    root = checkout_root()
    if importlib.util.find_spec("jupyterlab") is None:  # the kernel side needs none of it (Colab, Kaggle)
        out("ddpkit lab: JupyterLab is not installed; it comes with the lab extra: pip install -e '.[lab]'")
        return 1
    argv, note = lab_command(extra, root)
    if note:
        out(note)
    env = lab_environment()
    if os.name == "posix":
        sys.stdout.flush()  # exec replaces the process: what is buffered would be lost
        os.chdir(root)
        os.execve(argv[0], argv, env)  # does not return
    return subprocess.call(argv, cwd=root, env=env)
