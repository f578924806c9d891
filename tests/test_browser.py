"""End to end in a real JupyterLab (headless Chromium): what a learner sees in the page.

    pytest -m browser        # just these (CI installs Chromium with .ci/install_browser.sh)

- ``notebooks/00_start_here.ipynb`` runs top to bottom in a real kernel; the cluster widget
  renders with every rank's status; ranks' printed lines reach the page; restart starts fresh
  ranks; the progress bar moves while a cell runs; a job that records by hand gets its plots.
- In a scratch notebook: the live plots change while a recorded run's cell is still running
  (screenshots taken during the run differ) and a status line follows the run in its cell; the
  step slider replays a chosen step; a rank that raises turns its row red with its traceback.

One server and one browser for the module. The server's root is a temporary folder holding a
link to this checkout and the scratch notebook, so nothing is written into the checkout (the
test also compares notebook 00's bytes); screenshots go to the test's temporary folder. The
README's pictures are made by ``python docs/refresh_images.py``, never by a test.
"""
from __future__ import annotations

import re
import sys
import time
import uuid

import pytest

from browser import (
    NOTEBOOK_STATE, REPO, STATUSES, JupyterLab, add_and_run_cell, kernel_busy, open_notebook, scratch_lab, svg_text,
    wait_notebook_idle, wait_until,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]

NOTEBOOK = "notebooks/00_start_here.ipynb"

# Added after notebook 00's own cells: print from the ranks, run a job that records by hand
# (its own Recorder, returning rec.trace(): jobs written before recording was a switch) and
# draw its timeline inline; the widget draws its own plots of the returned traces.
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

# The scratch notebook: a cluster, and a training job for the recorded runs.
SCRATCH = [
    "import ddpkit\ncluster = ddpkit.Cluster(world_size=2)\ncluster",
    '''\
def train(steps, sleep=0.0):
    import time, torch
    from ddpkit.experiment import local_batch, train_step
    from ddpkit.models import build_model
    module = build_model("mlp", seed=0, width=64, depth=8)
    model = ddpkit.OverlappedDDP(module, bucket_cap_mb=0.03)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = local_batch(module, 16, step, ddpkit.rank(), ddpkit.world_size())
        train_step(model, opt, x, y)
        ddpkit.progress(step + 1, steps)
        time.sleep(sleep)
''',
]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    with scratch_lab(tmp_path_factory, "live.ipynb", SCRATCH, link_repo=True) as (server, browser, _):
        yield server, browser


def run_all_cells(page, attempts: int = 3) -> None:
    """Run every cell; again if the command was taken before the page could act on it (on a loaded
    machine JupyterLab can report an idle kernel a moment before the notebook accepts commands)."""
    for _ in range(attempts):
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            state = page.evaluate(NOTEBOOK_STATE) or {}
            if state.get("kernel") != "idle" or state.get("queued") or state.get("unrun", 1) == 0:
                return  # running, queued or done: the command was taken
            time.sleep(0.5)


@pytest.fixture(scope="module")
def live(lab):
    """The scratch notebook, run: a cluster and its widget on the page."""
    server, browser = lab
    page = open_notebook(browser, server, "scratch/live.ipynb", height=1400)
    run_all_cells(page)
    state = wait_notebook_idle(page, 90, "starting the scratch notebook's cluster", all_run=True)
    assert not state["errors"], state["errors"]
    widget = page.locator(".ddpkit-cluster").first
    widget.wait_for(state="visible", timeout=30_000)
    wait_until(lambda: len(rank_rows(page)) == 2 and all(" idle" in r for r in rank_rows(page)), 30,
               "two idle ranks")
    yield page, widget
    add_and_run_cell(page, "cluster.shutdown()")
    wait_notebook_idle(page, 30, "shutting the cluster down")
    page.close()


def rank_rows(page) -> list[str]:
    """The text of each rank's status row in the (first) cluster widget."""
    return page.locator(".ddpkit-cluster").first.locator(".ddpkit-rank-status").all_inner_texts()


def pids(rows: list[str]) -> list[str]:
    return [m.group(1) for row in rows for m in [re.search(r"pid (\d+)", row)] if m]


# --- the course's first notebook ----------------------------------------------------------------
def test_start_here_notebook_in_jupyterlab(lab):
    server, browser = lab
    path = REPO / NOTEBOOK
    before = path.read_bytes()
    page = open_notebook(browser, server, f"repo/{NOTEBOOK}")
    try:
        _run_start_here(page)
    finally:
        page.close()
    assert path.read_bytes() == before, "the test must not modify the notebook"


