"""Drive a real JupyterLab in headless Chromium: what the browser tests and the README's pictures share.

    with JupyterLab(root, state) as lab, chromium() as browser:
        page = open_notebook(browser, lab, "scratch/live.ipynb")
        add_and_run_cell(page, "cluster.run(job)")      # returns at once; the cell runs
        wait_notebook_idle(page, 60, "the job")

The server serves ``root`` on loopback (port picked by the OS, read back from its runtime file),
with throwaway settings: autosave off (a test never writes a notebook back), every cell
rendered (no windowing), no news popups. Everything it writes goes under ``state``. Its kernels
run this interpreter with this checkout first on ``PYTHONPATH``, so they import the ddpkit
under test. Chromium is Debian's (``.ci/install_browser.sh``), driven by playwright's Python package.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
STATUSES = ("starting", "idle", "running", "error", "dead", "stopped")

LAB_SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker": {"autoStartDefaultKernel": True,
                                               "windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}


def missing() -> str | None:
    """Why the browser cannot run here, or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright Python package is missing (pip install -e '.[dev]')"
    if not os.path.exists(CHROMIUM):
        return f"Chromium is missing at {CHROMIUM} (run .ci/install_browser.sh)"
    return None


def notebook(cells: list[str]) -> dict:
    """A notebook (nbformat 4) of code cells, for a scratch folder."""
    return {"cells": [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
                       "source": src} for src in cells],
            "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
            "nbformat": 4, "nbformat_minor": 5}


