"""One ``run()``: send the job to every rank, collect what comes back, and apply the fault policy.

While a job runs, each rank's job channel carries, in order: the lines it printed, the events
it reported (``ddpkit.progress()``), then its pickled result or its traceback. Lines and
events go to ``Events`` as they arrive; results are kept until every rank has answered.

Faults. A job that raises on some ranks gives ``RankError`` with each rank's traceback. If
other ranks are still running two seconds after the first failure they are probably stuck in a
collective waiting for the failed rank: they get SIGINT, and are killed if that does not stop
them within two seconds (a rank blocked inside a C++ collective cannot run Python's signal
handler). Whenever the process group cannot be trusted any more (a rank died or was killed,
or an error came out of torch.distributed, e.g. a collective that timed out after
``timeout`` seconds), the cluster restarts its ranks before raising, and says so in the error:
the next ``run()`` works, but what the ranks held is gone. Plain Python errors leave the ranks
as they were. The caller's own KeyboardInterrupt (the notebook's stop button) is handled the
same way: interrupt, kill what will not stop, restart only if needed.
"""
from __future__ import annotations

import signal
import sys
import time
from multiprocessing.connection import wait

import cloudpickle

from ddpkit.cluster.errors import RankError
from ddpkit.cluster.events import Events
from ddpkit.cluster.processes import Workers

GRACE_S = 2.0        # after a rank fails, how long the others may keep running before SIGINT
                     # (ranks that raise together can be a second apart on a loaded machine)
KILL_AFTER_S = 2.0   # after SIGINT, how long before a rank that did not stop is killed
TICK_S = 0.1         # "tick" to the observers this often while a job runs

RESTARTED = ("the process group could not be trusted after this (a rank died or was stopped, or "
             "a collective failed or timed out), so the cluster restarted its ranks: the next "
             "run() gets a fresh process group, and anything the ranks held (%%ranks variables, "
             "models) is gone")
UNCHANGED = ("the ranks keep running as they were (a Python error leaves the process group "
             "intact); the cluster is ready for the next run()")


