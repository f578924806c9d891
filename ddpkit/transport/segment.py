"""One group's shared memory: a slab every rank maps, a doorbell per rank, and a barrier on them.

The slab (C = chunk bytes, N = ranks in the group), one file mapped by every rank:

    [control: N rows of 16 int64] [half 0: N regions of C | result C] [half 1: the same]

A collective moves its bytes through one half at a time, a chunk of at most C bytes per rank
(``ddpkit.transport.shm``); consecutive chunks alternate halves, so a rank may fill the next
half while a slower one still reads the last (double buffering: one barrier per chunk, not two).

Each rank writes only its own control row (its pid, how many barriers it reached, the
fingerprints of its last two collectives) and reads the others' only after a barrier. The
doorbells are POSIX semaphores, whose post releases and whose wait acquires memory, so what a
rank stored before it rang (data, its control row) is what the others see after they heard it,
on weakly ordered CPUs (ARM) too. A rank waiting for its bell polls it for a few tens of
microseconds, yielding the core to any thread that wants it (backward, the peer), then sleeps
in the kernel: a late peer costs no CPU, and the cores stay with backward.

Life cycle: group rank 0 creates the slab and the N semaphores under ``prefix`` and posts their
name in the group's store; the others attach; once every rank has, rank 0 unlinks the names.
From then on nothing is left in ``/dev/shm``: the memory lives exactly as long as the processes
that map it, even when they are killed. A rank that dies in the short window before the unlink
leaves names behind; whoever chose the prefix (the Cluster's parent) removes them with
``unlink_segments(prefix)``.
"""
from __future__ import annotations

import mmap
import os
import secrets
import tempfile
import time

import torch
import torch.distributed as dist

from ddpkit.liveness import alive

# Where the slab lives: tmpfs on Linux; elsewhere (macOS) a temporary file, unlinked at once too.
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
ROW = 16                 # int64 words per rank in the control area
PID, ARRIVED, FINGERPRINT = 0, 1, 2   # FINGERPRINT: 2 slots x (seq, op code, bytes), by seq parity
PEER_CHECK_S = 0.25      # while waiting, look this often whether a peer has died
_KEY = "ddpkit_shm"      # the group's store keys (beside gloo's own, in the same prefix store)


class ShmError(dist.DistError):
    """A shared-memory collective failed: a peer died, was too late (timeout), or disagreed."""


def _semaphore(name: str, create: bool):
    """A named POSIX semaphore (value 0) by ``name``, created or opened.

    CPython's ``_multiprocessing.SemLock`` (underscored; ``multiprocessing`` itself hands its
    locks to spawned children this way) binds sem_open/sem_post/sem_timedwait, releasing the GIL
    while it waits; named, so processes that are not each other's children can share one."""
    from _multiprocessing import SemLock

    if create:
        return SemLock(1, 0, SemLock.SEM_VALUE_MAX, name, False)  # kind 1: a counting semaphore
    return SemLock._rebuild(0, 1, SemLock.SEM_VALUE_MAX, name)


def _sem_unlink(name: str) -> None:
    from _multiprocessing import sem_unlink

    try:
        sem_unlink(name)
    except OSError:
        pass


def unlink_segments(prefix: str) -> int:
    """Remove what groups named under ``prefix`` left in ``/dev/shm`` (slabs and, on Linux,
    semaphores, which glibc keeps there as ``sem.NAME``); returns how many. For a parent whose
    ranks died before their groups finished setting up; a healthy group leaves nothing."""
    if not prefix or not os.path.isdir(SHM_DIR):
        return 0
    removed = 0
    for entry in os.listdir(SHM_DIR):
        if entry.startswith(prefix) or entry.startswith("sem." + prefix):
            try:
                os.unlink(os.path.join(SHM_DIR, entry))
                removed += 1
            except OSError:
                pass
    return removed


