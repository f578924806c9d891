"""The parent's side of desync detection: the ranks' ring files, their stuck reports, when to look.

Each rank keeps its last collectives in a ring (``ddpkit.comm.flight``) in a file made here, which
the parent reads even after the rank died. A ``Watch`` per job diagnoses (``comm.desync.diagnose``)
when a rank reports a collective stuck, when a rank's job ends while others run (then every
``flight.STALL_S``), and when the job ends in errors; a job that goes well costs nothing.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref

from ddpkit.comm import flight
from ddpkit.comm.desync import RankView, diagnose
from ddpkit.liveness import alive

ASK_S = 0.5  # how long a rank has to answer a request for its stack


PREFIX = "ddpkit-flight-"  # then the parent's pid and a random part: ddpkit-flight-<pid>-<random>


class Rings:
    """One ring file per rank, in a private directory removed on ``close``, with this object, or at
    exit; the next ``Rings`` removes those of parents no longer running (``sweep``)."""

    def __init__(self):
        self.dir: str | None = None
        self._finalizer = None

    def path(self, rank: int) -> str:
        if self.dir is None:
            base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
            sweep(base or tempfile.gettempdir())
            self.dir = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base)
            self._finalizer = weakref.finalize(self, shutil.rmtree, self.dir, True)
        path = os.path.join(self.dir, f"rank{rank}.ring")
        if not os.path.exists(path):
            with open(path, "wb") as f:
                f.truncate(flight.ring_size())
        return path

    def close(self) -> None:
        """Remove the directory now (the ranks are gone); the next ``path`` makes a new one."""
        if self._finalizer is not None:
            self._finalizer()  # rmtree, once
        self.dir, self._finalizer = None, None

    def read(self, rank: int, pid: int | None) -> list | None:
        """The rank's entries, oldest first; None if its ring holds nothing of this process."""
        if self.dir is None:
            return None
        found = flight.read(os.path.join(self.dir, f"rank{rank}.ring"), pid)
        return None if found is None else found[1]


def sweep(base: str) -> list[str]:
    """Remove (and name) the ring directories under ``base`` whose parent process has gone."""
    removed = []
    for name in os.listdir(base):
        pid = name[len(PREFIX):].split("-", 1)[0]
        if name.startswith(PREFIX) and pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
            removed.append(name)
    return removed


class Watch:
    """One job's watch: the ranks' stuck reports, and whether a diagnosis is due."""

    def __init__(self, job: int, rings: Rings):
        self.job, self.rings = job, rings
        self.reports: dict = {}   # rank -> its latest "stuck" report (seq, group, index, waited, stack)
        self.due = False          # something changed: diagnose at the next look
        self.checked = 0.0        # when we last diagnosed
        self.asked: dict = {}     # rank -> its job thread's stack, asked for (ask_for_stacks)

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

    def diagnose(self, states: dict, notes: dict, pids: dict, texts: dict):
        """``diagnose`` over every rank: ``states`` rank -> RankView.state, ``notes`` rank -> a few
        words on how its job ended, ``pids`` rank -> the process that wrote its ring, ``texts``
        rank -> its traceback or death note (where it was, for the ranks no longer running)."""
        views = []
        now = time.monotonic()
        for rank, state in sorted(states.items()):
            report = self.reports.get(rank) if state == "running" else None
            waiting = ((tuple(report["ranks"]), report["group"]), report["index"]) if report else None
            waited = report["waited"] + now - report["at"] if report else 0.0
            stack = report["stack"] if report else (self.asked.get(rank) if state == "running" else
                                                     texts.get(rank, ""))
            views.append(RankView(rank, state, self.rings.read(rank, pids.get(rank)), waiting, waited,
                                  notes.get(rank, ""), stack))
        return diagnose(views)

    def stack(self, rank: int) -> str:
        """Where the rank was waiting (its job thread's stack, from its report or asked for), or ""."""
        return self.reports.get(rank, {}).get("stack", "") or self.asked.get(rank, "")

    def ask_for_stacks(self, ranks, send_signal) -> None:
        """Ask running ranks for their stacks (faulthandler answers SIGUSR1, even inside a C++ collective)."""
        import signal

        if self.rings.dir is None or not hasattr(signal, "SIGUSR1"):
            return
        files = {r: os.path.join(self.rings.dir, f"rank{r}.ring.stack") for r in ranks}
        for rank, path in files.items():
            if os.path.exists(path):
                open(path, "w").close()  # empty it: the rank appends
                send_signal(rank, signal.SIGUSR1)
        deadline, sizes = time.monotonic() + ASK_S, {}
        while time.monotonic() < deadline and files:
            time.sleep(0.05)
            for rank, path in list(files.items()):
                size = os.path.getsize(path) if os.path.exists(path) else 0
                if size and sizes.get(rank) == size:  # written, and no longer growing
                    with open(path) as f:
                        self.asked[rank] = flight.job_thread(f.read())
                    del files[rank]
                sizes[rank] = size


__all__ = ["Rings", "Watch"]
