"""A recorded Cluster run: each rank records into its own Recorder and streams the records to
the notebook while the job goes; the notebook merges them into one Trace.

Rank side, ``run_recorded``: a fresh ``Recorder`` (clock aligned to rank 0's) is the rank's recorder
while ``fn`` runs; a daemon thread drains it every ``interval_s`` into one "records" event, the
last (``final=True``) before the job's result. Notebook side, ``Collector``: a cluster observer
that keeps each batch's records, in arrival order, until ``trace()``.
"""
from __future__ import annotations

import threading

from ddpkit.trace.records import Record, Trace

INTERVAL_S = 0.25  # a rank sends at most ~4 record batches per second


# ----------------------------------------------------------------------------- rank side
class Streamer:
    """A daemon thread that sends ``rec.drain()`` every ``interval_s`` through ``send``."""

    def __init__(self, rec, send, interval_s: float = INTERVAL_S):
        self.rec, self.send, self.interval_s = rec, send, interval_s
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one drain at a time: the thread's, or the final one
        self._thread = threading.Thread(target=self._loop, name="ddpkit-stream", daemon=True)
        self.error: Exception | None = None  # what stopped the thread early, if anything did

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.flush(final=True)
        if self.error is not None and exc[0] is None:  # not silently: the live view stopped
            raise RuntimeError(f"streaming this rank's records stopped early: {self.error!r}") from self.error
        return False

    def _loop(self) -> None:
        from ddpkit.rankside import adopt_device

        # drain() asks CUDA events whether the GPU has reached them: on the rank's GPU, not GPU 0
        adopt_device(getattr(self.rec, "device", None))
        while not self._stop.wait(self.interval_s):
            try:
                self.flush()
            except Exception as err:  # the channel is gone (the parent died, the job will find
                self.error = err      # out), or a record could not be resolved: said at the end
                return

    def flush(self, final: bool = False) -> None:
        with self._lock:
            batch = self.rec.drain(final=final)
            if batch or final:
                self.send(records=batch, final=final)


def run_recorded(fn, args, kwargs, send, interval_s: float = INTERVAL_S):
    """A Cluster job: ``fn(*args, **kwargs)`` recorded, each batch sent as ``send(records=..., final=...)``."""
    from ddpkit.trace.recorder import Recorder
    from ddpkit.trace.seam import recording

    rec = Recorder()
    rec.align_clocks()  # every rank on rank 0's clock, so the merged timeline lines up
    with Streamer(rec, send, interval_s), recording(rec):
        return fn(*args, **kwargs)


# ----------------------------------------------------------------------------- notebook side
class Collector:
    """A cluster observer keeping the records streamed during one recorded run."""

    def __init__(self, world_size: int, backend: str):
        self.world_size, self.backend = world_size, backend
        self.records: list[Record] = []
        self.finished: set[int] = set()  # ranks whose last batch arrived

    def __call__(self, kind: str, rank, **fields) -> None:
        if kind != "records":
            return
        self.records.extend(fields["records"])
        if fields.get("final"):
            self.finished.add(rank)

    def trace(self) -> Trace:
        return Trace(self.records, self.world_size, self.backend)
