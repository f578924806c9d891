"""One group's shared memory: a slab every rank maps, and doorbells between every pair of ranks.

The slab (N ranks, S slots, R bytes per region), one file mapped by every rank:

    [control: N pids, then S slots x N ranks x 4 int64: a fingerprint and when] [data: S slots x N regions of R]

A collective moves in *pieces* of at most R bytes per rank, piece q in slot q % S: each rank
*deposits* its part into its own region, and *completes* the piece by reading the others' once
they deposited. No barrier: the last rank to arrive completes at once, in the issuing thread.

The doorbells are named POSIX semaphores per ordered pair of ranks: ``deposited[k]`` (rank k
deposited one more piece) and ``freed[k]`` (rank k completed one, its slot reusable). Pieces go
in order, so the m-th ring is the m-th piece; post/wait order memory (ARM too); a waiting rank
sleeps in the kernel, leaving the cores to backward. For CUDA IPC the data area is on the GPU
(``device_slab``) and the file holds the control words only.

Life cycle: group rank 0 creates the slab and semaphores under ``prefix``, the others attach, then
rank 0 unlinks the names, so the memory lives exactly as long as the processes; names left by a
rank that died before the unlink are removed with ``unlink_segments(prefix)``.
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
    """A named POSIX semaphore (value 0), created or opened: CPython's underscored
    ``_multiprocessing.SemLock``, which waits without the GIL and can be shared by name."""
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
    """Remove the slabs and semaphores (glibc's ``sem.NAME``) groups under ``prefix`` left in
    ``/dev/shm`` (ranks that died during setup); returns how many."""
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
        """``device``: the data area on the CPU (None: in the file) or a GPU (``device_slab``)."""
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
            # every page mapped now: first touches would slow a cluster's first collectives up to 3x
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
        """Write this rank's fingerprint of the piece it deposits in ``slot``, and when (``perf_counter_ns``)."""
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
        """Take one ring of rank k's ``bell``: if there (``deadline`` None), else sleeping until
        ``deadline`` (monotonic); ``ShmError`` (saying ``late``) if k died or time ran out."""
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
    """Give the slab its pages now: a tmpfs file grown by ``ftruncate`` would SIGBUS mid-collective."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except AttributeError:  # no posix_fallocate (macOS): a plain size, as before
        os.ftruncate(fd, nbytes)
    except OSError as exc:
        raise ShmError(f"the shared-memory transport needs {nbytes / 2**20:.1f} MiB in {SHM_DIR} for this "
                       f"group and could not get it ({exc.strerror}); free some there (in a container: "
                       "docker run --shm-size=1g), or use ddpkit.Cluster(..., transport=\"gloo\")") from None
