"""End to end in a real JupyterLab: the course's first notebook, run in headless Chromium.

    pytest -m browser        # just these (CI installs Chromium with .ci/install_browser.sh)

What it proves, in the page a learner sees: ``notebooks/00_start_here.ipynb`` runs top to
bottom in a real kernel; the cluster widget renders (no "Error displaying widget", no
"Loading widget..." left); every rank's status shows; ranks' printed lines reach the page as
``[rank N] ...``; the widget's restart button starts fresh ranks (new pids); and a traced run
added at the end renders plots as images, both inline and in the widget's tabs. It saves
screenshots of the widget and of a plot to ``docs/img/`` for the README.

The notebook file is never modified: autosave is off and the test checks its bytes afterwards.
Everything the server writes (settings, workspaces, runtime files) goes to a temporary folder;
the port is picked by the OS (``--ServerApp.port=0``) and read back from the server's runtime file.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = "notebooks/00_start_here.ipynb"
CHROMIUM = "/usr/bin/chromium"
IMG_DIR = REPO / "docs" / "img"
STATUSES = ("starting", "idle", "running", "error", "dead", "stopped")

# Lab settings for the run: never write the notebook back, start its kernel without asking,
# render every cell (windowing would leave off-screen outputs out of the page), no news popups.
LAB_SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker": {"autoStartDefaultKernel": True,
                                               "windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}

# The cell the test adds after the notebook's own: find the notebook's cluster, print from the
# ranks, run a traced training job that reports progress, and draw its timeline (inline; the
# widget draws its own tabs).
EXTRA_CELL = '''\
import ddpkit, torch
from ddpkit.trace import Recorder, Trace
from ddpkit.viz import plot_timeline
cluster = [v for v in list(globals().values()) if isinstance(v, ddpkit.Cluster)][-1]

def traced_job():
    from ddpkit.experiment import local_batch, train_step
    from ddpkit.models import build_model
    print("hello from the browser test")
    rec = Recorder()
    module = build_model("mlp", seed=0, width=64, depth=6)
    model = ddpkit.OverlappedDDP(module, bucket_cap_mb=0.02, recorder=rec)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):
        rec.next_step()
        x, y = local_batch(module, 8, step, ddpkit.rank(), ddpkit.world_size())
        train_step(model, opt, x, y, recorder=rec)
        ddpkit.progress(step + 1, 3)
    return rec.trace()

trace = Trace.merge(cluster.run(traced_job))
plot_timeline(trace)
'''


# A job slow enough (8 x 0.4 s) to look at the page while it runs.
SLOW_CELL = """\
import ddpkit
cluster = [v for v in list(globals().values()) if isinstance(v, ddpkit.Cluster)][-1]

def slow_job(steps=8):
    import time
    for i in range(steps):
        time.sleep(0.4)
        ddpkit.progress(i + 1, steps)

cluster.run(slow_job);
"""


def _browser_or_skip():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright Python package is missing (pip install -e '.[dev]')")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"Chromium is missing at {CHROMIUM} (run .ci/install_browser.sh)")
    return sync_playwright


class JupyterLab:
    """A JupyterLab server on loopback, serving ``root``, with throwaway settings and state."""

    def __init__(self, root: Path, state: Path):
        settings = state / "settings"
        for plugin, values in LAB_SETTINGS.items():
            path = settings / f"{plugin}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        self.runtime = state / "runtime"
        # The server's own locations go to the temporary folder; its kernel finds ddpkit
        # because it runs this interpreter (the python3 kernel of sys.executable).
        env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(self.runtime),
                   JUPYTER_CONFIG_DIR=str(state / "config"), IPYTHONDIR=str(state / "ipython"),
                   JUPYTER_PLATFORM_DIRS="1")
        self.token = os.urandom(16).hex()
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser",
               "--ServerApp.open_browser=False", "--ServerApp.ip=127.0.0.1",
               "--ServerApp.port=0", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root}",
               "--allow-root", f"--LabApp.user_settings_dir={settings}",
               f"--LabApp.workspaces_dir={state / 'workspaces'}",
               "--LabApp.expose_app_in_browser=True"]  # window.jupyterapp: run cells by command
        self.log_path = state / "server.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
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


# --- reading the page -------------------------------------------------------------------------
_NOTEBOOK_STATE = """() => {
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


def wait_notebook_idle(page, timeout: float, what: str, all_run: bool = False) -> dict:
    """Poll until the kernel is idle and no cell is queued (and, with ``all_run``, every code
    cell has run), twice in a row; the last state."""
    deadline, calm, state = time.monotonic() + timeout, 0, None
    while time.monotonic() < deadline:
        state = page.evaluate(_NOTEBOOK_STATE)
        done = (state and state["kernel"] == "idle" and state["queued"] == 0
                and (not all_run or state["unrun"] == 0))
        calm = calm + 1 if done else 0
        if calm >= 2:
            return state
        time.sleep(0.5)
    raise AssertionError(f"{what}: the notebook did not finish within {timeout:.0f} s: {state}")


def rank_rows(page) -> list[str]:
    """The text of each rank's status row in the (first) cluster widget."""
    return page.locator(".ddpkit-cluster").first.locator(".ddpkit-rank-status").all_inner_texts()


def pids(rows: list[str]) -> list[str]:
    return [m.group(1) for row in rows for m in [re.search(r"pid (\d+)", row)] if m]


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


# --- the test ---------------------------------------------------------------------------------
def check_notebook_in_browser(root: Path, notebook: str, tmp: Path, screenshots: Path | None):
    """Open ``notebook`` (relative to ``root``) in JupyterLab and check it as described above."""
    sync_playwright = _browser_or_skip()
    before = (root / notebook).read_bytes()
    lab = JupyterLab(root, tmp)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                         args=["--no-sandbox", "--disable-gpu", "--headless"])
            try:
                page = browser.new_page(viewport={"width": 1300, "height": 1000})
                page.set_default_timeout(60_000)
                page.goto(f"{lab.url}lab/tree/{notebook}?token={lab.token}")
                _run_and_check(page, screenshots)
            finally:
                browser.close()
    finally:
        lab.stop()
    assert (root / notebook).read_bytes() == before, "the test must not modify the notebook"


