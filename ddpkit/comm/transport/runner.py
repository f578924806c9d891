"""A group's queue of pieces, and who moves it: the thread that issues, the one that waits, or the
group's own thread.

Every collective is a list of ``Piece``s (``shm`` cuts them), deposited and completed in issue
order on every rank, so one queue per group and two counters say how far it got:

    completed <= deposited <= issued,   deposited - completed <= S (a slot per piece in flight)

A piece is deposited once its slot is free and completed once every peer deposited it; both
usually happen where the collective is issued. What waits for a peer is moved on by
``Work.wait()`` (sleeping on the doorbells) or else by the group's thread, so a collective
launched from a hook progresses during backward. ``running`` (reentrant) is held by whoever moves
the queue; a future's callback may issue and wait (a comm hook), so every step re-reads the counters.
"""
from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from ddpkit.torch_internals import FutureWork
from ddpkit.comm.transport.segment import Segment, ShmError


@dataclass(eq=False)
class Piece:
    """One piece: what this rank deposits, reads once all have, and (the last) finishes and completes."""

    deposit: object                      # deposit(views): views is the slot as (N, R / itemsize)
    complete: object                     # complete(views)
    dtype: torch.dtype
    fingerprint: tuple[int, int, int]    # (collective number, op code, bytes): the same on every rank
    what: str                            # for errors: "shm all_reduce #12 (4096 bytes, rank 0 of 2)"
    finish: object = None                # the last piece's: run after it completes, then
    future: object = field(default=None)  # ... this completes with the collective's result
    result: object = None
    waited: bool = True                  # the last piece's: will somebody wait() for it (else the thread moves it)
    ready_s: float | None = None         # once completed: when the last rank deposited it (perf_counter s)
    inputs: object = None                # on a GPU slab: the event after what produced its inputs (device_slab)


class Work(FutureWork):
    """A collective in flight: ``wait()`` moves the queue up to it; ``ready_s``: when its bytes were in."""

    def __init__(self, runner: Runner | None, future, last: Piece | None = None, at_wait: bool = False):
        super().__init__(future)
        self._runner = runner
        self._last = last
        self.at_wait = at_wait  # moved only by whoever waits for it (the emulator asks: ddpkit.comm.emulator)

    @property
    def ready_s(self) -> float | None:
        return self._last.ready_s if self._last is not None else None

    def wait(self, timeout=None):
        if self._runner is not None:
            self._runner.help(self._future)
        return super().wait(timeout)

    def is_completed(self):
        """Done? Asking moves the queue as far as it goes without waiting (as MPI's test does)."""
        if self._runner is not None and not self._future.done():
            self._runner.poll()
        return self._future.done()


def finished(value) -> Work:
    """A Work that is already done, with ``value``."""
    future = torch.futures.Future()
    future.set_result(value)
    return Work(None, future)


