"""A group's collectives, run one at a time in issue order: on the group's thread, or on the
thread that waits for one.

Every rank must run a group's collectives in the same order, so each group has one queue. Its
thread runs what was issued asynchronously (a bucket's all-reduce launched from a gradient hook
progresses while backward goes on). But many calls are waited for at once (``dist.all_reduce``
without ``async_op``: torch sets ``opts.asyncOp = False`` and calls ``wait()`` next), and
handing those to a thread and back costs two wake-ups and the GIL passed back and forth, more
than a small collective itself on a loaded 2-core machine. So ``Work.wait()`` runs the queue up
to its own collective in the waiting thread, unless the group's thread is already at it, and a
collective issued to be waited for at once does not even wake the thread. Whoever holds
``running`` runs the queue, always from its head, so the order holds. ``running`` is reentrant:
a future's callbacks run inside ``run`` when it completes, and one that issues a collective and
waits for it (a comm hook) must run it there, not wait for itself.
"""
from __future__ import annotations

import collections
import threading

import torch

from ddpkit.torch_internals import FutureWork


class Work(FutureWork):
    """A collective in flight: ``wait()`` runs the group's queue up to it if no thread is doing
    so, then blocks until it is done and raises its error."""

    def __init__(self, runner: Runner | None, future):
        super().__init__(future)
        self._runner = runner

    def wait(self, timeout=None):
        if self._runner is not None:
            self._runner.help(self._future)
        return super().wait(timeout)


def finished(value) -> Work:
    """A Work that is already done, with ``value``."""
    future = torch.futures.Future()
    future.set_result(value)
    return Work(None, future)


class Runner:
    """One group's queue of collectives and the thread that runs them when nobody waits."""

    def __init__(self, name: str):
        self.name = name
        self._pending: collections.deque = collections.deque()   # (run, future), in issue order
        self._lock = threading.Lock()        # guards _pending
        self._running = threading.RLock()     # held by whichever thread runs the queue now
        self._bell = threading.Semaphore(0)  # wakes the group's thread
        self._thread: threading.Thread | None = None

    def submit(self, run, waited: bool = False) -> Work:
        """Queue ``run(future)`` (it must complete the future) behind the earlier ones.
        ``waited``: the caller waits for it next (a synchronous call), so it runs then, there."""
        future = torch.futures.Future()
        with self._lock:
            self._pending.append((run, future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()
        if not waited:
            self._bell.release()
        return Work(self, future)

    def help(self, future) -> None:
        """From ``Work.wait()``: if nobody runs the queue, run it here up to ``future``."""
        if not future.done() and self._running.acquire(blocking=False):
            try:
                self._run(until=future)
            finally:
                self._release()

    def _serve(self) -> None:
        while True:
            self._bell.acquire()
            # Held by a waiter: it runs the queue, and rings again if it leaves work behind.
            if self._running.acquire(blocking=False):
                try:
                    self._run(until=None)
                finally:
                    self._release()

    def _run(self, until) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    return
                run, future = self._pending.popleft()
            run(future)
            if future is until:
                return

    def _release(self) -> None:
        self._running.release()
        with self._lock:
            left = bool(self._pending)
        if left:  # queued while we ran, after the thread gave up on the lock: its turn now
            self._bell.release()
