"""The run's progress: one bar, a label that says what the run is part of, and what it measured.

Steps come from ``ddpkit.progress(done, total)`` inside the ranks (the slowest rank counts).
A caller that runs a series of jobs (``compare``, ``interleaved``, the cost model's ``validate``:
a ``ddpkit.series.Series``, the one run counter) names each with
``cluster.announce(label, run, runs)``: the label then says which strategy and round, and the
bar shows the whole series (run 9 of 28, 4 of its 10 steps: 30 %, ``progressbar.overall``, as
the terminal bar computes it), not a bar that restarts with every job.

A job that returns ``run_strategy``'s results (``ddpkit.run_result.RunResult``, one per rank) measured a step
time: the label ends with it, the slowest rank's, until the next job. On an emulated network
that this machine's own transport could not keep up with (``emulator.OUTRAN_NOTE`` of the
collectives or more ended after the link's time), a note below says so, in compare's words
(``ddpkit.comm.emulator.outran_note``): that step time is the machine's, not the network's.
"""
from __future__ import annotations

import html

import ipywidgets as widgets

from ddpkit.comm.emulator import outran_note, outran_share
from ddpkit.progressbar import overall
from ddpkit.run_result import RunResult

NOTE_COLOUR = "#e65100"


class RunProgress(widgets.HBox):
    """A progress bar and its label; ``update()`` reads the ranks' progress, ``measured()`` a
    job's results."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.bar = widgets.IntProgress(value=0, min=0, max=1, description="steps",
                                       layout=widgets.Layout(width="40%"))
        self.label = widgets.HTML()
        self.label.add_class("ddpkit-progress-label")
        self.announced: dict | None = None  # {"label", "run", "runs"} from cluster.announce
        self.step_time = ""  # " &middot; 12.34 ms/step (...)" of the last job, if it timed a strategy
        self.note = widgets.HTML(layout=widgets.Layout(width="100%", display="none"))  # below the bar
        self.note.add_class("ddpkit-network-note")
        super().__init__([self.bar, self.label, self.note],
                         layout=widgets.Layout(display="none", flex_flow="row wrap"))

    def announce(self, label, run=None, runs=None) -> None:
        self.announced = None if label is None else dict(label=label, run=run, runs=runs)
        self.update()

    def measured(self, results=None, network=None) -> None:
        """A job's results (None: a job starts, the last one's figures no longer apply): where
        they are ``run_strategy``'s, its step time, and the note where this machine could not
        keep up with ``network`` (the ``ddpkit.Network`` it ran on)."""
        self.step_time, note = "", ""
        if isinstance(results, list) and results and all(isinstance(r, RunResult) for r in results):
            strategy = results[0].strategy
            # as compare times a run: as slow as the slowest rank (each its median over the steps)
            # one run's figure: a table (compare, interleaved) gives the median of its timed rounds
            self.step_time = (f" &middot; {html.escape(str(strategy))}: "
                              f"{max(r.ms_per_step for r in results):.2f} ms/step (this run's slowest rank; "
                              "a table's figure is the median of several runs)")
            share = outran_share([sum(r.emulated_collectives for r in results),
                                  sum(r.outran_link for r in results)])
            note = outran_note({strategy: share}, getattr(network, "name", None))
        self.note.value = f"<span style='color:{NOTE_COLOUR}'>&#9888; {html.escape(note)}</span>" if note else ""
        self.note.layout.display = None if note else "none"
        self.update()

    def update(self) -> None:
        steps = {r.rank: r.progress for r in self.cluster.ranks if r.progress is not None}
        a = self.announced
        if not steps and a is None and not self.step_time:
            self.layout.display = "none"
            return
        done = min((d for d, _ in steps.values()), default=0)
        total = max(max((t for _, t in steps.values()), default=1), 1)
        text = f"{done} / {total} steps" if steps or a is not None else "last run"  # one that reported no steps
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
        self.label.value = text + self.step_time
        self.layout.display = "flex"
