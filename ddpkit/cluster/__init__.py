"""Cluster: persistent rank processes that run notebook-defined functions.

    cluster = ddpkit.Cluster(world_size=2)        # starts 2 ranks, each in one process group
    ddpkit.Cluster(2, transport="gloo")           # CPU ranks' bytes through gloo's sockets, not shared memory
    ddpkit.Cluster(2, gpus=[4, 5])                # NCCL, rank 0 on cuda:4, rank 1 on cuda:5
    ddpkit.Cluster(4, gpus=[0, 0, 0, 0])          # 4 ranks sharing GPU 0 (placement: bytes through CUDA IPC)
    cluster.run(lambda: torch.distributed.get_rank())   # -> [0, 1]
    with cluster.recording():                     # record (and stream) what the jobs do
        cluster.run(job)                          # -> what job returned, as always
    cluster.last_trace                            # -> the run's records, merged (a Trace)
    cluster.restart(); cluster.shutdown()         # also usable as a context manager

A rank that raises gives ``RankError`` naming the rank(s) and carrying their tracebacks.
This file is the public face; ``processes``, ``placement``, ``admission``, ``jobs``, ``pickling``,
``events``, ``errors`` and ``gpu_memory`` beside it do the work, ``worker`` is the ranks' end.
Recording reaches into a later layer (``ddpkit.trace.live``), imported only when a run is recorded.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
import time

from ddpkit.cluster.errors import RankError
from ddpkit.cluster.events import Events, RankState
from ddpkit.cluster.jobs import Job
from ddpkit.cluster.pickling import JobPickler
from ddpkit.cluster.placement import (BACKENDS, TRANSPORTS, carried_by, check_gpus, check_memory_fraction, place,
                                      resolve_backend)
from ddpkit.cluster.processes import Settings, Workers, check_room

TIMEOUT_S = 60.0  # a collective's default timeout: a Cluster's, and ddpkit.init_process_group's

__all__ = ["BACKENDS", "TRANSPORTS", "Cluster", "RankError", "RankState", "TIMEOUT_S", "check_arguments", "check_gpus",
           "check_network", "resolve_backend"]


class Cluster:
    """``world_size`` persistent ranks in one process group; ``run(fn)`` runs fn on all of them.

    ``gpus``: rank r on ``cuda:gpus[r]``; a GPU named for several ranks (``[0, 0, 0, 0]``) is shared.
    Default (``backend="auto"``): the visible GPUs, one each, shared round-robin when fewer than
    ranks; without a GPU, the CPU (``ddpkit.cluster.placement`` checks, before any rank starts).

    ``transport``: what moves the bytes. CPU ranks: ``"auto"``/``"shm"`` (shared memory, as NCCL
    inside a node) or ``"gloo"`` (loopback sockets, as across hosts). A GPU each: NCCL. Ranks
    sharing a GPU: ``"cuda-ipc"`` (default), ``"shm"``, ``"gloo"`` or ``"nccl"``; ``carried_by`` says.

    ``memory_fraction``: cap each GPU rank's caching allocator at this fraction of its GPU, so
    that a rank that outgrows its share runs out of memory alone (the CUDA context is outside it).

    ``pin_cores``: bind rank r to the r-th of ``world_size`` equal slices of the usable cores, for
    steady timings on a quiet machine (``python -m ddpkit compare --pin-cores`` shows the effect)."""

    def __init__(self, world_size: int = 2, backend: str = "auto", timeout: float = TIMEOUT_S,
                 threads_per_rank: int | None = None, network=None, gpus=None, transport: str = "auto",
                 pin_cores: bool = False, memory_fraction: float | None = None):
        settings = check_arguments(world_size, backend, timeout, threads_per_rank, network, gpus, transport,
                                   pin_cores, memory_fraction)
        self.world_size = settings.world_size
        self._network = settings.network
        self.backend = settings.backend
        self.gpus = settings.gpus  # each rank's CUDA device index (a GPU may repeat: shared), or None: the CPU
        self.timeout = settings.timeout
        self.threads_per_rank = settings.threads_per_rank
        self.transport = settings.transport
        self.cores = settings.cores  # each rank's cores (pin_cores=True), or None: free
        self.memory_fraction = settings.memory_fraction  # each GPU rank's cap, or None
        self.last_results: list | None = None
        self.last_trace = None     # the last recorded run's records (a ddpkit.trace.Trace)
        self._record = False       # record the next runs? (cluster.recording(), the widget's toggle)
        self._created = time.monotonic_ns()  # %%ranks picks the newest live cluster
        self._events = Events()
        self._workers = Workers(self._events)
        self._pickler = JobPickler()
        self._job_lock = threading.Lock()  # one run() at a time (a notebook, a widget button)
        self.start()

    @property
    def ranks(self) -> list[RankState]:
        return self._events.ranks

    @property
    def devices(self) -> list[str]:
        return [r.device for r in self.ranks]

    @property
    def carried_by(self) -> str:
        """What the ranks' collectives go through, in words ("gloo, bytes through shared memory")."""
        return carried_by(self.world_size, self.backend, self.gpus, self.transport)

    @property
    def network(self):
        """The emulated ``ddpkit.Network``; assign one (or a preset name) between runs."""
        return self._network

    @network.setter
    def network(self, network) -> None:
        new = check_network(network, self.world_size)
        if self._workers.alive:
            self._run(_set_network, (new.to_dict(),), {}, record=False)
            # ranks restarted after a fault come back on it too
            self._workers.settings = dataclasses.replace(self._workers.settings, network=new)
        self._network = new

    def _alive(self) -> bool:
        return self._workers.alive

    def start(self) -> None:
        """Start the ranks (done by the constructor; call again after ``shutdown()``)."""
        self._workers.start(Settings(self.world_size, self.backend, self.timeout, self.threads_per_rank,
                                     self._network, self.gpus, self.transport, self.cores, self.memory_fraction))

    def shutdown(self) -> None:
        """Stop every rank (politely, then by force) and release the ports."""
        self._workers.stop()

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
            self._workers.kill()
        except Exception:
            pass

    def run(self, fn, /, *args, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank at once; the results in rank order. While
        recording, ``last_trace`` then holds the merged records (also after a failed job)."""
        if not callable(fn):
            raise TypeError(f"run() needs a callable, got {type(fn).__name__}")
        return self._run(fn, args, kwargs, record=self._record)

    def _run(self, fn, args: tuple, kwargs: dict, record: bool) -> list:
        if not self._workers.alive:
            raise RuntimeError("the cluster is shut down; call cluster.start() or cluster.restart()")
        self._workers.check_none_died_while_idle()
        collector, runner = None, None
        if record:
            from ddpkit.cluster.worker import report
            from ddpkit.trace.live import Collector, run_recorded

            collector = Collector(self.world_size, self.backend)
            runner = (run_recorded, (functools.partial(report, "records"),))  # the ranks' batches, sent here
        payload = self._pickler.dumps(fn, args, kwargs, runner)
        if not self._job_lock.acquire(blocking=False):
            raise RuntimeError("another run() is still going on this cluster; wait for it to finish")
        try:
            if collector is not None:
                self._events.subscribe(collector)
            # name: what the widget calls the run ("naive_job"), e.g. when it keeps drawing it later
            self._events.notify("job", None, phase="start", recorded=collector is not None,
                                name=getattr(fn, "__name__", None) or type(fn).__name__)
            self.last_results = Job(self._workers, self._events).run(payload)
            self._events.notify("results", None)
            return self.last_results
        finally:
            if collector is not None:
                self._events.unsubscribe(collector)
                self.last_trace = collector.trace()
                self._events.notify("trace", None)
            self._events.notify("job", None, phase="end", recorded=collector is not None)
            self._job_lock.release()

    @property
    def record(self) -> bool:
        """Are runs recorded? Set it (the widget's toggle does), or use ``recording()``."""
        return self._record

    @record.setter
    def record(self, on: bool) -> None:
        if bool(on) != self._record:
            self._record = bool(on)
            self._events.notify("recording", None, on=self._record)

    @contextlib.contextmanager
    def recording(self):
        """``with cluster.recording(): cluster.run(job)``: the runs inside are recorded into
        ``cluster.last_trace`` (each rank records with a fresh ``ddpkit.trace.Recorder``)."""
        previous = self._record
        self.record = True
        try:
            yield self
        finally:
            self.record = previous

    def announce(self, label: str | None, run: int | None = None, runs: int | None = None) -> None:
        """Tell the observers what the next runs are part of, e.g. ``announce("overlapped", run=9, runs=28)``."""
        self._events.notify("label", None, label=label, run=run, runs=runs)

    def subscribe(self, callback) -> None:
        """Call ``callback(kind, rank, **fields)`` on every event (see ``cluster.events``)."""
        self._events.subscribe(callback)

    def unsubscribe(self, callback) -> None:
        """Stop calling ``callback`` (a closed widget stops following the cluster)."""
        self._events.unsubscribe(callback)

    def __repr__(self) -> str:
        states = ", ".join(r.status for r in self.ranks)
        return (f"Cluster(world_size={self.world_size}, backend={self.backend!r}, "
                f"devices={self.devices}, ranks=[{states}])")


def _set_network(network: dict) -> None:
    """A job: this rank's collectives are emulated on ``network`` from now on."""
    from ddpkit import rankside

    rankside.comm().set_network(network)


def check_arguments(world_size: int = 2, backend: str = "auto", timeout: float = TIMEOUT_S,
                    threads_per_rank: int | None = None, network=None, gpus=None,
                    transport: str = "auto", pin_cores: bool = False, memory_fraction: float | None = None) -> Settings:
    """A Cluster's arguments, checked and resolved, with nothing started (also the CLI's check)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if threads_per_rank is not None and (isinstance(threads_per_rank, bool) or
                                         not isinstance(threads_per_rank, int) or threads_per_rank < 0):
        raise ValueError(f"threads_per_rank must be None (cores / ranks), 0 (torch's default) "
                         f"or a positive integer, got {threads_per_rank!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e6:
        raise ValueError(f"timeout must be a positive, finite number of seconds (below 1e6), got {timeout!r}")
    network = check_network(network, world_size)
    backend, gpus, transport = place(world_size, backend, gpus, transport)  # where the ranks run, what carries bytes
    check_room(world_size, transport)  # processes, memory, /dev/shm: what this machine can start
    memory_fraction = check_memory_fraction(memory_fraction, gpus)
    # torch starts a thread per core in every process: N ranks on C cores get C / N each, or they
    # fight over the cores (as torchrun's OMP_NUM_THREADS=1 avoids).
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // world_size)
    return Settings(world_size, backend, float(timeout), threads_per_rank, network, gpus, transport,
                    cores_per_rank(world_size) if pin_cores else None, memory_fraction)


def cores_per_rank(world_size: int) -> tuple[tuple[int, ...], ...]:
    """``Cluster(pin_cores=True)``'s cores: the usable cores cut in ``world_size`` equal slices."""
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not usable:
        raise ValueError("pinning ranks to cores (pin_cores=True, --pin-cores) needs os.sched_getaffinity, which "
                         "this platform does not offer (Linux does); leave it out")
    if world_size > len(usable):
        raise ValueError(f"pinning ranks to cores (pin_cores=True, --pin-cores) needs a core per rank: {world_size} "
                         f"ranks, {len(usable)} core(s) this process may use ({usable}); leave it out to share them")
    k = len(usable) // world_size
    return tuple(tuple(usable[r * k:(r + 1) * k]) for r in range(world_size))


def check_network(network, world_size: int):
    """A ``ddpkit.Network`` for ``network`` (None: loopback) whose nodes can lay out ``world_size`` ranks."""
    from ddpkit.network import Network
    from ddpkit.topology import Topology

    net = Network.of(network)
    if net.gpus_per_node is not None:
        Topology.from_network(net, world_size)
    return net