class JupyterLab:
    """A JupyterLab server on loopback, serving ``root``, with throwaway settings and state."""

    def __init__(self, root: Path, state: Path, launcher: list[str] | None = None):
        """``launcher``: what starts the server in place of ``python -m jupyterlab`` serving
        ``root`` (e.g. ``ddpkit lab``, which picks its root itself; it runs in ``state``)."""
        settings = state / "settings"
        for plugin, values in LAB_SETTINGS.items():
            path = settings / f"{plugin}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        self.runtime = state / "runtime"
        pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(self.runtime), PYTHONPATH=pythonpath,
                   JUPYTER_CONFIG_DIR=str(state / "config"), IPYTHONDIR=str(state / "ipython"),
                   JUPYTER_PLATFORM_DIRS="1")
        self.token = os.urandom(16).hex()
        start = launcher or [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={root}"]
        cmd = [*start, "--no-browser",
               "--ServerApp.open_browser=False", "--ServerApp.ip=127.0.0.1",
               "--ServerApp.port=0", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}",
               "--allow-root", f"--LabApp.user_settings_dir={settings}",
               f"--LabApp.workspaces_dir={state / 'workspaces'}",
               "--LabApp.expose_app_in_browser=True"]  # window.jupyterapp: run cells by command
        self.log_path = state / "server.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=state if launcher else root, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.url = self._wait_ready(timeout=60)

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited early:\n{self.log_path.read_text()[-3000:]}")
            for info in self.runtime.glob("jpserver-*.json"):
                try:
                    url = json.loads(info.read_text())["url"]
                    with urllib.request.urlopen(f"{url}api/status?token={self.token}", timeout=2):
                        return url
                except (OSError, ValueError, KeyError):
                    pass
            time.sleep(0.2)
        raise TimeoutError(f"jupyter lab did not start:\n{self.log_path.read_text()[-3000:]}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self) -> None:
        # The server shuts its kernels down on SIGTERM (the kernel's Cluster stops its ranks
        # when the kernel exits); kill the whole session if it lingers.
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


@contextlib.contextmanager
def chromium():
    """Headless Chromium (Debian's), through playwright."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--headless"])
        try:
            yield browser
        finally:
            browser.close()


@contextlib.contextmanager
def scratch_lab(tmp_path_factory, name: str, cells: list[str], link_repo: bool = False):
    """``(server, browser, root)``: JupyterLab in headless Chromium serving a temporary folder whose
    ``scratch/<name>`` notebook holds ``cells`` (nothing is written into the checkout; ``link_repo``
    adds the checkout as ``repo/``, read through a link); skipped where Chromium or JupyterLab is missing."""
    reason = missing()
    if reason:
        import pytest

        pytest.skip(reason)
    root = tmp_path_factory.mktemp("lab")
    if link_repo:
        (root / "repo").symlink_to(REPO)
    (root / "scratch").mkdir()
    (root / "scratch" / name).write_text(json.dumps(notebook(cells)))
    with JupyterLab(root, tmp_path_factory.mktemp("state")) as server, chromium() as browser:
        yield server, browser, root


def open_notebook(browser, lab: JupyterLab, path: str, width: int = 1300, height: int = 1000):
    """A page with ``path`` (relative to the server's root) open and its kernel idle."""
    page = browser.new_page(viewport={"width": width, "height": height})
    page.set_default_timeout(60_000)
    # A workspace of its own: the default one remembers the notebooks an earlier page had open,
    # and JupyterLab would restore them beside this one (a hidden tab whose live kernel still
    # renders its widgets, matched first by a page-wide locator).
    page.goto(f"{lab.url}lab/workspaces/{uuid.uuid4().hex}/tree/{path}?reset&token={lab.token}")
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                           " && window.jupyterapp.shell.currentWidget.content")
    wait_until(lambda: (page.evaluate(NOTEBOOK_STATE) or {}).get("kernel") == "idle", 60,
               "the notebook's kernel to start")
    return page


# --- reading the page -------------------------------------------------------------------------
NOTEBOOK_STATE = """() => {
  const nb = window.jupyterapp.shell.currentWidget;
  if (!nb || !nb.content || !nb.sessionContext) return null;
  const kernel = nb.sessionContext.session && nb.sessionContext.session.kernel;
  const cells = nb.content.widgets.filter(c => c.model.type === 'code');
  const errors = [];
  for (const c of cells) {
    const tags = c.model.getMetadata('tags') || [];
    for (const o of c.model.outputs.toJSON())
      if (o.output_type === 'error' && !tags.includes('raises-exception'))
        errors.push(o.ename + ': ' + o.evalue);
  }
  return {kernel: kernel ? kernel.status : 'none',
          cells: cells.length,
          unrun: cells.filter(c => c.model.executionCount === null).length,
          queued: [...nb.node.querySelectorAll('.jp-InputArea-prompt')]
                    .filter(p => p.textContent.includes('*')).length,
          errors};
}"""


def kernel_busy(page) -> bool:
    return (page.evaluate(NOTEBOOK_STATE) or {}).get("kernel") == "busy"


def wait_notebook_idle(page, timeout: float, what: str, all_run: bool = False) -> dict:
    """Poll until the kernel is idle and no cell is queued (and, with ``all_run``, every code
    cell has run), twice in a row; the last state."""
    deadline, calm, state = time.monotonic() + timeout, 0, None
    while time.monotonic() < deadline:
        state = page.evaluate(NOTEBOOK_STATE)
        done = (state and state["kernel"] == "idle" and state["queued"] == 0
                and (not all_run or state["unrun"] == 0))
        calm = calm + 1 if done else 0
        if calm >= 2:
            return state
        time.sleep(0.5)
    raise AssertionError(f"{what}: the notebook did not finish within {timeout:.0f} s: {state}")


def wait_until(cond, timeout: float, what: str):
    from playwright.sync_api import Error as PlaywrightError

    deadline, last_error = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            value = cond()
        except PlaywrightError as exc:  # e.g. an element re-rendered while we read it: look again
            value, last_error = None, exc
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}"
                         + (f" (last error: {last_error})" if last_error else ""))


def add_and_run_cell(page, source: str) -> None:
    """Append a code cell with ``source`` to the open notebook and run it (returns at once)."""
    page.evaluate("""(source) => {
        const app = window.jupyterapp, nb = app.shell.currentWidget;
        nb.content.activeCellIndex = nb.content.widgets.length - 1;
        return app.commands.execute('notebook:insert-cell-below').then(() => {
            nb.content.activeCell.model.sharedModel.setSource(source);
            app.commands.execute('notebook:run-cell');  // not awaited: it resolves when the cell ends
        });
    }""", source)


def svg_text(page, selector: str) -> str:
    """The text of the (first) SVG plot under ``selector``, e.g. ".ddpkit-fill-view"."""
    return page.evaluate("(sel) => { const e = document.querySelector(sel + ' svg'); "
                         "return e ? e.textContent : ''; }", selector)
