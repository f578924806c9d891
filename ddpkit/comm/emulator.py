"""The emulated network: this rank's links, each a queue of collectives that complete on its clock.

Why: on a laptop moving a gradient costs little next to computing it, so overlap, bucket sizes and
hybrid sharding have nothing to show. The emulator makes every collective take as long as it would
on a chosen network (``ddpkit.Network``).

How: each link (intra-node, inter-node) is a daemon thread with a FIFO queue. The real collective
runs while the link carries it for the group's ``Network.route`` time; it completes at
``max(real end, max(issue, link free) + link time)``, ``network.LinkClock``'s rule. Where the
transport is slower than the link, the real transfer decides: ``Emulator.fidelity`` counts how
often, and ``compare`` and the widget say so. Waiting sleeps, never spins: backward keeps the cores.

The network card, emulated (``Route.at_wait``): on the shared-memory transport nothing moves at the
issue; the rank moves the bytes when it waits (``EmulatedWork.wait``), or the link's thread does at
delivery once a future was handed out (torch's DDP, comm hooks). On a GPU the link's thread polls
the collective's end event and the caller does the real ``wait()`` (``docs/laptop_cluster.md``).
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from ddpkit.network import LinkClock
from ddpkit.torch_internals import FutureWork

POLL_S = 100e-6  # the link's thread looks at a CUDA collective this often (sleeping in between)


@dataclass
class _Transfer:
    """One collective waiting on a link."""

    work: object            # the real collective's Work
    future: object          # completed at the emulated time (torch.futures.Future)
    link_s: float           # what the emulated link takes for it
    result: object          # the future's value if the Work has none (e.g. gloo's reduce-scatter)
    on_gpu: bool = False    # a CUDA collective: wait for it by polling (see the module docstring)
    issued_s: float = 0.0   # perf_counter when it was issued: the link starts on it then (or when free)
    real_end: float | None = None  # perf_counter when the real collective completed, where it tells
    at_wait: bool = False   # the bytes move when the rank waits (see the docstring)
    on_futures: bool = False  # ... unless its future was handed out: then the link's thread moves them
    passed: bool = False    # the link's thread has delivered it (set under ``lock``)
    link_end: float = 0.0   # perf_counter when the link delivered it
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class _Link:
    """One emulated link: its queue, its thread, and its clock (when it is next free)."""

    def __init__(self, name: str, device=None):
        self.name, self.device = name, device  # device: the rank's GPU, for the thread (or None)
        self.clock = LinkClock()
        self.carried = 0         # collectives this link completed
        self.outran = 0          # ... of which the real transfer ended after the link's time
        self.transport_s = 0.0   # at_wait: time the rank spent moving the bytes when it waited
        self.lock = threading.Lock()  # carried/outran/transport_s are also counted by waiting threads
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=f"ddpkit-link-{name}", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        from ddpkit.rankside import adopt_device

        # the recorder's completion callbacks record CUDA events here: on the rank's GPU, on an idle
        # stream of this thread's own, so they fire at the emulated completion, not behind compute
        adopt_device(self.device)
        _sleep_precisely()
        if self.device is not None:
            import torch

            torch.cuda.set_stream(torch.cuda.Stream(self.device))
        while True:
            t = self.queue.get()
            # asleep until the link would have delivered, then the real collective (usually done by then)
            link_end = self.clock.delivers(t.issued_s, t.link_s)
            delay = link_end - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            with t.lock:
                t.passed, t.link_end = True, link_end
                moves_here = t.on_futures or not t.at_wait
            if not moves_here:  # delivered; the rank moves the bytes when it waits (EmulatedWork.wait)
                self.clock.complete(link_end)
                t.future.set_result(t.result)
                continue
            try:
                # the real transfer kept up unless it is still moving now, or it ended (or, ddpkit's
                # transport tells, its bytes were all there) after the link's time
                moving = not t.work.is_completed()
                ended = getattr(t.work, "ready_s", None) or t.real_end
                outran = moving or (ended is not None and ended > link_end)
                _wait_on_host(t.work, t.on_gpu)  # the real bytes moved
                result = _value_of(t.work, t.result)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                t.future.set_exception(exc)
                continue
            # the link is busy until the real transfer ended, where later (this thread's own lateness
            # does not count: the next collective's link time still counts from link_end)
            self.clock.complete(link_end, time.perf_counter() if moving else link_end)
            self.count(outran)
            t.future.set_result(result)

    def count(self, outran: bool, transport_s: float = 0.0) -> None:
        with self.lock:
            self.carried += 1
            self.outran += outran
            self.transport_s += transport_s


def _note_end(work, transfer: _Transfer) -> None:
    """Have the real collective's future stamp ``transfer.real_end`` (a Work without one stamps nothing)."""
    def stamp(_):
        transfer.real_end = time.perf_counter()

    try:
        work.get_future().add_done_callback(stamp)
    except (RuntimeError, AttributeError):  # "Work::getFuture not implemented"
        pass


