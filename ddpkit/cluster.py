"""Cluster: persistent rank processes that run notebook-defined functions.

    cluster = ddpkit.Cluster(world_size=2)        # starts 2 ranks, each in one process group
    cluster.run(lambda: torch.distributed.get_rank())   # -> [0, 1]

Each rank is a fresh interpreter (``python -c WORKER_MAIN``), not a multiprocessing child:
spawn would re-import the caller's ``__main__``, which breaks plain scripts without an
``if __name__ == "__main__"`` guard. Workers stay alive between jobs, so a notebook pays the
start-up (importing torch, joining the group) once, not per experiment.

Channels, all local:
- the job channel: a socket on loopback (127.0.0.1, port chosen by the OS). Each connection
  must first pass a mutual HMAC challenge with a random key made per cluster start
  (``_worker.handshake``), in its own thread with a time limit, so a stranger that connects
  and says nothing cannot stall the others. Only then is anything unpickled. A connection
  that fails is refused and logged (logger ``ddpkit.cluster``). It carries jobs, results,
  tracebacks, printed lines and progress events.
- the process group's rendezvous: a ``TCPStore`` hosted here in the parent on a loopback
  port the OS picks (port 0), so there is no race for a "free port". (The store itself has
  no authentication; gloo's own connections between ranks go to the address the host name
  resolves to.)
- each worker's stdin: held open by the parent; when it closes (the parent died, even by
  SIGKILL) the worker exits.

Faults. A job that raises on some ranks gives ``RankError`` with each rank's traceback. If
other ranks are still running two seconds after the first failure they are probably stuck in a
collective waiting for the failed rank: they get SIGINT, and are killed if that does not stop
them within two seconds (a rank blocked inside a C++ collective cannot run Python's signal
handler). Whenever the process group cannot be trusted any more (a rank died or was killed,
or an error came out of torch.distributed, e.g. a collective that timed out after
``timeout`` seconds), the cluster restarts its ranks before raising, and says so in the error:
the next ``run()`` works, but what the ranks held is gone. Plain Python errors leave the ranks
as they were.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait

import cloudpickle

from ddpkit._worker import HANDSHAKE_TIMEOUT, handshake

log = logging.getLogger("ddpkit.cluster")

BACKENDS = ("auto", "gloo", "nccl")
STATUSES = ("starting", "idle", "running", "error", "dead", "stopped")
GRACE_S = 2.0        # after a rank fails, how long the others may keep running before SIGINT
                     # (ranks that raise together can be a second apart on a loaded machine)
KILL_AFTER_S = 2.0   # after SIGINT, how long before a rank that did not stop is killed
# Not ``-m ddpkit._worker``: that runs the file as ``__main__``, a second copy of the module
# beside the ``ddpkit._worker`` that ``ddpkit.progress()`` and ``%%ranks`` import.
WORKER_MAIN = "from ddpkit._worker import main; main()"
STARTING = ("while the ranks were starting: the cluster is not running; fix the cause, then "
            "call cluster.start()")

RESTARTED = ("the process group could not be trusted after this (a rank died or was stopped, or "
             "a collective failed or timed out), so the cluster restarted its ranks: the next "
             "run() gets a fresh process group, and anything the ranks held (%%ranks variables, "
             "models) is gone")
UNCHANGED = ("the ranks keep running as they were (a Python error leaves the process group "
             "intact); the cluster is ready for the next run()")


class RankError(RuntimeError):
    """One or more ranks failed; ``.failures`` maps each failed rank to its traceback text.

    ``.affected`` maps the ranks that went down *because* of those failures to what happened
    to them: interrupted or killed by the cluster while still running (usually stuck in a
    collective waiting for a failed rank), or thrown out of a collective by torch.distributed
    when a peer died. ``.note`` says what happened to the cluster afterwards.
    """

    def __init__(self, failures: dict[int, str], note: str = "", affected: dict[int, str] | None = None):
        self.failures = dict(sorted(failures.items()))
        self.affected = dict(sorted((affected or {}).items()))
        self.ranks = list(self.failures)
        self.note = note
        s = "s" if len(self.ranks) > 1 else ""
        head = f"rank{s} {', '.join(map(str, self.ranks))} failed"
        if self.affected:
            head += f"; rank(s) {', '.join(map(str, self.affected))} went down with it"
        parts = [head]
        for r, tb in self.failures.items():
            parts.append(f"--- rank {r} ---\n{tb.rstrip()}")
        for r, tb in self.affected.items():
            parts.append(f"--- rank {r} (went down after rank{s} {', '.join(map(str, self.ranks))} "
                         f"failed) ---\n{tb.rstrip()}")
        if note:
            parts.append(f"[ddpkit] {note}")
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


@dataclass
class _Job:
    """One run() in flight: which ranks are still running, and what came back so far."""

    pending: dict                                 # rank -> connection, ranks still running
    results: dict = field(default_factory=dict)   # rank -> result
    failures: dict = field(default_factory=dict)  # rank -> traceback: the job failed there
    affected: dict = field(default_factory=dict)  # rank -> text: went down because of a failure
    distributed: set = field(default_factory=set)  # ranks whose error came out of torch.distributed
    broken: bool = False                          # the process group is suspect: restart
    first_failure: float | None = None
    interrupted_at: float | None = None


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


def _how_it_ended(code: int | None) -> str:
    if code is None:
        return "it is still running"
    if code < 0:
        try:
            return f"it was killed by signal {signal.Signals(-code).name} ({signal.strsignal(-code)})"
        except ValueError:
            return f"it was killed by signal {-code}"
    return f"it exited with code {code}"


def _is_learner_module(name: str, module, root: str, installed: tuple[str, ...]) -> bool:
    """Is ``module`` the learner's own code (a .py file under ``root``, not installed, not ddpkit)?"""
    path = getattr(module, "__file__", None)
    if not isinstance(path, str) or not path.endswith(".py") or not os.path.isabs(path):
        return False  # built in, an extension, or a pseudo-module such as torch.ops ("_ops.py")
    if name.split(".")[0] in ("ddpkit", "__main__"):
        return False
    path = os.path.realpath(path)
    if not path.startswith(root) or path.startswith(installed):
        return False
    return not {"site-packages", "dist-packages"} & set(path.split(os.sep))