def _run_and_check(page, screenshots: Path | None):
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                           " && window.jupyterapp.shell.currentWidget.content")
    wait_until(lambda: (page.evaluate(_NOTEBOOK_STATE) or {}).get("kernel") == "idle", 60,
               "the notebook's kernel to start")

    # 1. run every cell of the notebook, as a learner pressing "Run All" would
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    state = wait_notebook_idle(page, 120, "running all cells")
    assert state["unrun"] == 0, f"cells left unrun (a cell failed?): {state}"
    assert not state["errors"], f"cells raised: {state['errors']}"

    # 2. the widget rendered, with every rank's status
    widget = page.locator(".ddpkit-cluster").first
    widget.wait_for(state="visible", timeout=30_000)
    wait_until(lambda: "Loading widget" not in page.inner_text(".jp-Notebook"), 30,
               "every widget to finish loading")
    text = page.inner_text(".jp-Notebook")
    assert "Error displaying widget" not in text
    header = widget.inner_text()
    world_size = int(re.search(r"world size (\d+)", header).group(1))
    rows = wait_until(lambda: (lambda r: r if len(r) == world_size else None)(rank_rows(page)), 10,
                      f"{world_size} rank rows")
    for r, row in enumerate(rows):
        assert row.startswith(f"rank {r}") and any(s in row for s in STATUSES), row
    printed = [r for r in range(world_size) if f"[rank {r}] " in text]
    assert printed, "no '[rank N] ...' line of the notebook's ranks reached the page"

    # 3. the restart button starts fresh ranks: new pids, all idle
    old = pids(rows)
    widget.get_by_role("button", name="restart").click()
    rows = wait_until(lambda: (lambda r: r if len(pids(r)) == world_size and
                               set(pids(r)).isdisjoint(old) and
                               all(" idle" in x for x in r) else None)(rank_rows(page)),
                      60, "the ranks to restart (new pids, idle)")

    # 4. while a cell is still running, the widget's progress bar moves in the page: its
    #    updates do not wait for the kernel to become idle
    add_and_run_cell(page, SLOW_CELL)
    moving = wait_until(lambda: re.search(r"\b([1-7]) / 8 steps", widget.inner_text()), 30,
                        "the progress bar to move while the cell runs")
    assert page.evaluate(_NOTEBOOK_STATE)["kernel"] == "busy", f"seen {moving.group(0)} only after the run"
    wait_notebook_idle(page, 60, "the slow cell", all_run=True)

    # 5. a traced run added at the end: [rank N] lines and plots reach the page
    add_and_run_cell(page, EXTRA_CELL)
    state = wait_notebook_idle(page, 90, "the added traced run", all_run=True)
    assert not state["errors"], f"the added cell raised: {state['errors']}"
    last = page.locator(".jp-Notebook .jp-Cell").last
    out = last.locator(".jp-OutputArea").inner_text()
    for r in range(world_size):
        assert f"[rank {r}] hello from the browser test" in out, out
    logs = widget.locator(".ddpkit-rank-log")
    wait_until(lambda: all("hello from the browser test" in t for t in logs.all_inner_texts()), 10,
               "every rank's log box in the widget to show its line")
    inline_plot = last.locator(".jp-OutputArea img")
    inline_plot.first.wait_for(state="visible", timeout=30_000)
    assert inline_plot.first.evaluate("img => img.naturalWidth") > 100

    wait_until(lambda: "3 / 3 steps" in widget.inner_text(), 10, "the progress bar to show 3 / 3 steps")

    tab_plot = widget.locator(".ddpkit-plot").first  # the widget's plot tabs (bucket fill first)
    tab_plot.wait_for(state="visible", timeout=60_000)
    assert tab_plot.evaluate("img => img.naturalWidth") > 100
    assert {"bucket fill", "timeline", "memory"} <= set(
        t.strip() for t in widget.locator(".lm-TabBar-tabLabel").all_inner_texts())

    if screenshots is not None:
        screenshots.mkdir(parents=True, exist_ok=True)
        widget.scroll_into_view_if_needed()
        widget.screenshot(path=str(screenshots / "cluster_widget.png"))
        inline_plot.first.scroll_into_view_if_needed()
        inline_plot.first.screenshot(path=str(screenshots / "plot_timeline.png"))


def test_start_here_notebook_in_jupyterlab(tmp_path):
    _browser_or_skip()
    check_notebook_in_browser(REPO, NOTEBOOK, tmp_path, IMG_DIR)
