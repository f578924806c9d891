"""What the widget keeps of a recorded run while it streams in: bounded, however long the run.

The cluster keeps every record (``cluster.last_trace``); the live plots only need the last few
steps in full, each rank's memory over time and the loss per step. So a run of thousands of
steps costs the widget the same memory as one of ten: ``KEEP_STEPS`` steps of records,
``MEMORY_POINTS`` memory samples per rank (older ones drop out of the live plot; the replay
after the run reads the whole trace), ``LOSS_STEPS`` loss points (every other old one is
dropped when there are more, so the curve keeps its whole length).

The loss of a step is shown once every rank's has arrived: ranks stream their records in
batches, a quarter of a second apart, so for a while a step may hold one rank's loss only, and a
mean over some of the ranks is not the step's loss (the status line and the plot both read
``complete_losses``, so they give the same step the same value).

What it keeps are the records themselves and ``ddpkit.trace.memory_series``'s points: the
figures (memory over time, the loss per step) are computed by ``ddpkit.trace.figures``, as for
the replay and the matplotlib plots.
"""
from __future__ import annotations

import collections
import threading

from ddpkit.trace.figures import loss_per_step, memory_series

KEEP_STEPS = 4
STEP_RECORDS = 20_000  # a step with more (a job that never starts a new one) shows its first ones
MEMORY_POINTS = 600
LOSS_STEPS = 2000


class LiveState:
    """The bounded view of one recorded run; ``add`` from any thread, ``snapshot`` to draw."""

    def __init__(self, world_size: int = 1):
        self._lock = threading.Lock()
        self.world_size = world_size
        self.steps: dict[int, list] = {}      # step -> its records, the last KEEP_STEPS steps
        self.memory: dict[int, collections.deque] = {}  # rank -> memory_series points, the last few
        self.loss: dict[int, list] = {}       # step -> its loss records (one per rank)
        self.t0: int | None = None
        self.records = 0                      # how many arrived (all kept in cluster.last_trace)
        self.latest: dict[int, int] = {}      # rank -> its newest step

    def add(self, rank: int, records) -> None:
        """A batch of one rank's records, in the order the rank made them."""
        with self._lock:
            memory = []
            for r in records:
                self.records += 1
                if self.t0 is None or r.start_ns < self.t0:
                    self.t0 = r.start_ns
                if r.kind == "counter" and r.cat == "memory":
                    memory.append(r)
                elif r.kind == "counter" and r.cat == "loss" and r.step is not None:
                    self.loss.setdefault(r.step, []).append(r)
                if r.step is None:
                    continue
                self.latest[rank] = max(self.latest.get(rank, r.step), r.step)
                if r.step not in self.steps:
                    if len(self.steps) >= KEEP_STEPS and r.step < min(self.steps):
                        continue  # a straggler's old step: already out of the window
                    self.steps[r.step] = []
                    while len(self.steps) > KEEP_STEPS:
                        del self.steps[min(self.steps)]
                if len(self.steps[r.step]) < STEP_RECORDS:
                    self.steps[r.step].append(r)
            if memory:  # carried on from what this rank's earlier samples said it holds
                points = self.memory.setdefault(rank, collections.deque(maxlen=MEMORY_POINTS))
                points.extend(memory_series(memory, rank, held=points[-1][2] if points else None))
            if len(self.loss) > LOSS_STEPS:
                old = sorted(self.loss)[:-LOSS_STEPS // 2]
                for s in old[1::2]:
                    del self.loss[s]

    def snapshot(self) -> dict:
        """Copies to draw from while more records arrive."""
        with self._lock:
            snap = dict(
                steps=sorted(self.steps), records=[r for s in sorted(self.steps) for r in self.steps[s]],
                memory={rank: list(pts) for rank, pts in self.memory.items()},
                loss=[r for rs in self._complete().values() for r in rs],
                t0=self.t0, count=self.records, latest=dict(self.latest))
        snap["loss"] = loss_per_step(snap["loss"])
        return snap

    def _complete(self) -> dict[int, list]:
        """The steps whose loss every rank has reported (call with the lock held)."""
        return {s: rs for s, rs in self.loss.items() if len({r.rank for r in rs}) >= self.world_size}

    def latest_loss(self) -> tuple[int, float] | None:
        """(step, mean loss over the ranks) of the newest step every rank has reported, or None."""
        with self._lock:
            complete = self._complete()
            if not complete:
                return None
            step = max(complete)
            return step, loss_per_step(complete[step])[step]

    def size(self) -> int:
        """Everything held, in records and points (bounded: a test checks it)."""
        with self._lock:
            return (sum(len(v) for v in self.steps.values()) + sum(len(d) for d in self.memory.values())
                    + len(self.loss))
