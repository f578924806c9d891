"""The emulated network: this rank's links, each a queue of collectives that complete on its clock.

A laptop's ranks talk over loopback, where moving a gradient costs almost nothing next to
computing it, so overlap, bucket sizes and hybrid sharding have nothing to show. The emulator
makes every collective take as long as it would on a chosen network (``ddpkit.Network``):

- the real collective runs first (the bytes really move, over loopback, on the real backend's
  own thread); then the emulated link carries it: it completes when the real one did (or, if the
  link is still busy, when the link frees up) plus what the link takes for the algorithm's bytes
  and latency (``Network.emulated_time``: ring all-reduce 2(N-1)/N S, all-gather and
  reduce-scatter (N-1)/N S, and (N-1) or 2(N-1) alphas). Collectives on one link therefore run
  one after another, in issue order, and every rank sees a collective end at about the same
  time (the real one ends together everywhere);
- waiting sleeps: the link's thread blocks in ``Work.wait`` and ``time.sleep``, never spinning,
  so backward keeps both CPU cores. An async collective launched from a gradient hook therefore
  overlaps backward exactly as it would on a real network.

Each link (the intra-node and the inter-node one) is one daemon thread with a FIFO queue. A
collective is handed over as the real ``Work`` and a ``torch.futures.Future``; the thread sets
the future's result (the real collective's result) at the emulated completion time, or its
exception if the real collective failed, so a timeout or a dead peer surfaces as usual.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass


@dataclass
class _Transfer:
    """One collective waiting on a link."""

    work: object            # the real collective's Work
    future: object          # completed at the emulated time (torch.futures.Future)
    link_s: float           # what the emulated link takes for it
    result: object          # the future's value if the Work has none (e.g. gloo's reduce-scatter)


class _Link:
    """One emulated link: its queue, its thread, and when it is next free."""

    def __init__(self, name: str):
        self.name = name
        self.free_s = 0.0
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=f"ddpkit-link-{name}", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            t = self.queue.get()
            try:
                t.work.wait()  # blocks in C++ without holding the GIL: the real bytes moved
                result = _value_of(t.work, t.result)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                t.future.set_exception(exc)
                continue
            done = max(time.perf_counter(), self.free_s) + t.link_s
            self.free_s = done
            delay = done - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            t.future.set_result(result)


def _value_of(work, fallback):
    """The real collective's result, as its own future would give it (a list of tensors)."""
    try:
        return work.get_future().value()
    except RuntimeError:  # "Work::getFuture not implemented" (gloo's reduce-scatter)
        return fallback


class Emulator:
    """This rank's emulated links (one per kind: intra-node, inter-node), started on first use."""

    def __init__(self):
        self.enabled = True     # off: collectives take what the real transport takes (calibration)
        self._links: dict[str, _Link] = {}
        self._lock = threading.Lock()

    def delays(self, link_s: float) -> bool:
        """Does a collective that takes ``link_s`` on its link need to wait on the emulator?"""
        return self.enabled and link_s > 0

    def submit(self, kind: str, work, link_s: float, result):
        """Queue a collective already launched on the real backend; returns a ``Future`` that
        completes at its emulated completion time."""
        import torch

        future = torch.futures.Future()
        self._link(kind).queue.put(_Transfer(work, future, link_s, result))
        return future

    def _link(self, kind: str) -> _Link:
        with self._lock:
            if kind not in self._links:
                self._links[kind] = _Link(kind)
            return self._links[kind]