def _picklable(obj) -> bool:
    try:
        cloudpickle.dumps(obj)
    except Exception:
        return False
    return True


class Cluster:
    """``world_size`` persistent ranks in one process group; ``run(fn)`` runs fn on all of them."""

    def __init__(self, world_size: int = 2, backend: str = "auto", timeout: float = 60.0,
                 threads_per_rank: int | None = None):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        if threads_per_rank is not None and (isinstance(threads_per_rank, bool) or
                                             not isinstance(threads_per_rank, int) or threads_per_rank < 0):
            raise ValueError(f"threads_per_rank must be None (cores / ranks), 0 (torch's default) "
                             f"or a positive integer, got {threads_per_rank!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.world_size = world_size
        self.backend = _resolve_backend(backend, world_size)
        self.timeout = float(timeout)
        # torch's CPU threads per rank. torch starts one per core in every process, so N ranks
        # on C cores would run N*C threads and fight (on 2 cores, 2 ranks made the 256x32 MLP's
        # step ~20x slower); torchrun avoids this with OMP_NUM_THREADS=1. Default: C / N.
        if threads_per_rank is None:
            threads_per_rank = max(1, (os.cpu_count() or 1) // world_size)
        self.threads_per_rank = threads_per_rank
        self.ranks: list[RankState] = []
        self.last_results: list | None = None
        self._created = time.monotonic_ns()  # %%ranks picks the newest live cluster
        self._observers: list = []
        self._procs: list[subprocess.Popen] = []
        self._readers: list[list[threading.Thread]] = []
        self._stderr_tail: list[collections.deque] = []  # fd-level stderr: a crash's last words
        self._conns: dict = {}
        self._generation = 0
        self._lines: queue.Queue = queue.Queue()
        self._listen_sock: socket.socket | None = None
        self._stop_accepting = threading.Event()
        self._module_verdicts: tuple[str, dict] = ("", {})
        self._job_lock = threading.Lock()  # one run() at a time (a notebook, a widget button)
        self.start()

    # ------------------------------------------------------------------ life cycle
    @property
    def devices(self) -> list[str]:
        return [r.device for r in self.ranks]

    def _alive(self) -> bool:
        return bool(self._procs)

    def start(self) -> None:
        """Start the ranks (done by the constructor; call again after ``shutdown()``)."""
        import torch.distributed as dist

        import ddpkit

        if self._procs:
            raise RuntimeError("the cluster is already running; use restart()")
        self._generation += 1
        authkey = os.urandom(32)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))  # loopback only: nothing off this machine can reach it
        sock.listen(64)
        self._listen_sock, self._stop_accepting = sock, threading.Event()
        # The rendezvous store listens on a socket we bind to loopback: left to itself,
        # TCPStore listens on every interface. The store owns (and closes) the fd we give it.
        store_sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        store_sock.bind(("127.0.0.1", 0))
        store_sock.listen(128)
        self._store = dist.TCPStore("127.0.0.1", store_sock.getsockname()[1], is_master=True,
                                    wait_for_workers=False, master_listen_fd=os.dup(store_sock.fileno()),
                                    timeout=timedelta(seconds=max(self.timeout, 60.0)))
        store_sock.close()
        self.ranks = [RankState(r) for r in range(self.world_size)]
        self._notify("status", None)
        hello: queue.Queue = queue.Queue()
        # The helper threads hold no reference to the Cluster (a weak one at most), so a
        # cluster the caller drops is collected and its __del__ stops the ranks.
        threading.Thread(target=self._accept_loop, daemon=True, name="ddpkit-accept",
                         args=(sock, authkey, hello, self._generation, self.world_size,
                               self._stop_accepting)).start()
        # The workers run the same ddpkit as this process, wherever it was imported from.
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(ddpkit.__file__)))
        pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=pythonpath)
        self._readers, self._stderr_tail = [], []
        try:
            for r in range(self.world_size):
                # start_new_session: a Ctrl-C in the terminal goes to the parent only; the
                # parent decides which ranks to interrupt.
                proc = subprocess.Popen([sys.executable, "-c", WORKER_MAIN], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                        cwd=os.getcwd(), start_new_session=True)
                cfg = dict(rank=r, world_size=self.world_size, backend=self.backend,
                           address=list(sock.getsockname()), authkey=authkey.hex(),
                           generation=self._generation, store_host="127.0.0.1",
                           store_port=self._store.port, timeout=self.timeout, sys_path=sys.path,
                           threads=self.threads_per_rank)
                proc.stdin.write((json.dumps(cfg) + "\n").encode())
                proc.stdin.flush()  # stdin stays open: its end-of-file tells the worker we are gone
                self._procs.append(proc)
                self.ranks[r].pid = proc.pid
                self._stderr_tail.append(collections.deque(maxlen=40))
                readers = [threading.Thread(target=self._read_pipe, daemon=True,
                                            args=(weakref.ref(self), r, name, pipe,
                                                  self._generation, self._stderr_tail[r]),
                                            name=f"ddpkit-rank{r}-{name}")
                           for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr))]
                for t in readers:
                    t.start()
                self._readers.append(readers)
            self._wait_ready(hello)
        except BaseException:
            self._kill_all()
            for r in self.ranks:
                r.status = "dead"
            self._notify("status", None)
            raise

    @staticmethod
    def _accept_loop(sock, authkey: bytes, hello: queue.Queue, generation: int, world_size: int,
                     stop: threading.Event) -> None:
        # accept() with a short timeout so that shutdown() ends this thread (closing a socket
        # does not wake a thread blocked in accept() on every platform).
        sock.settimeout(0.25)
        while not stop.is_set():
            try:
                peer, addr = sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return  # the socket was closed: shutdown()
            # One thread per connection: a client that connects and says nothing only
            # stalls its own thread, for at most HANDSHAKE_TIMEOUT seconds.
            threading.Thread(target=Cluster._admit, daemon=True, name="ddpkit-handshake",
                             args=(peer, addr, authkey, hello, generation, world_size)).start()

    @staticmethod
    def _admit(peer, addr, authkey: bytes, hello: queue.Queue, generation: int, world_size: int) -> None:
        where = f"{addr[0]}:{addr[1]}"
        try:
            conn = handshake(peer, authkey, server=True)
        except PermissionError:
            log.warning("refused a connection to the cluster's job channel from %s: "
                        "it does not know the cluster's key", where)
            peer.close()
            return
        except OSError as exc:  # includes a silent client's timeout and a closed connection
            log.warning("refused a connection to the cluster's job channel from %s: no valid "
                        "handshake within %.0f s (%s)", where, HANDSHAKE_TIMEOUT, exc)
            peer.close()
            return
        try:  # authenticated: one of our workers, which now says who it is
            if not conn.poll(HANDSHAKE_TIMEOUT):
                raise TimeoutError("no hello")
            kind, rank, gen, pid = conn.recv()
            if kind != "hello" or gen != generation or not 0 <= rank < world_size:
                raise ValueError(f"unexpected hello {(kind, rank, gen)!r}")
        except Exception as exc:
            log.warning("refused a connection from %s with a bad hello: %s", where, exc)
            conn.close()
            return
        hello.put((rank, pid, conn))

    def _wait_ready(self, hello: queue.Queue) -> None:
        deadline = time.monotonic() + max(self.timeout, 60.0)
        while len(self._conns) < self.world_size:
            self._check_startup_alive()
            try:
                rank, pid, conn = hello.get(timeout=0.05)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not connect within {max(self.timeout, 60.0):.0f} s")
                continue
            if pid != self._procs[rank].pid or rank in self._conns.values():
                log.warning("refused a hello claiming rank %d from pid %d (rank %d is pid %d)",
                            rank, pid, rank, self._procs[rank].pid)
                conn.close()
                continue
            self._conns[conn] = rank
        pending = set(self._conns)
        while pending:
            self._check_startup_alive()
            for conn in wait(list(pending), timeout=0.05):
                rank = self._conns[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    continue  # it died: _check_startup_alive reports it with its output
                if msg[0] == "out":
                    self._line(rank, msg[1], msg[2])
                    continue
                if msg[0] == "error":
                    raise RankError({rank: msg[1]}, "joining the process group failed " + STARTING)
                self.ranks[rank].device = msg[2]["device"]
                self.ranks[rank].status = "idle"
                pending.discard(conn)
            self._flush_lines()
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks did not join the process group within "
                                   f"{max(self.timeout, 60.0):.0f} s")
        self._notify("status", None)

    def _check_startup_alive(self) -> None:
        for r, p in enumerate(self._procs):
            if p.poll() is not None:
                for t in self._readers[r]:
                    t.join(timeout=1.0)  # let the pipe readers catch the last lines
                tail = "\n".join(self.ranks[r].log) or "(no output)"
                raise RankError({r: f"the worker exited while starting: {_how_it_ended(p.returncode)}"
                                    f"\n{tail}"}, STARTING)

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
        self._flush_lines()
        for r in self.ranks:
            r.status = "stopped"
        self._notify("status", None)

    def _kill_all(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for readers in self._readers:
            for t in readers:
                if t is not threading.current_thread():  # __del__ may run in a reader
                    t.join(timeout=1.0)  # the pipes reach end-of-file once the process is gone
        for p in self._procs:
            for f in (p.stdin, p.stdout, p.stderr):
                try:
                    f.close()
                except OSError:
                    pass
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._readers = [], {}, []
        self._stop_accepting.set()
        if self._listen_sock is not None:
            self._listen_sock.close()
            self._listen_sock = None
        self._store = None

    def restart(self) -> None:
        """Stop every rank and start fresh ones (a new process group)."""
        self.shutdown()
        self.start()

    def _restart_after_fault(self) -> None:
        """Kill every rank at once (no polite stop: their process group is suspect) and start anew."""
        self._kill_all()
        self._flush_lines()
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
        return (f"Cluster(world_size={self.world_size}, backend={self.backend!r}, "
                f"devices={self.devices}, ranks=[{states}])")

    # ------------------------------------------------------------------ jobs
    def run(self, fn, *args, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank at once; the results in rank order."""
        if not callable(fn):
            raise TypeError(f"run() needs a callable, got {type(fn).__name__}")
        if not self._procs:
            raise RuntimeError("the cluster is shut down; call cluster.start() or cluster.restart()")
        for r, p in enumerate(self._procs):
            if p.poll() is not None and self.ranks[r].status != "dead":
                self._set_status(r, "dead")
                log.warning("rank %d died while idle: %s", r, _how_it_ended(p.returncode))
        dead = [r.rank for r in self.ranks if r.status == "dead"]
        if dead:
            raise RuntimeError(f"rank(s) {dead} are dead (they died between jobs); "
                               "call cluster.restart() first")
        payload = self._pickle_job(fn, args, kwargs)
        if not self._job_lock.acquire(blocking=False):
            raise RuntimeError("another run() is still going on this cluster; wait for it to finish")
        try:
            return self._run_locked(payload)
        finally:
            self._job_lock.release()

    def _run_locked(self, payload: bytes) -> list:
        self._flush_lines()
        job = _Job(pending={})
        try:
            for conn, rank in self._conns.items():
                self._stderr_tail[rank].clear()
                try:
                    conn.send(("run", payload))
                except OSError:  # it died just now, between jobs
                    job.failures[rank] = self._death_note(rank)
                    job.broken = True
                    self._set_status(rank, "dead", traceback=job.failures[rank])
                    continue
                job.pending[rank] = conn
                self._set_status(rank, "running")
            self._collect(job)
        except KeyboardInterrupt:
            self._on_keyboard_interrupt(job)
            raise
        finally:
            self._flush_lines()
        if job.failures:
            if job.failures.keys() - job.distributed:
                # A rank raised or died; collectives that then broke on other ranks are a
                # consequence, not a second cause.
                for rank in job.distributed & job.failures.keys():
                    job.affected[rank] = ("its collective failed after another rank failed:\n"
                                          + job.failures.pop(rank))
            note = UNCHANGED
            if job.broken:
                note = RESTARTED
                try:
                    self._restart_after_fault()
                except Exception as exc:
                    note = (f"the process group could not be trusted after this, and restarting "
                            f"the ranks failed too ({type(exc).__name__}: {exc}); call cluster.restart()")
            raise RankError(job.failures, note, job.affected)
        self.last_results = [job.results[r] for r in range(self.world_size)]
        self._notify("results", None)
        return self.last_results

    def _pickle_job(self, fn, args, kwargs) -> bytes:
        """cloudpickle the job, the learner's own modules by value (see ``_learner_modules``)."""
        ours = [m for m in self._learner_modules()
                if m.__name__ not in cloudpickle.list_registry_pickle_by_value()]
        for m in ours:
            cloudpickle.register_pickle_by_value(m)
        try:
            return cloudpickle.dumps((fn, args, kwargs))
        except Exception as exc:
            name = getattr(fn, "__qualname__", type(fn).__name__)
            parts = [(f"the function {name!r}", fn)]
            parts += [(f"argument {i} (a {type(a).__name__})", a) for i, a in enumerate(args)]
            parts += [(f"keyword argument {k!r} (a {type(v).__name__})", v) for k, v in kwargs.items()]
            what = next((label for label, obj in parts if not _picklable(obj)),
                        f"the function {name!r} with its arguments")
            raise TypeError(
                f"cannot send {what} to the ranks: cloudpickle could not pickle it "
                f"({type(exc).__name__}: {exc}). A job and its arguments cannot capture open files, "
                "locks, sockets, generators or the Cluster itself; create those inside the job."
            ) from exc
        finally:
            for m in ours:
                cloudpickle.unregister_pickle_by_value(m)

    def _learner_modules(self) -> list:
        """Imported modules that are the learner's own files, to be pickled by value.

        Workers persist, so a module they imported once stays as it was: after the learner
        edits ``exercises/foo.py`` and reloads it here, a by-reference job would still run
        the old code on the ranks. Shipping modules that live under the working directory
        (not installed packages, not ddpkit) by value makes the ranks run exactly the code
        this process has now.
        """
        root = os.path.join(os.path.realpath(os.getcwd()), "")
        if self._module_verdicts[0] != root:  # verdicts are cached per working directory
            self._module_verdicts = (root, {})
        verdicts = self._module_verdicts[1]
        paths = sysconfig.get_paths()
        installed = tuple(os.path.join(os.path.realpath(p), "") for p in
                          {sys.prefix, sys.base_prefix, sys.exec_prefix, paths["stdlib"], paths["purelib"]})
        out = []
        for name, module in list(sys.modules.items()):
            if name not in verdicts:
                verdicts[name] = _is_learner_module(name, module, root, installed)
            if verdicts[name]:
                out.append(module)
        return out

    def _collect(self, job: _Job) -> None:
        """Wait for every rank's result or error; stop stragglers once a rank has failed."""
        while job.pending:
            for conn in wait(list(job.pending.values()), timeout=0.05):
                self._receive(job, self._conns[conn], conn)
            self._flush_lines()
            if not (job.failures and job.pending):
                continue
            # Some rank failed; the others may be stuck in a collective waiting for it.
            now = time.monotonic()
            job.first_failure = job.first_failure or now
            if job.interrupted_at is None and now - job.first_failure > GRACE_S:
                for rank in job.pending:
                    self._signal(rank, signal.SIGINT)
                job.interrupted_at = now
            elif job.interrupted_at is not None and now - job.interrupted_at > KILL_AFTER_S:
                for rank in list(job.pending):
                    self._kill_rank(job, rank, f"rank {rank} did not stop within {KILL_AFTER_S:.0f} s "
                                    "of SIGINT (probably blocked in a collective waiting for the "
                                    "failed rank), so it was killed")

    def _receive(self, job: _Job, rank: int, conn) -> None:
        """Handle one message from a running rank."""
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the rank's process is gone
            job.failures[rank] = self._death_note(rank)
            job.broken = True
            job.pending.pop(rank)
            self._set_status(rank, "dead", traceback=job.failures[rank])
            return
        kind = msg[0]
        if kind == "out":
            self._line(rank, msg[1], msg[2])
        elif kind == "event":
            self._event(rank, msg[1], msg[2])
        elif kind == "result":
            job.pending.pop(rank)
            try:
                job.results[rank] = cloudpickle.loads(msg[1])
            except Exception as exc:
                job.failures[rank] = (f"the result of rank {rank} arrived but cannot be unpickled "
                                      f"here: {type(exc).__name__}: {exc}")
                self._set_status(rank, "error", traceback=job.failures[rank])
            else:
                self._set_status(rank, "idle")
        elif kind == "error":
            job.pending.pop(rank)
            tb, exc_type, from_distributed = msg[1], msg[2], msg[3]
            if from_distributed:
                job.broken = True
                job.distributed.add(rank)
            if job.interrupted_at is not None and exc_type == "KeyboardInterrupt":
                job.affected[rank] = f"interrupted (SIGINT) while it was still running:\n{tb}"
                self._set_status(rank, "idle")
            else:
                job.failures[rank] = tb
                self._set_status(rank, "error", traceback=tb)

    def _kill_rank(self, job: _Job, rank: int, why: str) -> None:
        self._procs[rank].kill()
        self._procs[rank].wait()
        job.affected[rank] = why
        job.broken = True
        job.pending.pop(rank)
        self._set_status(rank, "dead")

    def _death_note(self, rank: int) -> str:
        """What we know of a rank that vanished mid-job: how it ended, its last stderr lines."""
        p = self._procs[rank]
        try:
            p.wait(timeout=5.0)
        except subprocess.TimeoutExpired:  # the channel broke but the process lives: end it
            p.kill()
            p.wait()
        for t in self._readers[rank]:
            t.join(timeout=1.0)  # a segfault's dump arrives through the stderr pipe
        text = f"rank {rank} died while running the job: {_how_it_ended(p.returncode)}"
        tail = list(self._stderr_tail[rank])
        if tail:
            text += "\nits last lines on stderr:\n" + "\n".join(tail)
        return text

    def _on_keyboard_interrupt(self, job: _Job) -> None:
        """The caller pressed stop: interrupt the ranks, kill what will not stop, restart if needed.

        A second KeyboardInterrupt while this runs kills every rank; then call restart().
        """
        try:
            job.interrupted_at = time.monotonic()
            for rank in job.pending:
                self._signal(rank, signal.SIGINT)
            deadline = time.monotonic() + KILL_AFTER_S
            while job.pending and time.monotonic() < deadline:
                for conn in wait(list(job.pending.values()), timeout=0.05):
                    self._receive(job, self._conns[conn], conn)
            for rank in list(job.pending):
                self._kill_rank(job, rank, "did not stop after SIGINT")
            self._flush_lines()
            if job.broken:
                print("[ddpkit] interrupted: some ranks did not stop cleanly, restarting them "
                      "(a fresh process group)", file=sys.stderr)
                self._restart_after_fault()
            else:
                print("[ddpkit] interrupted: every rank stopped its job; the cluster is ready",
                      file=sys.stderr)
        except KeyboardInterrupt:
            self._kill_all()
            for r in self.ranks:
                r.status = "dead"
            self._notify("status", None)
            print("[ddpkit] interrupted again: every rank was killed; call cluster.restart()",
                  file=sys.stderr)

    def _signal(self, rank: int, sig) -> None:
        try:
            self._procs[rank].send_signal(sig)
        except ProcessLookupError:
            pass

    # ------------------------------------------------------------------ output and events
    @staticmethod
    def _read_pipe(cluster_ref, rank: int, stream: str, pipe, generation: int, tail) -> None:
        """Lines a rank wrote below Python (fd 1/2): C++ warnings, a crash's dump."""
        try:
            for raw in iter(pipe.readline, b""):
                text = raw.decode(errors="replace").rstrip("\n")
                if stream == "stderr":
                    tail.append(text)
                cluster = cluster_ref()
                if cluster is not None and generation == cluster._generation:
                    cluster._line(rank, stream, text)
                del cluster
        except (OSError, ValueError):  # the pipe was closed under us by _kill_all
            pass

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

    def _set_status(self, rank: int, status: str, **fields) -> None:
        self.ranks[rank].status = status
        if status == "running":  # a new job: the last one's progress no longer applies
            self.ranks[rank].progress = None
        self._notify("status", rank, **fields)

    def subscribe(self, callback) -> None:
        """Call ``callback(kind, rank, **fields)`` on status, log, progress and results events."""
        self._observers.append(callback)

    def unsubscribe(self, callback) -> None:
        """Stop calling ``callback`` (a closed widget stops following the cluster)."""
        if callback in self._observers:
            self._observers.remove(callback)

    def _notify(self, kind: str, rank, **fields) -> None:
        for cb in list(self._observers):
            try:
                cb(kind, rank, **fields)
            except Exception:  # an observer (the widget) must never break a run
                log.exception("cluster observer failed")

    def _ipython_display_(self):
        # The widget is a later layer (it draws); imported here, on display, and only then.
        from ddpkit.widget import ClusterWidget

        widget = getattr(self, "_widget", None)
        if widget is None or widget._closed:  # one widget per cluster, a new one once closed
            self._widget = ClusterWidget(self)
        from IPython.display import display

        display(self._widget)