def _sleep_precisely() -> None:
    """Let this thread's sleeps end when asked, not up to Linux's 50 µs "timer slack" late (prctl)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        pr_set_timerslack = 29  # <linux/prctl.h>
        ctypes.CDLL(None).prctl(pr_set_timerslack, 1000, 0, 0, 0)  # 1 µs, in nanoseconds
    except (OSError, AttributeError):
        pass


def _wait_on_host(work, on_gpu: bool) -> None:
    """Until the real collective has finished: gloo's ``wait`` (no GIL held); a CUDA one polled."""
    if not on_gpu:
        work.wait()
        return
    while not work.is_completed():  # done, or failed: the caller's real wait() raises the error
        time.sleep(POLL_S)


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

    def submit(self, kind: str, work, link_s: float, result, issued_s: float | None = None, at_wait: bool = False):
        """Queue a collective launched on the real backend (issued at ``issued_s``, else now): a ``Work``
        completing at its emulated time."""
        import torch

        issued = time.perf_counter() if issued_s is None else issued_s
        future = torch.futures.Future()
        device = _device_of(result)
        on_gpu = device is not None and device.type == "cuda"
        at_wait = at_wait and not on_gpu  # a CUDA collective's end is polled (see the docstring)
        transfer = _Transfer(work, future, link_s, result, on_gpu, issued, at_wait=at_wait)
        if not on_gpu:  # when did the real bytes arrive? (a CUDA future completes at launch: no use)
            _note_end(work, transfer)
        link = self._link(kind, device if on_gpu else None)
        link.queue.put(transfer)
        # a Work of ddpkit's own (the shared-memory transport's) may be waited for twice: whoever
        # waits finishes the real collective first, while the link's time runs, not after it
        ours = work if not on_gpu and isinstance(work, FutureWork) else None
        return EmulatedWork(future, work if on_gpu else None, ours, transfer if at_wait else None, link)

    def fidelity(self) -> dict[str, tuple[int, int]]:
        """``{link: (collectives carried, of which outran the link)}`` so far (an upper bound)."""
        with self._lock:
            links = list(self._links.items())
        return {kind: (link.carried, link.outran) for kind, link in links}

    def transport_s(self) -> float:
        """Seconds this rank spent moving ``at_wait`` collectives' bytes as it waited (a running total)."""
        with self._lock:
            links = list(self._links.values())
        return sum(link.transport_s for link in links)

    def _link(self, kind: str, device=None) -> _Link:
        with self._lock:
            if kind not in self._links:
                self._links[kind] = _Link(kind, device)
            return self._links[kind]


def _device_of(result):
    """The device of the first tensor in ``result`` (nested lists too), or None."""
    if isinstance(result, (list, tuple)):
        return next((d for d in map(_device_of, result) if d is not None), None)
    return getattr(result, "device", None)


class EmulatedWork(FutureWork):
    """A delayed collective: ``wait()`` sleeps to the emulated completion, then (CUDA, ``real``) waits
    in the caller's thread; ``first``: finished by the caller first; ``transfer``: ``at_wait``'s."""

    def __init__(self, future, real=None, first=None, transfer: _Transfer | None = None, link: _Link | None = None):
        super().__init__(future)
        self._real = real
        self._first = first
        self._transfer = transfer
        self._link = link

    def wait(self, timeout=None) -> bool:
        if self._first is not None:
            if self._transfer is not None:
                self._move_bytes()
            else:
                self._first.wait()  # the real bytes, moved while the link's time runs (or its error)
        super().wait(timeout)  # raises the real collective's error, if it failed
        if self._real is not None:
            self._real.wait()
        return True

    def _move_bytes(self) -> None:
        """``at_wait``: this rank moves the bytes now, counted as the transport's time (outran if longer)."""
        t = self._transfer
        start = time.perf_counter()
        self._first.wait()
        end = time.perf_counter()
        self._transfer = None  # counted once
        self._link.count(outran=end - max(start, t.issued_s) > t.link_s, transport_s=end - start)

    def get_future(self):
        t = self._transfer
        if t is not None:
            with t.lock:
                t.on_futures = True    # the link's thread moves the bytes (and counts them) before it
                delivered = t.passed   # completes the future, unless it has delivered already: then
            if delivered:              # they move here, now
                self._move_bytes()
            self._transfer = None
        return super().get_future()

    def observed(self) -> FutureWork:
        """A Work for the recorder to watch: done once delivered and moved, without moving anything itself."""
        if self._transfer is None or self._first is None:
            return self
        import torch

        both = torch.futures.collect_all([self._future, self._first.get_future()])
        return FutureWork(both)

    def is_completed(self):
        return self._future.done() and (self._first is None or self._first.get_future().done())


# Read in the parent from the ranks' ``fidelity`` counts (summed by ``run_strategy``, ``timed_rounds``)
OUTRAN_NOTE = 0.25  # outran_note speaks where at least this share of collectives outran the link


def outran_share(counts) -> float | None:
    """The share of ``[emulated collectives, of which outran the link]`` that outran (None off a network)."""
    if not counts or not counts[0]:
        return None
    return counts[1] / counts[0]


def outran_note(shares: dict, network: str | None = None) -> str:
    """The sentence (compare's and the widget's) where ``OUTRAN_NOTE`` of a run's collectives outran
    the link (``shares``: ``{label: outran_share}``); "" otherwise."""
    slow = [f"{label} {share:.0%}" for label, share in shares.items() if (share or 0) >= OUTRAN_NOTE]
    if not slow:
        return ""
    which = f"the network ({network})" if network else "the network"
    return ("network: the real transfer ended after the emulated link's time for a share of the "
            f"collectives ({', '.join(slow)}; this machine's transport, or a rank that came late): there "
            f"{which} is faster than this machine can emulate, and the times are this machine's, "
            "not the network's.")
