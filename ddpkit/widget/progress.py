"""The run's progress: one bar, and a label that says what the run is part of.

Steps come from ``ddpkit.progress(done, total)`` inside the ranks (the slowest rank counts).
A caller that runs a series of jobs (``compare``, ``interleaved``, the cost model's ``validate``:
a ``ddpkit.series.Series``, the one run counter) names each with
``cluster.announce(label, run, runs)``: the label then says which strategy and round, and the
bar shows the whole series (run 9 of 28, 4 of its 10 steps: 30 %, ``progressbar.overall``, as
the terminal bar computes it), not a bar that restarts with every job.
"""
from __future__ import annotations

import html

import ipywidgets as widgets

from ddpkit.progressbar import overall


class RunProgress(widgets.HBox):
    """A progress bar and its label; ``update()`` reads the ranks' progress."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.bar = widgets.IntProgress(value=0, min=0, max=1, description="steps",
                                       layout=widgets.Layout(width="40%"))
        self.label = widgets.HTML()
        self.label.add_class("ddpkit-progress-label")
        self.announced: dict | None = None  # {"label", "run", "runs"} from cluster.announce
        super().__init__([self.bar, self.label], layout=widgets.Layout(display="none"))

    def announce(self, label, run=None, runs=None) -> None:
        self.announced = None if label is None else dict(label=label, run=run, runs=runs)
        self.update()

    def update(self) -> None:
        steps = {r.rank: r.progress for r in self.cluster.ranks if r.progress is not None}
        a = self.announced
        if not steps and a is None:
            self.layout.display = "none"
            return
        done = min((d for d, _ in steps.values()), default=0)
        total = max(max((t for _, t in steps.values()), default=1), 1)
        text = f"{done} / {total} steps"
        if a is not None and a["run"] and a["runs"]:
            # the whole series: finished runs, plus this one's share
            self.bar.description = "overall"
            self.bar.max = 1000
            self.bar.value = int(1000 * overall(a["run"], a["runs"], done, total))
            text = f"{html.escape(a['label'])} &middot; run {a['run']} of {a['runs']} &middot; {text}"
        else:
            self.bar.description = "steps"
            self.bar.max = total
            self.bar.value = min(done, total)
            if a is not None:
                text = f"{html.escape(a['label'])} &middot; {text}"
        self.label.value = text
        self.layout.display = "flex"
