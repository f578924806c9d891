"""The parent's side of desync detection: the ranks' ring files, their stuck reports, when to look.

Each rank keeps its last collectives in a ring (``ddpkit.flight``) mapped from a file that the
parent makes here, one per rank, in a private directory (in ``/dev/shm`` where there is one): the
parent reads it whenever it diagnoses, even after the rank died. The job message tells the rank
which file is its own (``Rings.path``) and the job's number.

A ``Watch`` per job decides when to diagnose (``ddpkit.desync.diagnose``): when a rank reports a
collective stuck longer than ``flight.STALL_S``, when a rank's job ends while others still run
(then again every ``STALL_S`` while they do), and once more when the job ends in errors. Between
those nothing is read: a job that goes well costs the parent nothing.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref

from ddpkit import flight
from ddpkit.desync import RankView, diagnose


class Rings:
    """One ring file per rank, in a private directory removed with this object (or at exit)."""

    def __init__(self):
        self.dir: str | None = None

    def path(self, rank: int) -> str:
        if self.dir is None:
            base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
            self.dir = tempfile.mkdtemp(prefix="ddpkit-flight-", dir=base)
            weakref.finalize(self, shutil.rmtree, self.dir, True)
        path = os.path.join(self.dir, f"rank{rank}.ring")
        if not os.path.exists(path):
            with open(path, "wb") as f:
                f.truncate(flight.ring_size())
        return path

    def read(self, rank: int, pid: int | None) -> list | None:
        """The rank's entries, oldest first; None if its ring holds nothing of this process."""
        if self.dir is None:
            return None
        found = flight.read(os.path.join(self.dir, f"rank{rank}.ring"), pid)
        return None if found is None else found[1]


class Watch:
    """One job's watch: the ranks' stuck reports, and whether a diagnosis is due."""

    def __init__(self, job: int, rings: Rings):
        self.job, self.rings = job, rings
        self.reports: dict = {}   # rank -> its latest "stuck" report (seq, group, index, waited, stack)
        self.due = False          # something changed: diagnose at the next look
        self.checked = 0.0        # when we last diagnosed

    def stuck(self, rank: int, report: dict) -> None:
        if report.get("job") == self.job:
            self.reports[rank] = dict(report, at=time.monotonic())
            self.due = True

    def unstuck(self, rank: int, report: dict) -> None:
        if self.reports.get(rank, {}).get("seq") == report.get("seq"):
            del self.reports[rank]

    def ended(self) -> None:
        """A rank's job ended (result, error or death): look at once."""
        self.due = True

    def should_check(self, some_ended: bool, some_running: bool) -> bool:
        now = time.monotonic()
        if self.due or (some_ended and some_running and now - self.checked >= flight.STALL_S):
            self.due, self.checked = False, now
            return True
        return False

    def diagnose(self, states: dict, notes: dict, pids: dict):
        """``diagnose`` over every rank: ``states`` rank -> RankView.state, ``notes`` rank -> a few
        words on how its job ended, ``pids`` rank -> the process that wrote its ring."""
        views = []
        now = time.monotonic()
        for rank, state in sorted(states.items()):
            report = self.reports.get(rank) if state == "running" else None
            waiting = (report["group"], report["index"]) if report else None
            waited = report["waited"] + now - report["at"] if report else 0.0
            views.append(RankView(rank, state, self.rings.read(rank, pids.get(rank)), waiting, waited,
                                  notes.get(rank, "")))
        return diagnose(views)

    def stack(self, rank: int) -> str:
        """Where the rank was waiting when it reported (its job thread's stack), or ""."""
        return self.reports.get(rank, {}).get("stack", "")


__all__ = ["Rings", "Watch"]
