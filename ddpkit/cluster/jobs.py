"""One ``run()``: send the job to every rank, collect what comes back, and apply the fault policy.

Each rank's channel carries, in order, its printed lines, its events, then its result or traceback.
Faults: a job that raises gives ``RankError`` with each rank's traceback; ranks still running two
seconds later get SIGINT, then are killed. Whenever the process group cannot be trusted (a rank
died, an error out of torch.distributed, any failed job on NCCL) the ranks are restarted before
raising, and the error says so; plain Python errors leave them as they were. A rank out of GPU
memory gives ``GpuOutOfMemoryError`` (what each rank sharing the GPU held). Ranks whose collectives
part (``watch.Watch``, ``ddpkit.comm.desync``) are stopped at once and ``run()`` raises ``DesyncError``.
"""
from __future__ import annotations

import signal
import sys
import time
from multiprocessing.connection import wait

import cloudpickle

from ddpkit.cluster.errors import DesyncError, GpuOutOfMemoryError, RankError
from ddpkit.cluster.events import Events
from ddpkit.cluster.gpu_memory import explain_out_of_memory
from ddpkit.cluster.processes import Workers
from ddpkit.cluster.watch import Watch

GRACE_S = 2.0        # after a rank fails, how long the others may keep running before SIGINT
                     # (ranks that raise together can be a second apart on a loaded machine)
KILL_AFTER_S = 2.0   # after SIGINT, how long before a rank that did not stop is killed
TICK_S = 0.1         # "tick" to the observers this often while a job runs
SETTLE_S = 0.3       # once the ranks parted, how long what they still say may arrive before they are stopped

_FRESH = "the next run() gets a fresh process group, and anything the ranks held (%%ranks variables, models) is gone"
RESTARTED = ("the process group could not be trusted after this (a rank died or was stopped, or "
             f"a collective failed or timed out), so the cluster restarted its ranks: {_FRESH}")
UNCHANGED = ("the ranks keep running as they were (a Python error leaves the process group "
             "intact); the cluster is ready for the next run()")
NCCL_RESTARTED = ("on NCCL a failed job leaves collectives queued that no other rank will match, so "
                  f"the cluster restarted its ranks: {_FRESH}")
DESYNC_RESTARTED = ("the ranks' collectives no longer match, so their process group cannot be "
                    f"trusted: the cluster stopped them and restarted its ranks; {_FRESH}")

# a collective failed or timed out (gloo raises these as plain RuntimeErrors): the group is broken
BROKEN_GROUP = ("Timed out waiting", "pair closure", "Connection closed by peer",
                "Connection reset by peer", "NCCL", "/gloo/", "DistBackendError", "DistNetworkError")


