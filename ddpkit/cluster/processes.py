"""The rank processes: start them, let them join one process group, stop or kill them.

Each rank is a fresh interpreter (``python -c WORKER_MAIN``), not a multiprocessing child (spawn
would re-import a script's unguarded ``__main__``), alive between jobs. Its channels: the job
socket on loopback (``admission``), a ``TCPStore`` here on an OS-picked port, its stdin (settings,
then held open: when it closes the worker exits) and its stdout/stderr pipes (read by a thread
each). Each start is a new generation; an older one's output is dropped.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import TYPE_CHECKING

from ddpkit.cluster.admission import Admission
from ddpkit.cluster.placement import rank_environment
from ddpkit.cluster.rank_setup import RankSettings
from ddpkit.torch_internals import is_chatter
from ddpkit.cluster.errors import RankError
from ddpkit.cluster.events import Events

if TYPE_CHECKING:
    from ddpkit.network import Network

log = logging.getLogger("ddpkit.cluster")

# not ``-m`` (a second copy of the module as ``__main__``); the parent already warned about torch's version
WORKER_MAIN = ("import warnings; warnings.filterwarnings('ignore', message='ddpkit is tested with torch'); "
               "from ddpkit.cluster.worker import main; main()")
STARTING = ("while the ranks were starting: the cluster is not running; fix the cause, then "
            "call cluster.start()")


@dataclass(frozen=True)
class Settings:
    """What one start of the ranks is made with (the Cluster's arguments, read at start time)."""

    world_size: int
    backend: str
    timeout: float
    threads_per_rank: int
    network: Network  # the links (and nodes) the ranks' process group emulates; sent as to_dict()
    gpus: tuple[int, ...] | None = None  # rank r's CUDA device index gpus[r] (may repeat: shared); None: the CPU
    transport: str = "shm"   # what carries the ranks' bytes (cluster.placement): "shm", "gloo", "cuda-ipc", "nccl"
    cores: tuple[tuple[int, ...], ...] | None = None  # rank r's CPU cores (Cluster(pin_cores=True)), or free
    memory_fraction: float | None = None  # each GPU rank's cap on its GPU's memory (Cluster(memory_fraction=))


RANK_BYTES, RANK_TASKS = 200 << 20, 16  # an idle rank's own memory (~150 MiB measured), processes and threads
START_S = 3.0  # a rank's start-up on one core (importing torch, joining the group), generously


def check_room(world_size: int, transport: str) -> None:
    """Can this machine start ``world_size`` ranks (processes, memory, /dev/shm)? Else a ValueError."""
    import resource

    from ddpkit.comm.transport.segment import SHM_DIR
    from ddpkit.comm.transport.shm import SLAB_BYTES

    memory = None
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:  # Linux: MemAvailable
        memory = next((int(line.split()[1]) >> 10 for line in f if line.startswith("MemAvailable:")), None)
    checks = [(RANK_TASKS * world_size, resource.getrlimit(resource.RLIMIT_NPROC)[0],
               f"processes and threads (ulimit -u; {RANK_TASKS} a rank)"),
              (world_size * RANK_BYTES >> 20, memory, f"MiB of memory ({RANK_BYTES >> 20} a rank)")]
    if transport == "shm":
        checks.append((SLAB_BYTES >> 20, shutil.disk_usage(SHM_DIR).free >> 20,
                       f"MiB free in {SHM_DIR} (the shared-memory transport's buffers; transport='gloo' needs none)"))
    for need, have, what in checks:
        if have not in (None, resource.RLIM_INFINITY) and need > have:
            raise ValueError(f"this machine cannot start {world_size} ranks: they need about {need} {what}, it has "
                             f"{have}; ask for fewer ranks")


LIVE: weakref.WeakSet = weakref.WeakSet()  # the Workers with ranks running, killed at interpreter exit


@atexit.register
def _kill_at_exit() -> None:
    """Kill a Cluster left up at exit while Python still runs threads (its pipe readers must join)."""
    for workers in list(LIVE):
        workers.kill()


class Workers:
    """The cluster's rank processes and their channels, one generation (start) at a time."""

    def __init__(self, events: Events):
        self.events = events
        self.settings: Settings | None = None  # those of the latest start
        self.generation = 0
        self.procs: list[subprocess.Popen] = []
        self.conns: dict = {}  # job channel (a Connection) -> rank
        self.stderr_tail: list[collections.deque] = []  # fd-level stderr: a crash's last words
        self.admission: Admission | None = None
        self.store = None
        self.shm_prefix = ""  # names in /dev/shm of this start's shared-memory groups
        self._readers: list[list[threading.Thread]] = []

    @property
    def alive(self) -> bool:
        return bool(self.procs)

    def start(self, settings: Settings) -> None:
        """Start ``world_size`` ranks and return once every one has joined the process group."""
        if self.procs:
            raise RuntimeError("the cluster is already running; use restart()")
        self.settings = settings
        self.generation += 1
        self.shm_prefix = f"dk{secrets.token_hex(4)}_"  # this start's names in /dev/shm (transport "shm")
        self.admission = Admission(self.generation, settings.world_size)
        self.store = loopback_store(settings.timeout)
        self.events.reset(settings.world_size)
        # the workers run the same ddpkit as this process: <root>/ddpkit/cluster/processes.py's <root>
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=pythonpath,
                   **rank_environment(settings.gpus, settings.transport))  # NCCL's multi-rank switch, if asked
        self._readers, self.stderr_tail = [], []
        LIVE.add(self)
        try:
            for r in range(settings.world_size):
                self._spawn(r, env)
            self._wait_ready()
        except BaseException:
            self.kill()
            self.events.set_all("dead")
            raise

    def _spawn(self, rank: int, env: dict) -> None:
        """One worker: its process, its configuration on stdin, its two pipe readers."""
        # start_new_session: a terminal's Ctrl-C goes to the parent only, which decides what to interrupt
        proc = subprocess.Popen([sys.executable, "-c", WORKER_MAIN], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                cwd=os.getcwd(), start_new_session=True)
        proc.stdin.write((self.rank_settings(rank).to_json() + "\n").encode())
        proc.stdin.flush()  # stdin stays open: its end-of-file tells the worker we are gone
        self.procs.append(proc)
        self.events.ranks[rank].pid = proc.pid
        self.stderr_tail.append(collections.deque(maxlen=40))
        # the readers hold a weak reference only, so a dropped cluster is collected and its __del__ stops the ranks
        readers = [threading.Thread(target=_read_pipe, daemon=True,
                                    args=(weakref.ref(self), rank, name, pipe, self.generation,
                                          self.stderr_tail[rank]),
                                    name=f"ddpkit-rank{rank}-{name}")
                   for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr))]
        for t in readers:
            t.start()
        self._readers.append(readers)

    def rank_settings(self, rank: int) -> RankSettings:
        """What worker ``rank`` of this start is told on its stdin (one JSON line)."""
        s = self.settings
        return RankSettings(rank=rank, world_size=s.world_size, generation=self.generation,
                            address=tuple(self.admission.address), authkey=self.admission.key.hex(),
                            store=("127.0.0.1", self.store.port), timeout=s.timeout, backend=s.backend,
                            transport=s.transport, shm_prefix=self.shm_prefix, network=s.network.to_dict(),
                            threads_per_rank=s.threads_per_rank, sys_path=list(sys.path),
                            gpu=None if s.gpus is None else s.gpus[rank], memory_fraction=s.memory_fraction,
                            cores=None if s.cores is None else list(s.cores[rank]))

    def _wait_ready(self) -> None:
        """Take each rank's admitted connection, then wait until every rank has joined the group."""
        n = self.settings.world_size  # ranks beyond the cores start one after another
        limit = max(self.settings.timeout, 60.0, START_S * n / (os.cpu_count() or 1))
        deadline = time.monotonic() + limit
        while len(self.conns) < self.settings.world_size:
            self._check_startup_alive()
            try:
                rank, pid, conn = self.admission.hellos.get(timeout=0.05)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(self.conns)} of {n} ranks connected within {limit:.0f} s (each imports "
                                       f"torch; {os.cpu_count()} cores): a machine this busy needs fewer "
                                       "ranks, or a longer timeout=") from None
                continue
            if pid != self.procs[rank].pid or rank in self.conns.values():
                log.warning("refused a hello claiming rank %d from pid %d (rank %d is pid %d)",
                            rank, pid, rank, self.procs[rank].pid)
                conn.close()
                continue
            self.conns[conn] = rank
        pending = set(self.conns)
        while pending:
            self._check_startup_alive()
            for conn in wait(list(pending), timeout=0.05):
                rank = self.conns[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    continue  # it died: _check_startup_alive reports it with its output
                if msg[0] == "out":
                    self.events.line(rank, msg[1], msg[2])
                    continue
                if msg[0] == "error":
                    raise RankError({rank: msg[1]}, "joining the process group failed " + STARTING)
                self.events.ranks[rank].device = msg[2]["device"]
                self.events.ranks[rank].status = "idle"
                pending.discard(conn)
            self.events.flush_lines()
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks did not join the process group within {limit:.0f} s")
        self.events.notify("status", None)

    def _check_startup_alive(self) -> None:
        for r, p in enumerate(self.procs):
            if p.poll() is not None:
                for t in self._readers[r]:
                    t.join(timeout=1.0)  # let the pipe readers catch the last lines
                tail = "\n".join(self.events.ranks[r].log) or "(no output)"
                raise RankError({r: f"the worker exited while starting: {how_it_ended(p.returncode)}"
                                    f"\n{tail}"}, STARTING)

    # ------------------------------------------------------------------ between and during jobs
    def check_none_died_while_idle(self) -> None:
        """Before a job: mark ranks that died since the last one, and refuse to run if any is dead."""
        for r, p in enumerate(self.procs):
            if p.poll() is not None and self.events.ranks[r].status != "dead":
                self.events.set_status(r, "dead")
                log.warning("rank %d died while idle: %s", r, how_it_ended(p.returncode))
        dead = [r.rank for r in self.events.ranks if r.status == "dead"]
        if dead:
            raise RuntimeError(f"rank(s) {dead} are dead (they died between jobs); "
                               "call cluster.restart() first")

    def signal(self, rank: int, sig) -> None:
        try:
            self.procs[rank].send_signal(sig)
        except ProcessLookupError:
            pass

    def kill_rank(self, rank: int) -> None:
        self.procs[rank].kill()
        self.procs[rank].wait()

    def death_note(self, rank: int) -> str:
        """What we know of a rank that vanished mid-job: how it ended, its last stderr lines."""
        p = self.procs[rank]
        try:
            p.wait(timeout=5.0)
        except subprocess.TimeoutExpired:  # the channel broke but the process lives: end it
            p.kill()
            p.wait()
        for t in self._readers[rank]:
            t.join(timeout=1.0)  # a segfault's dump arrives through the stderr pipe
        text = f"rank {rank} died while running the job: {how_it_ended(p.returncode)}"
        tail = list(self.stderr_tail[rank])
        if tail:
            text += "\nits last lines on stderr:\n" + "\n".join(tail)
        return text

    # ------------------------------------------------------------------ stopping
    def stop(self) -> None:
        """Ask every rank to stop, kill those still running after 3 s, release ports and rings."""
        for conn in list(self.conns):
            try:
                conn.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + 3.0
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        self.events.rings.close()  # the ranks' flight rings: nobody writes or reads them any more
        self.events.flush_lines()
        self.events.set_all("stopped")

    def restart_after_fault(self) -> None:
        """Kill every rank at once (no polite stop: their process group is suspect) and start anew."""
        self.kill()
        self.events.flush_lines()
        self.start(self.settings)

    def kill(self) -> None:
        """Kill every rank now and close every channel, the job socket and the store."""
        LIVE.discard(self)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for readers in self._readers:
            for t in readers:
                if t is not threading.current_thread():  # __del__ may run in a reader
                    t.join(timeout=1.0)  # the pipes reach end-of-file once the process is gone
        for p in self.procs:
            for f in (p.stdin, p.stdout, p.stderr):
                try:
                    f.close()
                except OSError:
                    pass
        for conn in self.conns:
            conn.close()
        self.procs, self.conns, self._readers = [], {}, []
        if self.settings is not None and self.settings.transport in ("shm", "cuda-ipc"):
            from ddpkit.comm.transport.segment import unlink_segments

            unlink_segments(self.shm_prefix)  # ranks that died while setting up a group left these
        if self.admission is not None:
            self.admission.close()
            self.admission = None
        self.store = None


def loopback_store(timeout: float):
    """The rendezvous TCPStore, hosted here, listening on loopback only."""
    from ddpkit.torch_internals import loopback_tcp_store

    # TCPStore would listen on every interface: give it (to own and close) a socket bound to loopback
    store_sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    store_sock.bind(("127.0.0.1", 0))
    store_sock.listen(128)
    store = loopback_tcp_store(store_sock, timeout=max(timeout, 60.0))
    store_sock.close()
    return store


def _read_pipe(workers_ref, rank: int, stream: str, pipe, generation: int, tail) -> None:
    """Lines a rank wrote below Python (fd 1/2): C++ warnings, a crash's dump."""
    try:
        for raw in iter(pipe.readline, b""):
            text = raw.decode(errors="replace").rstrip("\n")
            if is_chatter(text):
                continue
            if stream == "stderr":
                tail.append(text)
            workers = workers_ref()
            if workers is not None and generation == workers.generation:
                workers.events.line(rank, stream, text)
            del workers
    except (OSError, ValueError):  # the pipe was closed under us by kill()
        pass


def how_it_ended(code: int | None) -> str:
    if code is None:
        return "it is still running"
    if code < 0:
        try:
            return f"it was killed by signal {signal.Signals(-code).name} ({signal.strsignal(-code)})"
        except ValueError:
            return f"it was killed by signal {-code}"
    return f"it exited with code {code}"