class Segment:
    """This rank's view of its group's slab and doorbells; ``barrier()`` synchronizes the group."""

    def __init__(self, store, rank: int, size: int, chunk_bytes: int, prefix: str, spin_s: float = 0.0):
        self.rank, self.size = rank, size
        self.chunk = max(64, chunk_bytes // 64 * 64)  # regions stay 64-byte aligned for every dtype
        self.spin_s = spin_s
        self.ctrl_bytes = -(-size * ROW * 8 // 4096) * 4096
        self.nbytes = self.ctrl_bytes + 2 * (size + 1) * self.chunk
        self.arrived = 0
        if rank == 0:
            token = prefix + secrets.token_hex(4)
            self.mm = self._create(token)
            try:
                store.set(f"{_KEY}/token", token)
                store.wait([f"{_KEY}/attached/{k}" for k in range(1, size)])
            finally:  # every rank holds them now (or setup failed): no name stays behind
                self._unlink(token)
        else:
            token = store.get(f"{_KEY}/token").decode()
            self.mm = self._attach(token)
            store.set(f"{_KEY}/attached/{rank}", "1")
        self.ctrl = memoryview(self.mm)[: self.ctrl_bytes].cast("q")
        self.ctrl[rank * ROW + PID] = os.getpid()
        self._data = torch.frombuffer(self.mm, dtype=torch.uint8)[self.ctrl_bytes:]
        self._views: dict = {}

    # ------------------------------------------------------------------ setup
    def _create(self, token: str):
        fd = os.open(os.path.join(SHM_DIR, token + "m"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.nbytes)  # zero-filled: every counter starts at 0
            mm = mmap.mmap(fd, self.nbytes)
        finally:
            os.close(fd)
        self.bells = [_semaphore(f"/{token}s{k}", create=True) for k in range(self.size)]
        return mm

    def _attach(self, token: str):
        fd = os.open(os.path.join(SHM_DIR, token + "m"), os.O_RDWR)
        try:
            mm = mmap.mmap(fd, self.nbytes)
        finally:
            os.close(fd)
        self.bells = [_semaphore(f"/{token}s{k}", create=False) for k in range(self.size)]
        return mm

    def _unlink(self, token: str) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, token + "m"))
        except OSError:
            pass
        for k in range(self.size):
            _sem_unlink(f"/{token}s{k}")

    # ------------------------------------------------------------------ data
    def views(self, dtype: torch.dtype) -> torch.Tensor:
        """The two halves as ``dtype``: a (2, N + 1, C / itemsize) view, row N the result area."""
        v = self._views.get(dtype)
        if v is None:
            v = self._views[dtype] = self._data.view(dtype).view(2, self.size + 1, -1)
        return v

    def publish(self, seq: int, code: int, nbytes: int) -> None:
        """Write this rank's fingerprint of collective ``seq`` (checked by ``check``)."""
        base = self.rank * ROW + FINGERPRINT + 3 * (seq % 2)
        self.ctrl[base], self.ctrl[base + 1], self.ctrl[base + 2] = seq, code, nbytes

    def check(self, seq: int, what: str) -> None:
        """After the first barrier of collective ``seq``: did every rank issue the same one?

        A peer cannot have overwritten its slot yet: its next-but-one collective publishes only
        after a barrier this rank has not reached."""
        slot = FINGERPRINT + 3 * (seq % 2)
        mine = self.ctrl[self.rank * ROW + slot:][:3].tolist()
        for k in range(self.size):
            theirs = self.ctrl[k * ROW + slot:][:3].tolist()
            if theirs != mine:
                raise ShmError(f"{what}: ranks disagree on collective #{seq}: rank {self.rank} issued "
                               f"(op {mine[1]}, {mine[2]} bytes), rank {k} issued #{theirs[0]} (op "
                               f"{theirs[1]}, {theirs[2]} bytes); every rank must issue the same "
                               "collectives in the same order")

    # ------------------------------------------------------------------ synchronization
    def barrier(self, deadline: float, what: str) -> None:
        """Return once every rank of the group has reached this barrier; ``ShmError`` if a peer
        died or ``deadline`` (``time.monotonic()``) passed first.

        Rank r rings every peer's bell once, then hears its own N-1 times. Bells of the next
        barrier may arrive early, but no rank can leave barrier b before all reached it: the
        first to leave heard one ring per peer, all of barrier b, as nobody had left it yet."""
        if self.size == 1:
            return
        self.arrived += 1
        self.ctrl[self.rank * ROW + ARRIVED] = self.arrived
        for k, bell in enumerate(self.bells):
            if k != self.rank:
                bell.release()
        for _ in range(self.size - 1):
            self._hear(deadline, what)

    def _hear(self, deadline: float, what: str) -> None:
        bell = self.bells[self.rank]
        if self.spin_s > 0:  # poll a little before sleeping in the kernel: a wake-up costs more
            end = time.perf_counter() + self.spin_s
            while time.perf_counter() < end:
                if bell.acquire(False):
                    return
                os.sched_yield()  # a runnable thread on this core (backward, the peer) goes first
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ShmError(f"{what}: timed out: {self._late()}")
            if bell.acquire(True, min(left, PEER_CHECK_S)):
                return
            self._check_peers(what)

    def _check_peers(self, what: str) -> None:
        for k in range(self.size):
            pid = self.ctrl[k * ROW + PID]
            if k != self.rank and pid and not alive(pid):
                raise ShmError(f"{what}: rank {k} of this group (pid {pid}) died; the collective cannot "
                               "complete")

    def _late(self) -> str:
        late = [k for k in range(self.size) if self.ctrl[k * ROW + ARRIVED] < self.arrived]
        return (f"rank(s) {late} of this group did not reach barrier #{self.arrived} (rank {self.rank} "
                "waited there): they are stuck, busy, or issued other collectives")
