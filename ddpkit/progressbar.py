"""A one-line progress bar on the terminal for a series of Cluster runs (compare, validate).

    bar = ProgressBar(total_runs=4)
    cluster.subscribe(bar)          # rank 0's ddpkit.progress(done, total) events move it
    bar.start("naive: timing round 1 of 3")    # before each run (ddpkit.compare does this)
    ...
    bar.close()

Not ``ddpkit.progress``: that is the rank-side call that sends the events this bar shows.
"""
from __future__ import annotations

import sys


class ProgressBar:
    """A one-line progress bar on stderr, fed by the cluster's progress events from rank 0."""

    def __init__(self, total_runs: int, stream=sys.stderr):
        self.total_runs, self.stream = total_runs, stream
        self.run, self.label = 0, ""
        self.tty = stream.isatty()

    def start(self, label: str) -> None:
        self.run += 1
        self.label = label
        self.show(0, 1)

    def show(self, done: int, total: int) -> None:
        # the bar is the whole series (finished runs plus this one's share), the words this run
        width = 24
        overall = min((self.run - 1 + done / max(total, 1)) / max(self.total_runs, 1), 1.0)
        fill = int(width * overall)
        line = (f"[{'#' * fill}{'.' * (width - fill)}] {overall:4.0%} run {self.run}/{self.total_runs} "
                f"{self.label}: step {done}/{total}")
        if self.tty:
            self.stream.write("\r" + line.ljust(79))
        elif done in (0, total):  # not a terminal (a log): one line per start and end of a run
            self.stream.write(line + "\n")
        self.stream.flush()

    def __call__(self, kind, rank, **fields) -> None:
        if kind == "progress" and rank == 0:
            self.show(fields["done"], fields["total"])

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