def _run_start_here(page):
    # 1. run every cell of the notebook, as a learner pressing "Run All" would
    run_all_cells(page)
    state = wait_notebook_idle(page, 120, "running all cells")
    assert state["unrun"] == 0, f"cells left unrun (a cell failed?): {state}"
    assert not state["errors"], f"cells raised: {state['errors']}"

    # 2. the widget rendered, with every rank's status; the notebook's last cell stopped the
    #    cluster, and the widget says so plainly
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
    assert [r for r in range(world_size) if f"[rank {r}] " in text], "no '[rank N] ...' line reached the page"
    assert "stopped by cluster.shutdown()" in header
    assert "shut the cluster down" in page.locator(".jp-Cell").last.inner_text()

    # 3. the restart button starts fresh ranks: new pids, all idle
    old = pids(rows)
    widget.get_by_role("button", name="restart").click()
    wait_until(lambda: (lambda r: len(pids(r)) == world_size and set(pids(r)).isdisjoint(old) and
                        all(" idle" in x for x in r))(rank_rows(page)), 60, "the ranks to restart (new pids, idle)")

    # 4. while a cell is still running, the widget's progress bar moves in the page: its
    #    updates do not wait for the kernel to become idle
    add_and_run_cell(page, SLOW_CELL)
    moving = wait_until(lambda: re.search(r"\b([1-7]) / 8 steps", widget.inner_text()), 30,
                        "the progress bar to move while the cell runs")
    assert kernel_busy(page), f"seen {moving.group(0)} only after the run"
    wait_notebook_idle(page, 60, "the slow cell", all_run=True)

    # 5. a job that records by hand: [rank N] lines, an inline plot, and the widget's plots
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
    widget.locator(".ddpkit-fill-view svg").wait_for(state="visible", timeout=30_000)
    assert {"bucket fill", "timeline", "memory"} <= set(
        t.strip() for t in widget.locator(".lm-TabBar-tabLabel").all_inner_texts())
    assert "Bucket fill · rank 0 · step 2" in svg_text(page, ".ddpkit-cluster .ddpkit-fill-view")


# --- the lab a learner starts -------------------------------------------------------------------
def test_ddpkit_lab_serves_the_checkout_so_the_exercises_open_from_its_file_browser(lab, tmp_path):
    """``ddpkit lab`` (started elsewhere: it finds its checkout) serves the checkout, not only
    notebooks/: the learner opens exercises/overlap.py from the file browser, as notebook 04 asks.
    The module's browser (one playwright per thread), a server of its own."""
    _, browser = lab
    launcher = [sys.executable, "-m", "ddpkit", "lab"]
    with JupyterLab(REPO, tmp_path, launcher=launcher) as server:
        served = re.search(r"Serving notebooks from local directory: (.*)$", server.log_path.read_text(), re.M)
        assert served and served.group(1).strip() == str(REPO), served
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        page.set_default_timeout(60_000)
        page.goto(f"{server.url}lab/workspaces/{uuid.uuid4().hex}?reset&token={server.token}")
        listing = page.locator(".jp-DirListing-content")
        for name in ("exercises", "overlap.py"):  # double-click a folder, then a file, as a learner does
            item = listing.locator(".jp-DirListing-item", has=page.locator(".jp-DirListing-itemText", has_text=name))
            item.first.wait_for(state="visible", timeout=60_000)
            item.first.dblclick()
        editor = page.locator(".jp-FileEditor .cm-content")
        wait_until(lambda: "def mark_ready" in editor.first.inner_text(), 60, "exercises/overlap.py in an editor")
        assert "exercises/overlap.py" in page.evaluate("() => window.jupyterapp.shell.currentWidget.context.path")
        page.close()


# --- the live widget ----------------------------------------------------------------------------
def test_the_plots_change_while_the_cell_is_still_running(live, tmp_path):
    page, widget = live
    add_and_run_cell(page, "with cluster.recording():\n    losses = cluster.run(train, 90, sleep=0.05)")
    plots = widget.locator(".ddpkit-live")
    wait_until(lambda: "recording" in widget.locator(".ddpkit-live-summary").inner_text(), 30,
               "the live plots to start")
    shots = []
    deadline = time.monotonic() + 30
    while len(shots) < 4 and time.monotonic() < deadline:
        time.sleep(0.8)
        shot = plots.screenshot()
        if kernel_busy(page):  # taken while the cell runs
            shots.append(shot)
            (tmp_path / f"live-{len(shots)}.png").write_bytes(shot)
    assert len(shots) >= 3, "the run ended before three screenshots"
    assert len(set(shots)) >= 2, "the plots did not change during the run"
    # the status line follows the run in its own cell, far below the widget
    status = page.locator(".jp-Cell").last.locator(".ddpkit-cell-status")
    status.wait_for(state="visible", timeout=10_000)
    assert "ddpkit" in status.inner_text()
    state = wait_notebook_idle(page, 90, "the recorded run")
    assert not state["errors"], state["errors"]
    wait_until(lambda: "finished after" in status.inner_text(), 10, "the status line to say the run finished")
    wait_until(lambda: "recorded run" in widget.locator(".ddpkit-live-summary").inner_text(), 30,
               "the replay")