class Runner:
    """One group's queue of pieces (see the module docstring)."""

    def __init__(self, segment: Segment, name: str, timeout_s: float, device=None):
        self.seg, self.name, self.timeout_s = segment, name, timeout_s
        self.device = device  # the rank's GPU, for the group's thread (None: the CPU)
        self._pieces: collections.deque = collections.deque()  # issued and not completed, in order
        self._issued = self._deposited = self._completed = 0
        self._heard = dict.fromkeys(segment.peers, 0)   # pieces each peer is known to have deposited
        self._freed = dict.fromkeys(segment.peers, 0)   # ... and to have completed
        self._lock = threading.Lock()                   # guards _pieces and _issued (issuers append)
        self._running = threading.RLock()               # held by whoever moves the queue
        self._bell: queue.SimpleQueue = queue.SimpleQueue()  # wakes the group's thread
        self._thread: threading.Thread | None = None
        self._unwaited = 0    # collectives in the queue that nobody promised to wait for: the thread's
        self._failed: ShmError | None = None

    # ------------------------------------------------------------------ issuing and waiting
    def submit(self, pieces: list, result, waited: bool, at_wait: bool = False) -> Work:
        """Queue a collective's pieces (the last completes the Work's future with ``result``) and move
        what can be, here, without waiting. ``waited``: the caller waits next; ``at_wait``: nothing
        moves until somebody waits (``comm.emulator``)."""
        future = torch.futures.Future()
        if self._failed is not None:
            future.set_exception(ShmError(f"{pieces[0].what}: this group failed earlier: {self._failed}"))
            return Work(None, future)
        last = pieces[-1]
        last.future, last.result, last.waited = future, result, waited or at_wait
        with self._lock:
            self._pieces.extend(pieces)
            self._issued += len(pieces)
            self._unwaited += not last.waited
        if at_wait:
            return Work(self, future, last, at_wait=True)
        if self._running.acquire(blocking=False):
            try:
                self._move(until=None, block=False)
            finally:
                self._running.release()
        if not waited and not future.done():
            self._wake_thread()
        return Work(self, future, last)

    def help(self, future) -> None:
        """From ``Work.wait()``: move the queue up to ``future`` once whoever moves it now lets go."""
        if not future.done():
            self._running.acquire()
            try:
                self._move(until=future, block=True)
            finally:
                self._release()

    def poll(self) -> None:
        """Move the queue as far as it goes without waiting, if nobody is moving it."""
        if self._running.acquire(blocking=False):
            try:
                self._move(until=None, block=False)
            finally:
                self._release()

    def _wake_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()
        self._bell.put(None)

    def _serve(self) -> None:
        from ddpkit.rankside import adopt_device

        adopt_device(self.device)  # its copies and the callbacks it runs: on the rank's GPU, not GPU 0
        while True:
            self._bell.get()
            self._running.acquire()  # a waiter holding it moves the queue up to its own collective, then lets go
            try:
                # up to the last collective nobody will wait for, not beyond: an at_wait one
                # behind it waits for its own waiter
                self._move(until=None, block=True, unwaited_only=True)
            finally:
                self._release()  # queued while we let go (its submitter found us running): again

    def _release(self) -> None:
        self._running.release()
        with self._lock:
            left = self._failed is None and self._unwaited > 0
        if left:  # left behind, and nobody will wait for it: the thread's turn now
            self._wake_thread()

    # ------------------------------------------------------------------ moving the queue
    def _move(self, until, block: bool, unwaited_only: bool = False) -> None:
        """Move pieces in order until ``until`` is done or nothing (``unwaited_only``: nothing unwaited)
        is left; ``block``: sleep for the peers, else stop at the first piece that needs them."""
        try:
            while (self._failed is None and (until is None or not until.done()) and self._completed < self._issued
                   and not (unwaited_only and self._unwaited == 0)):
                if not self._step(block):
                    return
        except BaseException as exc:  # noqa: BLE001 - the peers may now wait forever: fail the group
            self._fail(exc)
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt in a thread that waited: it stops the job as usual

    def _step(self, block: bool) -> bool:
        """One move: complete the oldest piece if all deposited it, else deposit the next if its slot is
        free; else with ``block`` sleep for what the queue needs, without it False."""
        seg = self.seg
        head_deposited = self._completed < self._deposited
        if head_deposited and self._hear(self._heard, seg.deposited_in, self._completed, False, ""):
            self._complete(self._pieces[0])
            return True
        if self._can_deposit():
            q = self._deposited
            if q < seg.slots or self._hear(self._freed, seg.freed_in, q - seg.slots, False, ""):
                self._deposit(self._pieces[q - self._completed])
                return True
        if not block:
            return False
        if head_deposited:
            self._hear(self._heard, seg.deposited_in, self._completed, True, "has not deposited it")
        else:
            self._hear(self._freed, seg.freed_in, self._deposited - seg.slots, True,
                       "has not completed the collective before it")
        return True

    def _can_deposit(self) -> bool:
        return self._deposited < self._issued and self._deposited - self._completed < self.seg.slots

    def _hear(self, counts: dict, bells: dict, q: int, block: bool, late: str) -> bool:
        """Has every peer rung ``bells`` for piece ``q``? ``block``: sleep for the rest (until the timeout)."""
        deadline = time.monotonic() + self.timeout_s if block else None
        what = self._pieces[0].what if self._pieces else self.name
        for k in self.seg.peers:
            while counts[k] <= q:
                if not self.seg.take(bells[k], k, deadline, what, late):
                    return False
                counts[k] += 1
        return True

    def _deposit(self, piece: Piece) -> None:
        slot = self._deposited % self.seg.slots
        views = self.seg.views(piece.dtype)[slot]
        self.seg.stamp(slot, piece.fingerprint)
        self.seg.data.before_deposit(piece.inputs)
        piece.deposit(views)
        self.seg.data.settle()  # on a GPU: the copy is done before the peers hear of it
        self._deposited += 1
        self.seg.ring(self.seg.deposited_out)

    def _complete(self, piece: Piece) -> None:
        slot = self._completed % self.seg.slots
        self.seg.check(slot, piece.what)
        if piece.future is not None:
            piece.ready_s = self.seg.deposited_at(slot)
        piece.complete(self.seg.views(piece.dtype)[slot])
        self.seg.data.settle()  # on a GPU: the slot is read (and the result written) before it is freed
        with self._lock:
            self._pieces.popleft()
            self._completed += 1
            self._unwaited -= piece.future is not None and not piece.waited
        self.seg.ring(self.seg.freed_out)
        if piece.future is not None:
            if piece.finish is not None:
                piece.finish()
                self.seg.data.settle()
            piece.future.set_result(piece.result)  # callbacks run here (they may issue more)

    def _fail(self, exc: BaseException) -> None:
        """The collective in progress fails with ``exc``, and every one queued or issued after it."""
        if self._failed is None:
            what = self._pieces[0].what if self._pieces else self.name
            self._failed = exc if isinstance(exc, ShmError) else ShmError(f"{what}: {type(exc).__name__}: {exc}")
        with self._lock:
            pieces, self._pieces = list(self._pieces), collections.deque()
        first = True
        for piece in pieces:
            if piece.future is not None and not piece.future.done():
                piece.future.set_exception(self._failed if first else ShmError(
                    f"{piece.what}: this group failed earlier: {self._failed}"))
                first = False