class Job:
    """One run() in flight: which ranks are still running, and what came back so far."""

    def __init__(self, workers: Workers, events: Events):
        self.workers, self.events = workers, events
        self.pending: dict = {}          # rank -> connection, ranks still running
        self.results: dict = {}          # rank -> result
        self.failures: dict = {}         # rank -> traceback: the job failed there
        self.affected: dict = {}         # rank -> text: went down because of a failure
        self.distributed: set = set()    # ranks whose error came out of torch.distributed
        self.broken = False              # the process group is suspect: restart
        self.first_failure: float | None = None
        self.interrupted_at: float | None = None

    def run(self, payload: bytes) -> list:
        """Run the pickled job on every rank; the results in rank order, or ``RankError``."""
        self.events.flush_lines()
        try:
            self._send(payload)
            self._collect()
        except KeyboardInterrupt:
            self._on_keyboard_interrupt()
            raise
        finally:
            self.events.flush_lines()
        if self.failures:
            raise self._error()
        return [self.results[r] for r in range(self.workers.settings.world_size)]

    def _send(self, payload: bytes) -> None:
        for conn, rank in self.workers.conns.items():
            self.workers.stderr_tail[rank].clear()
            try:
                conn.send(("run", payload))
            except OSError:  # it died just now, between jobs
                self.failures[rank] = self.workers.death_note(rank)
                self.broken = True
                self.events.set_status(rank, "dead", traceback=self.failures[rank])
                continue
            self.pending[rank] = conn
            self.events.set_status(rank, "running")

    def _collect(self) -> None:
        """Wait for every rank's result or error; stop stragglers once a rank has failed."""
        last_tick = 0.0
        while self.pending:
            for conn in wait(list(self.pending.values()), timeout=0.05):
                self._receive(self.workers.conns[conn], conn)
            self.events.flush_lines()
            if time.monotonic() - last_tick >= TICK_S:  # observers may act in the running cell
                last_tick = time.monotonic()
                self.events.notify("tick", None)
            if not (self.failures and self.pending):
                continue
            # Some rank failed; the others may be stuck in a collective waiting for it.
            now = time.monotonic()
            self.first_failure = self.first_failure or now
            if self.interrupted_at is None and now - self.first_failure > GRACE_S:
                for rank in self.pending:
                    self.workers.signal(rank, signal.SIGINT)
                self.interrupted_at = now
            elif self.interrupted_at is not None and now - self.interrupted_at > KILL_AFTER_S:
                for rank in list(self.pending):
                    self._kill(rank, f"rank {rank} did not stop within {KILL_AFTER_S:.0f} s "
                               "of SIGINT (probably blocked in a collective waiting for the "
                               "failed rank), so it was killed")

    def _receive(self, rank: int, conn) -> None:
        """Handle one message from a running rank."""
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the rank's process is gone
            self.failures[rank] = self.workers.death_note(rank)
            self.broken = True
            self.pending.pop(rank)
            self.events.set_status(rank, "dead", traceback=self.failures[rank])
            return
        kind = msg[0]
        if kind == "out":
            self.events.line(rank, msg[1], msg[2])
        elif kind == "event":
            self.events.event(rank, msg[1], msg[2])
        elif kind == "result":
            self.pending.pop(rank)
            try:
                self.results[rank] = cloudpickle.loads(msg[1])
            except Exception as exc:
                self.failures[rank] = (f"the result of rank {rank} arrived but cannot be unpickled "
                                       f"here: {type(exc).__name__}: {exc}")
                self.events.set_status(rank, "error", traceback=self.failures[rank])
            else:
                self.events.set_status(rank, "idle")
        elif kind == "error":
            self.pending.pop(rank)
            tb, exc_type, from_distributed = msg[1], msg[2], msg[3]
            if from_distributed:
                self.broken = True
                self.distributed.add(rank)
            if self.interrupted_at is not None and exc_type == "KeyboardInterrupt":
                self.affected[rank] = f"interrupted (SIGINT) while it was still running:\n{tb}"
                self.events.set_status(rank, "idle")
            else:
                self.failures[rank] = tb
                self.events.set_status(rank, "error", traceback=tb)

    def _kill(self, rank: int, why: str) -> None:
        self.workers.kill_rank(rank)
        self.affected[rank] = why
        self.broken = True
        self.pending.pop(rank)
        self.events.set_status(rank, "dead")

    def _error(self) -> RankError:
        """The RankError for a failed job, after restarting the ranks if the group is suspect."""
        if self.failures.keys() - self.distributed:
            # A rank raised or died; collectives that then broke on other ranks are a
            # consequence, not a second cause.
            for rank in self.distributed & self.failures.keys():
                self.affected[rank] = ("its collective failed after another rank failed:\n"
                                       + self.failures.pop(rank))
        note = UNCHANGED
        if self.broken:
            note = RESTARTED
            try:
                self.workers.restart_after_fault()
            except Exception as exc:
                note = (f"the process group could not be trusted after this, and restarting "
                        f"the ranks failed too ({type(exc).__name__}: {exc}); call cluster.restart()")
        return RankError(self.failures, note, self.affected)

    def _on_keyboard_interrupt(self) -> None:
        """The caller pressed stop: interrupt the ranks, kill what will not stop, restart if needed.

        A second KeyboardInterrupt while this runs kills every rank; then call restart().
        """
        try:
            self.interrupted_at = time.monotonic()
            for rank in self.pending:
                self.workers.signal(rank, signal.SIGINT)
            deadline = time.monotonic() + KILL_AFTER_S
            while self.pending and time.monotonic() < deadline:
                for conn in wait(list(self.pending.values()), timeout=0.05):
                    self._receive(self.workers.conns[conn], conn)
            for rank in list(self.pending):
                self._kill(rank, "did not stop after SIGINT")
            self.events.flush_lines()
            if self.broken:
                print("[ddpkit] interrupted: some ranks did not stop cleanly, restarting them "
                      "(a fresh process group)", file=sys.stderr)
                self.workers.restart_after_fault()
            else:
                print("[ddpkit] interrupted: every rank stopped its job; the cluster is ready",
                      file=sys.stderr)
        except KeyboardInterrupt:
            self.workers.kill()
            self.events.set_all("dead")
            print("[ddpkit] interrupted again: every rank was killed; call cluster.restart()",
                  file=sys.stderr)
