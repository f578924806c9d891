"""One group's shared memory: a slab every rank maps, and doorbells between every pair of ranks.

The slab (N ranks, S slots, R bytes per region), one file mapped by every rank:

    [control: N pids, then S slots x N ranks x 4 int64: a fingerprint and when] [data: S slots x N regions of R]

A collective moves through the slab in *pieces* of at most R bytes per rank; piece q uses slot
q % S. Each rank writes its part of a piece into its own region of that slot (it *deposits* it),
and reads the others' regions once they have deposited theirs (it *completes* it). So a rank
never waits for a peer to deposit -- it waits only to complete, and only for the peers not there
yet: no barrier, and the rank that arrives last completes at once, in the thread that issued.

The doorbells are named POSIX semaphores, one per ordered pair of ranks and per kind of news:

- ``deposited[k]``: rank k deposited one more piece (rank k rings it, this rank takes it);
- ``freed[k]``: rank k completed one more piece, so its slot may be used again.

Each is a count, and each rank deposits and completes its pieces in order, so the m-th ring from
rank k means k's m-th piece: no tags needed. A semaphore's post releases and its wait acquires
memory, so what a rank stored before it rang (its region, its fingerprint) is what the others see
after they took the ring, on weakly ordered CPUs (ARM) too. Taking a ring that is already there
costs a fraction of a microsecond; a rank that must wait sleeps in the kernel, so a late peer costs
no CPU and the cores stay with backward.

For ranks sharing a GPU (the CUDA IPC transport) the data area is on the GPU instead
(``device_slab``): the file then holds the control words only, and ``data`` is a GPU buffer every
rank of the group maps; ``data.settle()`` and friends say when its bytes are there.

Life cycle: group rank 0 creates the slab and the semaphores under ``prefix`` and posts their
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

from ddpkit.comm.transport.device_slab import DeviceSlab, HostSlab
from ddpkit.liveness import alive

# Where the slab lives: tmpfs on Linux; elsewhere (macOS) a temporary file, unlinked at once too.
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
FINGERPRINT = 4          # int64 words per rank and slot: (collective number, op code, bytes, deposited at ns)
AGREED = 3               # ... the first of them, which every rank's must equal (``check``)
MIN_REGION = 64 << 10    # where /dev/shm is short, regions are halved down to this (1 MiB a group of 2)
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
    """This rank's view of its group's slab and doorbells."""

    def __init__(self, store, rank: int, size: int, slots: int, region_bytes: int, prefix: str, device=None):
        """``device``: where the data area lives, the CPU (None: here, in the file) or a GPU
        (``device_slab``: the file holds only the control words)."""
        self.rank, self.size, self.slots = rank, size, slots
        self.ctrl_bytes = -(-(size + slots * size * FINGERPRINT) * 8 // 4096) * 4096
        self.on_gpu = device is not None and torch.device(device).type == "cuda"
        self._size_regions(max(64, region_bytes // 64 * 64))  # regions stay 64-byte aligned for every dtype
        self.peers = [k for k in range(size) if k != rank]
        if rank == 0:
            token = prefix + secrets.token_hex(4)
            self.mm = self._open(token, create=True)   # regions halved where /dev/shm is short (a container's)
            try:
                store.set(f"{_KEY}/token", f"{token} {self.region}")
                store.wait([f"{_KEY}/attached/{k}" for k in range(1, size)])
            finally:  # every rank holds them now (or setup failed): no name stays behind
                self._unlink(token)
        else:
            token, region = store.get(f"{_KEY}/token").decode().split()
            self._size_regions(int(region))
            self.mm = self._open(token, create=False)
            store.set(f"{_KEY}/attached/{rank}", "1")
        self.ctrl = memoryview(self.mm)[: self.ctrl_bytes].cast("q")
        self.ctrl[rank] = os.getpid()
        if self.on_gpu:
            self.data = DeviceSlab(store, rank, slots * size * self.region, device)
            self._data = self.data.buffer
        else:
            self.data = HostSlab()
            self._data = torch.frombuffer(self.mm, dtype=torch.uint8)[self.ctrl_bytes:]
        self._views: dict = {}

    # ------------------------------------------------------------------ setup
    def _size_regions(self, region: int) -> None:
        self.region = region
        self.nbytes = self.ctrl_bytes + (0 if self.on_gpu else self.slots * self.size * region)

    def _bell_names(self, token: str):
        """(receiver, sender, name) of every doorbell: ``d`` deposited, ``f`` freed."""
        return [(r, k, f"/{token}{kind}{r}_{k}") for kind in "df"
                for r in range(self.size) for k in range(self.size) if r != k]

    def _open(self, token: str, create: bool):
        path = os.path.join(SHM_DIR, token + "m")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600) if create else os.open(path, os.O_RDWR)
        try:
            while create:  # zero-filled: every pid and fingerprint starts at 0
                try:
                    _reserve(fd, self.nbytes)
                    break
                except ShmError:  # no room: the same slots with half the region, down to MIN_REGION
                    if self.on_gpu or self.region < 2 * MIN_REGION:
                        raise
                    os.ftruncate(fd, 0)
                    self._size_regions(self.region // 128 * 64)
            # mapped with every page in place: else each rank's first touch of each page of the slab
            # faults, and a cluster's first collectives run up to three times slower
            mm = mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        # the bells this rank takes (its own row) and rings (the peers' rows with it as sender)
        bells = {(r, k, name[len(token) + 1]): _semaphore(name, create)
                 for r, k, name in self._bell_names(token) if create or self.rank in (r, k)}
        self.deposited_in = {k: bells[self.rank, k, "d"] for k in self.peers}   # take: k deposited
        self.freed_in = {k: bells[self.rank, k, "f"] for k in self.peers}       # take: k freed a slot
        self.deposited_out = [bells[k, self.rank, "d"] for k in self.peers]     # ring: I deposited
        self.freed_out = [bells[k, self.rank, "f"] for k in self.peers]         # ring: I freed a slot
        self._keep = bells  # rank 0 created them all: keep the handles until the others attached
        return mm

    def _unlink(self, token: str) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, token + "m"))
        except OSError:
            pass
        for _, _, name in self._bell_names(token):
            _sem_unlink(name)

    # ------------------------------------------------------------------ data
    def views(self, dtype: torch.dtype) -> torch.Tensor:
        """The slab as ``dtype``: a (S, N, R / itemsize) view, [slot, rank] one region."""
        v = self._views.get(dtype)
        if v is None:
            v = self._views[dtype] = self._data.view(dtype).view(self.slots, self.size, -1)
        return v

    def _fingerprint_at(self, slot: int, k: int) -> int:
        return self.size + (slot * self.size + k) * FINGERPRINT

    def stamp(self, slot: int, fingerprint: tuple[int, int, int]) -> None:
        """Write this rank's fingerprint of the piece it deposits in ``slot`` (``check`` reads it),
        and when (``time.perf_counter_ns``: the system's monotonic clock, the same in every process)."""
        at = self._fingerprint_at(slot, self.rank)
        self.ctrl[at], self.ctrl[at + 1], self.ctrl[at + 2] = fingerprint
        self.ctrl[at + 3] = time.perf_counter_ns()

    def deposited_at(self, slot: int) -> float:
        """Once every rank deposited the piece in ``slot``: when the last one did (perf_counter s)."""
        return max(self.ctrl[self._fingerprint_at(slot, k) + 3] for k in range(self.size)) * 1e-9

    def check(self, slot: int, what: str) -> None:
        """Once every rank deposited the piece in ``slot``: did they all issue the same collective?"""
        mine = self.ctrl[self._fingerprint_at(slot, self.rank):][:AGREED].tolist()
        for k in self.peers:
            theirs = self.ctrl[self._fingerprint_at(slot, k):][:AGREED].tolist()
            if theirs != mine:
                raise ShmError(f"{what}: ranks disagree on collective #{mine[0]}: rank {self.rank} issued "
                               f"(op {mine[1]}, {mine[2]} bytes), rank {k} issued #{theirs[0]} (op "
                               f"{theirs[1]}, {theirs[2]} bytes); every rank must issue the same "
                               "collectives in the same order")

    # ------------------------------------------------------------------ the doorbells
    @staticmethod
    def ring(bells) -> None:
        for bell in bells:
            bell.release()

    def take(self, bell, k: int, deadline: float | None, what: str, late: str) -> bool:
        """Take one ring of ``bell`` (rank k's). ``deadline`` None: only if it is there already.
        Else sleep for it until ``deadline`` (``time.monotonic()``): ``ShmError`` if rank k died
        or the deadline passed first (``late`` says what rank k has not done)."""
        if bell.acquire(False):
            return True
        if deadline is None:
            return False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ShmError(f"{what}: timed out: rank(s) [{k}] of this group {late} (rank {self.rank} "
                               "waited for it): they are stuck, busy, or issued other collectives")
            if bell.acquire(True, min(left, PEER_CHECK_S)):
                return True
            self._check_peers(what)

    def _check_peers(self, what: str) -> None:
        for k in self.peers:
            pid = self.ctrl[k]
            if pid and not alive(pid):
                raise ShmError(f"{what}: rank {k} of this group (pid {pid}) died; the collective cannot "
                               "complete")


def _reserve(fd: int, nbytes: int) -> None:
    """Give the slab its pages now: a tmpfs file only grown by ``ftruncate`` would kill the
    process with SIGBUS at the first page ``/dev/shm`` has no room for, mid-collective."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except AttributeError:  # no posix_fallocate (macOS): a plain size, as before
        os.ftruncate(fd, nbytes)
    except OSError as exc:
        raise ShmError(f"the shared-memory transport needs {nbytes / 2**20:.1f} MiB in {SHM_DIR} for this "
                       f"group and could not get it ({exc.strerror}); free some there (in a container: "
                       "docker run --shm-size=1g), or use ddpkit.Cluster(..., transport=\"gloo\")") from None
