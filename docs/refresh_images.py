"""Refresh the README's pictures: the live cluster widget mid-run, and a recorded step's timeline; and
docs/own_script.md's recorded Lightning step.

    python docs/refresh_images.py          # writes docs/img/cluster_widget.png, docs/img/plot_timeline.png,
                                           # docs/img/lightning_timeline.png
    python docs/refresh_images.py lightning   # only the last (no browser): the page's own two commands

Starts JupyterLab (headless Chromium, as the browser tests do: ``tests/browser.py``) on a
scratch notebook in a temporary folder, starts a 2-rank cluster, and trains the default MLP
(OverlappedDDP, 2 MiB buckets) with recording on. While the cell is still running it takes a
picture of the widget: bucket fill, progress and loss as a learner sees them mid-run. After
the run it draws a typical recorded step's timeline (rank 0's median step) with
``ddpkit.viz.plot_timeline``. Nothing else in
the checkout is written; the tests never write these files.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
IMG = REPO / "docs" / "img"
sys.path.insert(0, str(REPO / "tests"))

from browser import (  # noqa: E402  (tests/ is not a package)
    JupyterLab, add_and_run_cell, chromium, kernel_busy, missing, notebook, open_notebook, wait_notebook_idle,
    wait_until,
)

CELLS = [
    "import ddpkit\ncluster = ddpkit.Cluster(world_size=2)\ncluster",
    '''\
def train(steps):
    import torch
    from ddpkit.experiment import local_batch, train_step
    from ddpkit.models import build_model
    module = build_model("mlp")                      # 32 x Linear(256, 256) + head: 66 gradients
    model = ddpkit.OverlappedDDP(module, bucket_cap_mb=2.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = local_batch(module, 32, step, ddpkit.rank(), ddpkit.world_size())
        train_step(model, opt, x, y)
        ddpkit.progress(step + 1, steps)
''',
]


# A typical step, not a noisy one: rank 0's median step, from forward's start to the step's end.
TIMELINE = """\
from ddpkit.viz import plot_timeline
trace = cluster.last_trace
start = {{r.step: r.start_ns for r in trace.select(rank=0, name="forward")}}
took = sorted((r.end_ns - start[r.step], r.step) for r in trace.select(rank=0, name="step") if r.step in start)
fig = plot_timeline(trace, steps=[took[len(took) // 2][1]])
fig.savefig({path!r}, dpi=90, bbox_inches="tight")
cluster.shutdown()
"""


def main() -> int:
    only = sys.argv[1:] or ["widget", "lightning"]
    if "lightning" in only and lightning_picture():
        return 1
    return widget_pictures() if "widget" in only else 0


def lightning_picture() -> int:
    """docs/own_script.md's picture of a recorded Lightning run: the ```bash block of its section "Seeing a
    framework's run", run as written (torchrun, then ``python -m ddpkit draw``) in a scratch folder."""
    page = (REPO / "docs" / "own_script.md").read_text()
    section = page.split("### Seeing a framework's run", 1)[1]
    commands = [shlex.split(line) for line in section.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()]
    with tempfile.TemporaryDirectory() as tmp:
        for words in commands:
            if words[0] == "torchrun":  # torchrun is torch's launcher module; a free port, not 29500
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = str(s.getsockname()[1])
                words = [sys.executable, "-m", "torch.distributed.run", "--master-port", port, *words[1:]]
            elif words[0] == "python":
                words = [sys.executable, *words[1:]]
            words = [str(REPO / w) if w.startswith("docs/") else w for w in words]
            env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
            done = subprocess.run(words, cwd=tmp, env=env, capture_output=True, text=True)
            if done.returncode:
                print(f"{shlex.join(words)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}", file=sys.stderr)
                return 1
        IMG.mkdir(parents=True, exist_ok=True)
        draw = commands[-1]
        drawn = Path(tmp) / draw[draw.index("draw") + 1] / "timeline.png"
        shutil.copy(drawn, IMG / "lightning_timeline.png")
    print(f"wrote {IMG / 'lightning_timeline.png'}")
    return 0


def widget_pictures() -> int:
    reason = missing()
    if reason:
        print(f"cannot refresh the pictures: {reason}", file=sys.stderr)
        return 1
    IMG.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root, state = Path(tmp) / "lab", Path(tmp) / "state"
        root.mkdir()
        (root / "pictures.ipynb").write_text(json.dumps(notebook(CELLS)))
        with JupyterLab(root, state) as lab, chromium() as browser:
            page = open_notebook(browser, lab, "pictures.ipynb", width=1500, height=1500)
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
            wait_notebook_idle(page, 120, "starting the cluster", all_run=True)
            widget = page.locator(".ddpkit-cluster").first
            add_and_run_cell(page, "with cluster.recording():\n    losses = cluster.run(train, 400)")
            summary = widget.locator(".ddpkit-live-summary")
            wait_until(lambda: _step(summary.inner_text()) >= 40, 120, "the run to be well under way")
            time.sleep(1.0)  # a frame or two more
            if not kernel_busy(page):
                print("the run ended before the picture: try again on a less busy machine", file=sys.stderr)
                return 1
            widget.scroll_into_view_if_needed()
            widget.screenshot(path=str(IMG / "cluster_widget.png"))
            print(f"wrote {IMG / 'cluster_widget.png'} (mid-run: {summary.inner_text()})")
            wait_notebook_idle(page, 600, "the recorded run")
            path = IMG / "plot_timeline.png"
            add_and_run_cell(page, TIMELINE.format(path=str(path)))
            state = wait_notebook_idle(page, 120, "drawing the timeline")
            if state["errors"]:
                print(f"the notebook failed: {state['errors']}", file=sys.stderr)
                return 1
            print(f"wrote {path}")
    return 0


def _step(summary: str) -> int:
    """The step a live summary ("recording: step 57 · ...") reports, or -1."""
    words = summary.split()
    return int(words[words.index("step") + 1]) if "step" in words and words[words.index("step") + 1].isdigit() else -1


if __name__ == "__main__":
    sys.exit(main())
