"""What the parent knows about each rank, and who is told when it changes.

Every status change, printed line and reported event updates the rank's ``RankState`` and goes to
the observers as ``callback(kind, rank, **fields)`` (``rank`` None: the whole cluster), on whatever
thread it arrived; an observer that raises is logged and skipped. Kinds: ``status``, ``log``,
``progress``, ``records``, ``job``, ``tick``, ``results``, ``trace``, ``desync``, ``stuck``,
``unstuck``, ``recording``, ``label``. Printed lines are also queued for ``flush_lines()``.
"""
from __future__ import annotations

import collections
import logging
import queue
import sys
from dataclasses import dataclass, field

from ddpkit.cluster.watch import Rings

log = logging.getLogger("ddpkit.cluster")

STATUSES = ("starting", "idle", "running", "error", "dead", "stopped")


@dataclass
class RankState:
    """What the parent knows about one rank (the widget reads these)."""

    rank: int
    status: str = "starting"
    pid: int | None = None
    device: str = ""
    log: collections.deque = field(default_factory=lambda: collections.deque(maxlen=2000))
    progress: tuple[int, int] | None = None


class Events:
    """The ranks' states, their printed lines, and the observers told of every change; the files
    the ranks keep their last collectives in (``rings``, read when they part: ``ddpkit.comm.desync``)."""

    def __init__(self):
        self.ranks: list[RankState] = []
        self.observers: list = []
        self.rings = Rings()
        self.jobs = 0  # jobs sent so far: the number of the next one
        self._lines: queue.Queue = queue.Queue()  # (rank, stream, text) not yet printed

    def subscribe(self, callback) -> None:
        self.observers.append(callback)

    def unsubscribe(self, callback) -> None:
        if callback in self.observers:
            self.observers.remove(callback)

    def notify(self, kind: str, rank, **fields) -> None:
        for cb in list(self.observers):
            try:
                cb(kind, rank, **fields)
            except Exception:  # an observer (the widget) must never break a run
                log.exception("cluster observer failed")

    def reset(self, world_size: int) -> None:
        """New ranks are starting: fresh states (empty logs), and the observers are told."""
        self.ranks = [RankState(r) for r in range(world_size)]
        self.notify("status", None)

    def set_status(self, rank: int, status: str, **fields) -> None:
        self.ranks[rank].status = status
        if status == "running":  # a new job: the last one's progress no longer applies
            self.ranks[rank].progress = None
        self.notify("status", rank, **fields)

    def set_all(self, status: str) -> None:
        """Every rank at once (all stopped, all dead): one notification for the lot."""
        for r in self.ranks:
            r.status = status
        self.notify("status", None)

    def line(self, rank: int, stream: str, text: str) -> None:
        """A line a rank printed: keep it in the rank's log and queue it for the caller."""
        if rank < len(self.ranks):
            self.ranks[rank].log.append(text)
        self._lines.put((rank, stream, text))
        self.notify("log", rank, stream=stream, line=text)

    def flush_lines(self) -> None:
        """Print queued rank output, prefixed ``[rank N]``, from the calling (main) thread: into the
        notebook cell that is running, not the one that started the reader threads."""
        while True:
            try:
                rank, stream, text = self._lines.get_nowait()
            except queue.Empty:
                return
            print(f"[rank {rank}] {text}", file=sys.stderr if stream == "stderr" else sys.stdout)

    def event(self, rank: int, kind: str, payload: dict) -> None:
        """Something a job reported from inside a rank (``cluster.worker.report``): progress, ..."""
        if kind == "progress":
            self.ranks[rank].progress = (payload["done"], payload["total"])
        self.notify(kind, rank, **payload)
