"""A one-line progress bar on the terminal for a series of Cluster runs (compare, validate).

    bar = ProgressBar()
    compare(cluster, ..., progress=bar)  # its ddpkit.series.Series subscribes the bar to the cluster:
                                         # each run announced ("<strategy>: timing round 1 of 3",
                                         # run 1 of 12), and rank 0's ddpkit.progress(done, total)
    bar.close()

The bar counts nothing itself: the run number comes from the series' announcement (the one
counter, ``ddpkit.series.Series``), and ``overall`` below is the one formula for how far a
series is, which the widget's progress bar uses too.

Not ``ddpkit.progress``: that is the rank-side call that sends the step events this bar shows.
"""
from __future__ import annotations

import sys


def overall(run: int, runs: int, done: int, total: int) -> float:
    """How far a series is, 0..1: its finished runs plus this run's share (``done`` of its
    ``total`` steps), over all ``runs``; run ``run`` is 1-based."""
    return min((run - 1 + min(done, total) / max(total, 1)) / max(runs, 1), 1.0)


class ProgressBar:
    """A one-line progress bar on stderr, fed by the cluster's events: announcements (label, run i
    of n) and rank 0's progress. ``total_runs``: the runs of a series nobody announces (a single
    ``start``ed run); an announcement brings its own count."""

    def __init__(self, total_runs: int = 1, stream=sys.stderr):
        self.stream = stream
        self.label, self.run, self.runs = "", 1, total_runs
        self.tty = stream.isatty()
        self._shown = None  # the last line written: the same state twice is written once

    def start(self, label: str) -> None:
        """A run that no series announces (``python -m ddpkit trace``): show it under ``label``."""
        self.announce(label, self.run, self.runs)

    def announce(self, label: str | None, run: int | None = None, runs: int | None = None) -> None:
        if label is None:  # the series is over
            return
        self.label, self.run, self.runs = label, run or 1, runs or 1
        self.show(0, 1)

    def show(self, done: int, total: int) -> None:
        # the bar is the whole series (finished runs plus this one's share), the words this run
        width = 24
        frac = overall(self.run, self.runs, done, total)
        fill = int(width * frac)
        line = (f"[{'#' * fill}{'.' * (width - fill)}] {frac:4.0%} run {self.run}/{self.runs} "
                f"{self.label}: step {done}/{total}")
        if line == self._shown:  # nothing new: the same state is written once
            return
        self._shown = line
        if self.tty:
            self.stream.write("\r" + line.ljust(79))
        elif done in (0, total):  # not a terminal (a log): one line per start and end of a run
            self.stream.write(line + "\n")
        self.stream.flush()

    def __call__(self, kind, rank, **fields) -> None:
        if kind == "label":
            self.announce(fields["label"], fields.get("run"), fields.get("runs"))
        elif kind == "progress" and rank == 0:
            self.show(fields["done"], fields["total"])

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
        self._shown = None
