"""Cluster: persistent rank processes that run notebook-defined functions.

    cluster = ddpkit.Cluster(world_size=2)        # starts 2 ranks, each in one process group
    cluster.run(lambda: torch.distributed.get_rank())   # -> [0, 1]

Each rank is a fresh interpreter (``python -m ddpkit._worker``), not a multiprocessing child:
spawn would re-import the caller's ``__main__``, which breaks plain scripts without an
``if __name__ == "__main__"`` guard. Workers stay alive between jobs, so a notebook pays the
start-up (importing torch, joining the group) once, not per experiment.

Channels, all local:
- the job channel: a ``multiprocessing.connection`` over loopback, authenticated with a
  random key per cluster (HMAC challenge), carrying jobs, results, tracebacks, printed lines
  and progress events. A connection that fails the challenge is refused and logged.
- the process group's rendezvous: a ``TCPStore`` hosted here in the parent on a port the OS
  picks (port 0), so there is no race for a "free port".
- each worker's stdin: held open by the parent; when it closes (the parent died, even by
  SIGKILL) the worker exits.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Listener, wait

import cloudpickle

log = logging.getLogger("ddpkit.cluster")

BACKENDS = ("auto", "gloo", "nccl")
STATUSES = ("starting", "idle", "running", "error", "dead", "stopped")


class RankError(RuntimeError):
    """One or more ranks failed; ``.failures`` maps each failed rank to its traceback text."""

    def __init__(self, failures: dict[int, str], note: str = ""):
        self.failures = dict(sorted(failures.items()))
        self.ranks = list(self.failures)
        head = f"rank{'s' if len(self.ranks) > 1 else ''} {', '.join(map(str, self.ranks))} failed"
        parts = [head + (f" ({note})" if note else "")]
        for r, tb in self.failures.items():
            parts.append(f"--- rank {r} ---\n{tb.rstrip()}")
        super().__init__("\n".join(parts))


@dataclass
class RankState:
    """What the parent knows about one rank (the widget reads these)."""

    rank: int
    status: str = "starting"
    pid: int | None = None
    device: str = ""
    log: collections.deque = field(default_factory=lambda: collections.deque(maxlen=2000))
    progress: tuple[int, int] | None = None


def _resolve_backend(backend: str, world_size: int) -> str:
    import torch

    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: world_size={world_size} but "
            f"{gpus} CUDA GPU(s) are visible; use backend='gloo' (CPU) or fewer ranks"
        )
    return backend


class Cluster:
    """``world_size`` persistent ranks in one process group; ``run(fn)`` runs fn on all of them."""

    def __init__(self, world_size: int = 2, backend: str = "auto", timeout: float = 60.0):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.world_size = world_size
        self.backend = _resolve_backend(backend, world_size)
        self.timeout = float(timeout)
        self.ranks: list[RankState] = []
        self.last_results: list | None = None
        self._observers: list = []
        self._procs: list[subprocess.Popen] = []
        self._conns: dict = {}
        self._generation = 0
        self._lines: queue.Queue = queue.Queue()
        self._listener = None
        self._lock = threading.Lock()
        self.start()

    # ------------------------------------------------------------------ life cycle
    @property
    def devices(self) -> list[str]:
        return [r.device for r in self.ranks]

    def start(self) -> None:
        """Start the ranks (done by the constructor; call again after ``shutdown()``)."""
        import torch.distributed as dist

        if self._procs:
            raise RuntimeError("the cluster is already running; use restart()")
        self._generation += 1
        self._authkey = os.urandom(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=self._authkey)
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=self.timeout))
        self.ranks = [RankState(r) for r in range(self.world_size)]
        self._notify("status", None)
        hello: queue.Queue = queue.Queue()
        threading.Thread(target=self._accept_loop, args=(self._listener, hello, self._generation),
                         daemon=True, name="ddpkit-accept").start()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        for r in range(self.world_size):
            proc = subprocess.Popen([sys.executable, "-m", "ddpkit._worker"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                    cwd=os.getcwd(), start_new_session=True)
            cfg = dict(rank=r, world_size=self.world_size, backend=self.backend,
                       address=list(self._listener.address), authkey=self._authkey.hex(),
                       generation=self._generation, store_host="127.0.0.1",
                       store_port=self._store.port, timeout=self.timeout, sys_path=sys.path)
            proc.stdin.write((json.dumps(cfg) + "\n").encode())
            proc.stdin.flush()  # stdin stays open: its end-of-file tells the worker we are gone
            self._procs.append(proc)
            self.ranks[r].pid = proc.pid
            for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
                threading.Thread(target=self._read_pipe, args=(r, name, pipe), daemon=True,
                                 name=f"ddpkit-rank{r}-{name}").start()
        try:
            self._wait_ready(hello)
        except BaseException:
            self._kill_all()
            raise

    def _accept_loop(self, listener, hello: queue.Queue, generation: int) -> None:
        while True:
            try:
                conn = listener.accept()
            except OSError:
                return  # listener closed: shutdown()
            except Exception as exc:  # AuthenticationError and friends: not one of ours
                log.warning("refused a connection to the cluster's job channel: %s", exc)
                continue
            try:
                kind, rank, gen, pid = conn.recv()
                if kind != "hello" or gen != generation or not 0 <= rank < self.world_size:
                    raise ValueError("unexpected hello")
            except Exception as exc:
                log.warning("refused a connection with a bad hello: %s", exc)
                conn.close()
                continue
            hello.put((rank, conn))

    def _wait_ready(self, hello: queue.Queue) -> None:
        deadline = time.monotonic() + max(self.timeout, 30.0)
        while len(self._conns) < self.world_size:
            self._check_startup_alive()
            try:
                rank, conn = hello.get(timeout=0.05)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not connect within {deadline:.0f} s")
                continue
            self._conns[conn] = rank
        pending = set(self._conns)
        while pending:
            self._check_startup_alive()
            for conn in wait(list(pending), timeout=0.05):
                rank = self._conns[conn]
                msg = conn.recv()
                if msg[0] == "out":
                    self._line(rank, msg[1], msg[2])
                    continue
                if msg[0] == "error":
                    raise RankError({rank: msg[1]}, "while joining the process group")
                self.ranks[rank].device = msg[2]["device"]
                self.ranks[rank].status = "idle"
                pending.discard(conn)
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks did not join the process group within {deadline:.0f} s")
        self._notify("status", None)

    def _check_startup_alive(self) -> None:
        for r, p in enumerate(self._procs):
            if p.poll() is not None:
                time.sleep(0.2)  # let the pipe readers catch the last lines
                tail = "\n".join(self.ranks[r].log) or "(no output)"
                raise RankError({r: f"the worker exited with code {p.returncode} while starting:\n{tail}"},
                                "while starting")

    def shutdown(self) -> None:
        """Stop every rank (politely, then by force) and release the ports."""
        for conn in list(self._conns):
            try:
                conn.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + 3.0
        for p in self._procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._kill_all()
        for r in self.ranks:
            r.status = "stopped"
        self._notify("status", None)

    def _kill_all(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            for f in (p.stdin, p.stdout, p.stderr):
                try:
                    f.close()
                except OSError:
                    pass
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], {}
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._store = None

    def restart(self) -> None:
        """Stop every rank and start fresh ones (a new process group)."""
        self.shutdown()
        self.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __del__(self):
        try:
            self._kill_all()
        except Exception:
            pass

    def __repr__(self) -> str:
        states = ", ".join(r.status for r in self.ranks)
        return f"Cluster(world_size={self.world_size}, backend={self.backend!r}, ranks=[{states}])"

    # ------------------------------------------------------------------ jobs
    def run(self, fn, *args, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank at once; the results in rank order."""
        if not callable(fn):
            raise TypeError(f"run() needs a callable, got {type(fn).__name__}")
        if not self._procs:
            raise RuntimeError("the cluster is shut down; call cluster.start() or cluster.restart()")
        dead = [r.rank for r in self.ranks if r.status == "dead"]
        if dead:
            raise RuntimeError(f"rank(s) {dead} are dead; call cluster.restart() first")
        try:
            payload = cloudpickle.dumps((fn, args, kwargs))
        except Exception as exc:
            raise TypeError(
                f"cannot send {getattr(fn, '__name__', fn)!r} and its arguments to the ranks: "
                f"cloudpickle could not pickle them ({type(exc).__name__}: {exc}). Jobs cannot "
                "capture open files, locks, sockets, generators or the Cluster itself."
            ) from exc
        self._flush_lines()
        by_rank = {rank: conn for conn, rank in self._conns.items()}
        for rank, conn in by_rank.items():
            conn.send(("run", payload))
            self._set_status(rank, "running")
        results, failures = self._collect(by_rank)
        self._flush_lines()
        if failures:
            raise RankError(failures)
        self.last_results = [results[r] for r in range(self.world_size)]
        self._notify("results", None)
        return self.last_results

    def _collect(self, by_rank: dict) -> tuple[dict, dict]:
        pending = dict(by_rank)
        results, failures = {}, {}
        first_failure = None
        interrupted_at = None
        grace = min(self.timeout, 10.0)
        while pending:
            try:
                ready = wait(list(pending.values()), timeout=0.05)
            except KeyboardInterrupt:
                self._interrupt(pending, failures, "interrupted (KeyboardInterrupt)")
                raise
            self._flush_lines()
            for conn in ready:
                rank = self._conns[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    code = self._procs[rank].wait()
                    failures[rank] = f"rank {rank} died (exit code {code}) while running the job"
                    self._set_status(rank, "dead")
                    pending.pop(rank)
                    continue
                kind = msg[0]
                if kind == "out":
                    self._line(rank, msg[1], msg[2])
                elif kind == "event":
                    self._event(rank, msg[1], msg[2])
                elif kind == "result":
                    results[rank] = cloudpickle.loads(msg[1])
                    self._set_status(rank, "idle")
                    pending.pop(rank)
                elif kind == "error":
                    failures[rank] = msg[1]
                    self._set_status(rank, "error")
                    pending.pop(rank)
            if failures and pending:
                # Some rank failed; the others may be stuck in a collective waiting for it.
                now = time.monotonic()
                first_failure = first_failure or now
                if interrupted_at is None and now - first_failure > grace:
                    for rank in pending:
                        self._signal(rank, signal.SIGINT)
                    interrupted_at = now
                elif interrupted_at is not None and now - interrupted_at > 3.0:
                    for rank in list(pending):
                        self._procs[rank].kill()
                        failures[rank] = (f"rank {rank} was still running {grace:.0f} s after rank(s) "
                                          f"{sorted(set(failures) - set(pending))} failed, and was stopped")
                        self._set_status(rank, "dead")
                        pending.pop(rank)
        return results, failures

    def _interrupt(self, pending: dict, failures: dict, why: str) -> None:
        """Send SIGINT to the running ranks, give them a moment, kill what does not stop."""
        for rank in pending:
            self._signal(rank, signal.SIGINT)
        deadline = time.monotonic() + 5.0
        while pending and time.monotonic() < deadline:
            for conn in wait(list(pending.values()), timeout=0.05):
                rank = self._conns[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    msg = ("error", "died")
                if msg[0] in ("result", "error"):
                    self._set_status(rank, "idle")
                    pending.pop(rank)
        for rank in pending:
            self._procs[rank].kill()
            self._set_status(rank, "dead")
        self._flush_lines()

    def _signal(self, rank: int, sig) -> None:
        try:
            self._procs[rank].send_signal(sig)
        except ProcessLookupError:
            pass

    # ------------------------------------------------------------------ output and events
    def _read_pipe(self, rank: int, stream: str, pipe) -> None:
        for raw in iter(pipe.readline, b""):
            self._line(rank, stream, raw.decode(errors="replace").rstrip("\n"))

    def _line(self, rank: int, stream: str, text: str) -> None:
        """A line a rank printed: keep it in the rank's log and queue it for the caller."""
        if rank < len(self.ranks):
            self.ranks[rank].log.append(text)
        self._lines.put((rank, stream, text))
        self._notify("log", rank, stream=stream, line=text)

    def _flush_lines(self) -> None:
        """Print queued rank output, prefixed ``[rank N]``, from the calling (main) thread.

        Printing here rather than in the reader threads puts the lines into the notebook
        cell that is running, not into whichever cell happened to start the threads.
        """
        while True:
            try:
                rank, stream, text = self._lines.get_nowait()
            except queue.Empty:
                return
            print(f"[rank {rank}] {text}", file=sys.stderr if stream == "stderr" else sys.stdout)

    def _event(self, rank: int, kind: str, payload: dict) -> None:
        if kind == "progress":
            self.ranks[rank].progress = (payload["done"], payload["total"])
        self._notify(kind, rank, **payload)

    def _set_status(self, rank: int, status: str) -> None:
        self.ranks[rank].status = status
        self._notify("status", rank)

    def subscribe(self, callback) -> None:
        """Call ``callback(kind, rank, **fields)`` on status, log, progress and results events."""
        self._observers.append(callback)

    def _notify(self, kind: str, rank, **fields) -> None:
        for cb in list(self._observers):
            try:
                cb(kind, rank, **fields)
            except Exception:  # an observer (the widget) must never break a run
                log.exception("cluster observer failed")

    def _ipython_display_(self):
        # The widget is a later layer (it draws); imported here, on display, and only then.
        from ddpkit.widget import ClusterWidget

        if getattr(self, "_widget", None) is None:
            self._widget = ClusterWidget(self)
        from IPython.display import display

        display(self._widget)


# ---------------------------------------------------------------------- inside a rank
def rank() -> int:
    """This process's rank in the default process group."""
    import torch.distributed as dist

    return dist.get_rank()


def world_size() -> int:
    """The number of ranks in the default process group."""
    import torch.distributed as dist

    return dist.get_world_size()


def device():
    """This rank's device: its GPU under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def progress(done: int, total: int) -> None:
    """Report ``done`` of ``total`` steps to the cluster widget (does nothing outside a Cluster)."""
    from ddpkit import _worker

    _worker.report("progress", done=int(done), total=int(total))