def test_the_slider_replays_a_chosen_step(live):
    page, widget = live
    add_and_run_cell(page, "with cluster.recording():\n    cluster.run(train, 6)")
    wait_notebook_idle(page, 60, "a short recorded run")
    summary = widget.locator(".ddpkit-live-summary")
    wait_until(lambda: "showing step 5" in summary.inner_text(), 30, "the replay of the last step")
    prompt = page.locator(".jp-Notebook .jp-Cell").last.locator(".jp-InputPrompt").inner_text().strip()  # "[7]:"
    assert f"(cell {prompt.rstrip(':')})" in summary.inner_text(), (prompt, summary.inner_text())  # not one higher
    handle = widget.locator(".ddpkit-step-slider .noUi-handle")
    handle.focus()
    page.keyboard.press("Home")       # the first step ...
    for _ in range(2):
        page.keyboard.press("ArrowRight")  # ... then two on: step 2
    wait_until(lambda: "showing step 2" in summary.inner_text(), 20, "the slider to pick step 2")
    wait_until(lambda: "Bucket fill · rank 0 · step 2" in svg_text(page, ".ddpkit-cluster .ddpkit-fill-view"), 20,
               "the bucket fill of step 2")
    assert "Timeline · step 2" in svg_text(page, ".ddpkit-cluster .ddpkit-timeline-view")
    assert page.evaluate(NOTEBOOK_STATE)["kernel"] == "idle"  # replay needs no cell to run


def test_a_rank_that_raises_turns_its_row_red_and_shows_its_traceback(live, tmp_path):
    page, widget = live
    add_and_run_cell(page, '''\
def fails_on_rank_1():
    if ddpkit.rank() == 1:
        raise ValueError("rank 1 cannot go on")
    return "ok"

cluster.run(fails_on_rank_1)''')
    wait_notebook_idle(page, 60, "the failing job")
    failed = widget.locator(".ddpkit-rank-row.ddpkit-failed")
    wait_until(lambda: failed.count() == 1, 10, "one red row")
    assert failed.inner_text().startswith("rank 1") and "error" in failed.inner_text()
    colour = failed.evaluate("e => getComputedStyle(e).borderLeftColor")
    assert colour == "rgb(198, 40, 40)", colour
    tb = widget.locator(".ddpkit-rank-log").nth(1).locator(".ddpkit-traceback")
    wait_until(lambda: "ValueError: rank 1 cannot go on" in tb.inner_text(), 10, "rank 1's traceback")
    assert widget.locator(".ddpkit-rank-log").nth(0).locator(".ddpkit-traceback").count() == 0
    widget.screenshot(path=str(tmp_path / "failed.png"))


# The on-screen size of every label in the live plots: its SVG font size times the scale the page
# drew the SVG at (its width on screen over its viewBox width).
LABEL_PX = """root => [...root.querySelectorAll('svg')].filter(s => s.getBoundingClientRect().width > 0)
  .flatMap(s => { const k = s.getBoundingClientRect().width / s.viewBox.baseVal.width;
                  return [...s.querySelectorAll('text')].map(t => parseFloat(t.getAttribute('font-size')) * k); })"""


def test_the_plots_labels_read_at_11_px_in_a_1400_px_window(live):
    """At a 1400 px window (JupyterLab's file browser open), every label of the bucket fill, the
    timeline, the memory view and the loss is drawn at 11 px or more: the tabs take the plots' own
    width and the loss wraps below them, nothing is scaled down to 6-7 px."""
    page, widget = live
    page.set_viewport_size({"width": 1400, "height": 1400})
    add_and_run_cell(page, "with cluster.recording():\n    cluster.run(train, 4)")
    wait_notebook_idle(page, 60, "a short recorded run")
    wait_until(lambda: "showing step 3" in widget.locator(".ddpkit-live-summary").inner_text(), 30, "the replay")
    plots = widget.locator(".ddpkit-live")
    seen = {}
    for tab in ("bucket fill", "timeline", "memory"):
        widget.locator(".lm-TabBar-tabLabel", has_text=tab).click()
        sizes = wait_until(lambda: (lambda s: s if len(s) > 10 else None)(plots.evaluate(LABEL_PX)), 10,
                           f"the {tab} tab's labels")
        seen[tab] = min(sizes)
    assert all(px >= 10.9 for px in seen.values()), seen
