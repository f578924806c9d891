"""The cluster's state where the learner is: a compact status line in the output of a cell whose
run takes a while, and a plain note in the cell that shut the cluster down.

The widget sits where the cluster was displayed, often far above the cell that is running
(Run All scrolls to the bottom). So once a run has gone on for ``LONG_S`` seconds, a one-line
status -- each rank's state, what the run is, its step, the loss when recorded -- appears in
that run's own cell and follows it to its end ("done in 12.3 s", or which rank failed). A
series of runs (``ddpkit.series``: compare, validate) gets one line for the whole series, which
follows it from run to run and ends with the series, not with the first run long enough to show
one. The cluster tells its observers about a run on the thread that waits for it, i.e. the
running cell's, so whatever is displayed from those calls lands in that cell's output.
"""
from __future__ import annotations

import html
import time

import ipywidgets as widgets

from ddpkit.units import plural

LONG_S = 2.0     # a run shorter than this gets no status line (most cells)
UPDATE_S = 0.5   # the line changes at most this often


def kernel_display():
    """IPython's ``display`` when running in a notebook kernel, else None (a script, a test)."""
    import sys

    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or not hasattr(shell, "kernel"):
        return None
    from IPython.display import display

    return display


class CellStatus:
    """Shows ``describe()`` (HTML) in the running cell during long runs; notes a shutdown."""

    def __init__(self, describe, cell_output):
        self.describe, self.cell_output = describe, cell_output
        self.line: widgets.HTML | None = None  # the current run's status line, once shown
        self.started: float | None = None
        self.series_started: float | None = None  # a series of runs goes on: one line for all of it
        self._updated = 0.0

    def series(self, on: bool) -> None:
        """A series of runs begins (``on``) or ends: its runs share one line, ended with it."""
        if on and self.series_started is None:
            self.series_started, self.line = time.monotonic(), None
        elif not on and self.series_started is not None:
            took = time.monotonic() - self.series_started
            if self.line is not None:
                self.line.value = self.describe(f"finished after {took:.1f} s")
            self.series_started, self.started, self.line = None, None, None

    def job(self, phase: str) -> None:
        now = time.monotonic()
        if phase == "start":  # in a series, its line (if shown) follows it to this run
            if self.series_started is None:
                self.line = None
            self.started = self.series_started or now
        elif self.started is not None:
            if self.line is not None:  # a series ends with the series, not with its runs
                took = now - self.started
                when = f"{took:.0f} s" if self.series_started else f"finished after {took:.1f} s"
                self.line.value = self.describe(when)
            self.started = None

    def tick(self) -> None:
        if self.started is None or self.cell_output is None:
            return
        now = time.monotonic()
        if self.line is None:
            if now - self.started < LONG_S:
                return
            self.line = widgets.HTML(self.describe(f"{now - self.started:.0f} s"))
            self.line.add_class("ddpkit-cell-status")
            self.cell_output(self.line)
            self._updated = now
        elif now - self._updated >= UPDATE_S:
            self.line.value = self.describe(f"{now - self.started:.0f} s")
            self._updated = now

    def shut_down(self, world_size: int) -> None:
        """The notebook stopped the cluster (not the widget's button): say so in this cell."""
        if self.cell_output is not None:
            note = widgets.HTML(
                f"<span style='color:#616161'>&#9632; <b>ddpkit</b>: this cell shut the cluster down "
                f"({plural(world_size, 'rank')} stopped at {html.escape(time.strftime('%H:%M:%S'))}). "
                "cluster.start() or the widget's start button brings it back.</span>")
            note.add_class("ddpkit-shutdown-note")
            self.cell_output(note)