def broke_the_group(traceback_text: str) -> bool:
    """Does this traceback's error say a collective failed or timed out?"""
    tail = "\n".join(traceback_text.rstrip().splitlines()[-3:])  # the exception's message
    return any(marker in tail for marker in BROKEN_GROUP)


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
        self.finished: set = set()       # ranks whose result arrived
        self.died: set = set()           # ranks whose process vanished
        self.notes: dict = {}            # rank -> how its job ended, in a few words
        events.jobs += 1
        self.watch = Watch(events.jobs, events.rings)
        self.parted = None               # a ddpkit.comm.desync.Diagnosis once the ranks' collectives parted
        self.waiting: dict = {}          # rank -> where it waited when it was stopped (a desync)
        self.held: dict = {}             # rank -> what it held on its GPU when its job ended (GpuHeld)
        self.out_of_memory: dict = {}    # rank -> its OutOfMemoryError's last line

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
        if self.failures or self.parted is not None:
            raise self._error()
        return [self.results[r] for r in range(self.workers.settings.world_size)]

    @property
    def backend(self) -> str:
        """The real backend under the ranks' process group ("gloo" or "nccl")."""
        return self.workers.settings.backend

    def _send(self, payload: bytes) -> None:
        for conn, rank in self.workers.conns.items():
            self.workers.stderr_tail[rank].clear()
            # the file the rank keeps its last collectives in, and the job's number (ddpkit.comm.flight)
            ring = {"ring": self.events.rings.path(rank), "job": self.watch.job}
            try:
                conn.send(("run", payload, ring))
            except OSError:  # it died just now, between jobs
                self.failures[rank] = self.workers.death_note(rank)
                self.broken = True
                self.died.add(rank)
                self.events.set_status(rank, "dead", traceback=self.failures[rank])
                continue
            self.pending[rank] = conn
            self.events.set_status(rank, "running")

    def _collect(self) -> None:
        """Wait for every rank's result or error; stop stragglers once a rank has failed."""
        last_tick = 0.0
        while self.pending:
            self._receive_ready()
            self.events.flush_lines()
            if time.monotonic() - last_tick >= TICK_S:  # observers may act in the running cell
                last_tick = time.monotonic()
                self.events.notify("tick", None)
            ended = len(self.pending) < len(self.workers.conns)
            if self.pending and self.watch.should_check(ended, bool(self.pending)):
                self._look_for_desync()
            if not (self.failures and self.pending):
                continue
            # some rank failed; the others may be stuck in a collective waiting for it
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

    def _receive_ready(self) -> None:
        for conn in wait(list(self.pending.values()), timeout=0.05):
            self._receive(self.workers.conns[conn], conn)

    def _drain(self, seconds: float) -> None:
        """Receive what the running ranks say for at most ``seconds``."""
        deadline = time.monotonic() + seconds
        while self.pending and time.monotonic() < deadline:
            self._receive_ready()

    def _receive(self, rank: int, conn) -> None:
        """Handle one message from a running rank."""
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the rank's process is gone
            self.failures[rank] = _without_module_list(self.workers.death_note(rank))
            self.broken = True
            self.died.add(rank)
            self.notes[rank] = _death(self.failures[rank])
            self.pending.pop(rank)
            self.watch.ended()
            self.events.set_status(rank, "dead", traceback=self.failures[rank])
            return
        kind = msg[0]
        if kind == "out":
            self.events.line(rank, msg[1], msg[2])
        elif kind == "event":
            if msg[1] == "stuck":
                self.watch.stuck(rank, msg[2])
            elif msg[1] == "unstuck":
                self.watch.unstuck(rank, msg[2])
            elif msg[1] == "gpu_memory":
                self.held[rank] = msg[2]["held"]
            self.events.event(rank, msg[1], msg[2])
        elif kind == "result":
            self.pending.pop(rank)
            self.finished.add(rank)
            self.watch.ended()
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
            self.watch.ended()
            tb, exc_type, from_distributed = msg[1], msg[2], msg[3]
            lines = tb.strip().splitlines()
            self.notes[rank] = lines[-1] if lines else exc_type
            if exc_type == "OutOfMemoryError":  # torch.OutOfMemoryError (torch.cuda's is the same class)
                self.out_of_memory[rank] = self.notes[rank]
            if from_distributed or broke_the_group(tb):
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

    def _states(self) -> dict:
        """Each rank's ``ddpkit.comm.desync.RankView.state`` now."""
        order = (("running", self.pending), ("died", self.died), ("broken", self.distributed),
                 ("failed", self.failures), ("finished", self.finished))
        # "stopped": interrupted or killed by us while it was still running
        return {rank: next((s for s, ranks in order if rank in ranks), "stopped")
                for rank in range(self.workers.settings.world_size)}

    def _diagnose(self):
        pids = {r.rank: r.pid for r in self.events.ranks}
        return self.watch.diagnose(self._states(), self.notes, pids, {**self.affected, **self.failures})

    def _look_for_desync(self) -> None:
        """Have the ranks' collectives parted? Then stop the ranks still running, at once: they
        wait (or will) in a collective that no other rank will ever issue."""
        found = self._diagnose()
        if found is None:
            return
        self._drain(SETTLE_S)  # what the ranks are saying now (a death, an error on its way) ...
        # ... and where the ranks still running are (those that reported stuck said so already)
        self.watch.ask_for_stacks([r for r in self.pending if r not in self.watch.reports], self.workers.signal)
        found = self._diagnose() or found
        if found.kind != "failed":
            self.parted = found
        for rank in list(self.pending):
            stack = self.watch.stack(rank)
            where = f"\nwhere it was waiting:\n{stack.rstrip()}" if stack else ""
            if found.kind == "failed":
                ended = ", ".join(str(r) for r, v in found.views.items() if v.state in ("failed", "died"))
                self._kill(rank, f"rank {rank} was stopped by the cluster at once: it issued collective "
                                 f"#{found.index} of {found.group_name()}, which rank(s) {ended} will never "
                                 f"issue (they failed): {found.describe(rank)}{where}")
            else:
                self._kill(rank, f"stopped by the cluster (its collectives parted from the others'){where}")

    def _desync_error(self, note: str) -> DesyncError:
        """The ranks parted: the ranks of the parted group, what each did; the others went down."""
        diag = self.parted
        texts = {**self.affected, **self.failures}
        failures, affected = {}, {}
        for rank in range(self.workers.settings.world_size):
            text = texts.get(rank)
            if rank in self.finished:
                text = f"its job finished (it returned) after its collective #{diag.views[rank].last(diag.key)}"
            if text is None:
                continue
            (failures if rank in diag.ranks else affected)[rank] = text
        return DesyncError(diag, failures, note, affected)

    def _error(self) -> RankError:
        """The RankError for a failed job, after restarting the ranks if the group is suspect."""
        if self.parted is None:
            found = self._diagnose()  # the job ended in errors: did the ranks part first?
            if found is not None and found.kind != "failed":
                self.parted = found
        if self.parted is not None:
            self.broken = True
            self.events.notify("desync", None, diagnosis=self.parted)
        elif self.failures.keys() - self.distributed:
            # a rank raised or died; collectives that then broke elsewhere are a consequence
            for rank in self.distributed & self.failures.keys():
                self.affected[rank] = ("its collective failed after another rank failed:\n"
                                       + self.failures.pop(rank))
        note = UNCHANGED
        nccl = self.backend == "nccl" and not self.broken  # only NCCL's queued collectives call for it
        if self.broken or nccl:
            note = DESYNC_RESTARTED if self.parted is not None else NCCL_RESTARTED if nccl else RESTARTED
            try:
                self.workers.restart_after_fault()
            except Exception as exc:
                note = (f"the process group could not be trusted after this, and restarting "
                        f"the ranks failed too ({type(exc).__name__}: {exc}); call cluster.restart()")
        if self.parted is not None:
            return self._desync_error(note)
        if self.out_of_memory:
            devices = {r.rank: r.device for r in self.events.ranks}
            return GpuOutOfMemoryError(explain_out_of_memory(self.out_of_memory, self.held, devices),
                                       sorted(self.out_of_memory), self.held, self.failures, note, self.affected)
        return RankError(self.failures, note, self.affected)

    def _on_keyboard_interrupt(self) -> None:
        """The caller pressed stop: interrupt the ranks, kill what will not stop, restart if needed
        (a second KeyboardInterrupt kills every rank)."""
        try:
            self.interrupted_at = time.monotonic()
            for rank in self.pending:
                self.workers.signal(rank, signal.SIGINT)
            self._drain(KILL_AFTER_S)
            for rank in list(self.pending):
                self._kill(rank, "did not stop after SIGINT")
            self.events.flush_lines()
            if self.backend == "nccl":  # NCCL keeps what the job queued: no other rank will match it
                self.broken = True
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


def _death(note: str) -> str:
    """How a rank died, in a line: the signal, and what the C++ library said as it aborted."""
    how = note.splitlines()[0].partition(": ")[2]
    said = [line.split("what():", 1)[1].strip() for line in note.splitlines() if "what():" in line]
    return f"{how}; {said[0]}" if said else how


def _without_module_list(note: str) -> str:
    """A dead rank's note without what is noise to a learner in faulthandler's dump: its list of
    extension modules, and the stacks of the rank's helper threads (the job runs in ``main``)."""
    blocks, out = note.split("\n\n"), []
    for block in blocks:
        helper = block.lstrip().startswith(("Thread 0x", "Current thread 0x")) and " in main" not in block
        if not helper:
            out.append("\n".join(line for line in block.splitlines() if not line.startswith("Extension modules:")))
    return "\n\n".join(out).rstrip()
