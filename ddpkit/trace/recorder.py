"""The Recorder: each rank's hot path of appending tuples, resolved into Records when read.

Strategies talk to it through the seam (``seam.py``); ddpkit's process group calls
``collective`` for every collective it carries. Each call appends a tuple -- nothing else happens
on the hot path; tuples become ``Record``s (completion and CUDA event times, rank 0's clock) when
``.records`` is read, or a batch at a time by ``drain()`` (what a recorded Cluster run streams).

    rec = Recorder()                   # inside a rank; rank/world size from the process group
    rec.align_clocks()                 # optional: put every rank on rank 0's clock
    model = OverlappedDDP(module, recorder=rec)
    for i in range(3):
        rec.next_step()                # records carry the step index (None before step 0)
        train_step(model, opt, x, y, recorder=rec)
    return rec.trace()                 # picklable: a Cluster job can return it
"""
from __future__ import annotations

import time

from ddpkit import rankside
from ddpkit.trace.seam import Labels
from ddpkit.trace.clocks import CudaClock, align_clocks, cuda_event
from ddpkit.trace.records import Record, Trace

MEMORY_INTERVAL_NS = 250_000_000  # see Recorder.memory_due


class _Span:
    """The ``with recorder.span(...)`` context: two clock reads and one list append."""

    __slots__ = ("_rec", "_cat", "_name", "_fields", "_t0", "_ev0")

    def __init__(self, rec, cat, name, fields):
        self._rec, self._cat, self._name, self._fields = rec, cat, name, fields

    def __enter__(self):
        rec = self._rec
        self._ev0 = rec._cuda_event() if rec._cuda else None
        self._t0 = rec._clock()
        return self

    def __exit__(self, *exc):
        rec = self._rec
        t1 = rec._clock()
        ev1 = rec._cuda_event() if rec._cuda else None
        rec._raw.append(("span", self._cat, self._name, rec._step, self._t0, t1,
                         self._fields, self._ev0, ev1))
        return False


class Recorder:
    """Implements the recorder seam and keeps every call as a plain record (``.records``)."""

    enabled = True

    def __init__(self, rank: int | None = None, world_size: int | None = None, device=None,
                 clock=time.perf_counter_ns):
        import torch
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        self.world_size = world_size if world_size is not None else (
            dist.get_world_size() if initialized else 1)
        self.backend = (rankside.backend() or "none") if initialized else "none"
        # with its index: events must be on the rank's own GPU, whatever a thread's current device
        self.device = torch.device(device) if device is not None else rankside.device()
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.clock_offset_ns = 0   # this rank's clock minus rank 0's (align_clocks sets it)
        self.clock_rtt_ns = 0      # the bound on that estimate's error
        self._clock = clock
        self._step = None  # None until next_step(): construction broadcasts etc. ("setup")
        self._raw: list[tuple] = []
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            self._cuda_anchor = CudaClock(self.device, clock)
        self._resolved: list[Record] | None = None
        self._resolved_len = -1
        self._drained = 0      # raw records already handed out by drain()
        self.memory_interval_ns = MEMORY_INTERVAL_NS
        self._memory_due_at = None  # clock reading after which the next memory sample is due
        self._fresh = False    # next_step() was called and no train_step or forward has begun it yet
        self._loop_began = False  # train_step began this step and its forward has not run yet
        self.loop_spans = False
        self._watched = None  # works without a future, waited on by a thread (see _watch)

    def _watch(self, work, on_done) -> None:
        """Call ``on_done`` when ``work`` (without a future) finishes: a daemon thread waits in launch order."""
        if self._watched is None:
            import queue
            import threading

            self._watched = queue.SimpleQueue()

            def watch(q=self._watched, device=self.device):
                rankside.adopt_device(device)  # see adopt_device: not GPU 0's context
                while True:
                    work, callback = q.get()
                    try:
                        work.wait()
                    except Exception:  # noqa: BLE001 - the strategy's own wait() reports it
                        continue
                    callback()

            threading.Thread(target=watch, name="ddpkit-recorder-watch", daemon=True).start()
        self._watched.put((work, on_done))

    # --- the seam ------------------------------------------------------------------
    def span(self, name: str, cat: str = "compute", **fields):
        return _Span(self, cat, name, fields)

    def labels(self, **fields):
        """``with rec.labels(bucket=i): work = dist.all_reduce(...)``: record those with ``fields``."""
        return Labels(self, fields)

    def launch_mark(self):
        """(host ns, CUDA event on the current stream), taken *before* a launch: an event recorded
        after a synchronous NCCL op would fire after it (a span of 0)."""
        return self._clock(), (self._cuda_event() if self._cuda else None)

    def collective(self, name: str, work, nbytes: int, launched=None, **fields) -> None:
        """Note a collective launched just now; a callback notes its completion. gloo's future
        completes when the bytes have arrived; NCCL's right after launch, so on CUDA two events
        (at launch, and on the callback's stream, after the collective) give its GPU times."""
        t0, ev0 = launched if launched is not None else self.launch_mark()
        done = [None, None]  # [host ns at completion, CUDA event after the collective]
        if work is None:     # a synchronous call: it has finished (gloo), or is queued on this stream (NCCL)
            done[0] = t0
            if self._cuda:   # an event queued after the collective fires when the GPU has done it
                done[1] = self._cuda_event()
        else:
            clock, cuda, event = self._clock, self._cuda, self._cuda_event

            def on_done(fut):  # runs on gloo's thread (gloo) or inline (NCCL)
                if cuda:  # first: once done[0] is set, the record is complete (see drain)
                    done[1] = event()
                done[0] = clock()

            try:
                work.get_future().then(on_done)
            except RuntimeError:  # no future for this op (gloo's reduce-scatter): a thread waits
                self._watch(work, lambda: on_done(None))
        self._raw.append(("comm", name, self._step, t0, done, int(nbytes), fields, ev0))

    def grad_ready(self, param_name: str, **fields) -> None:
        # on CUDA the hook runs when the kernels are queued; the event marks when the GPU ran them
        ev = self._cuda_event() if self._cuda else None
        self._raw.append(("ready", param_name, self._step, self._clock(), fields, ev))

    def memory(self, **bytes_by_category: int) -> None:
        self._raw.append(("mem", self._step, self._clock(), bytes_by_category))

    def memory_due(self) -> bool:
        """Is it time for another memory sample (at most every ``memory_interval_ns``, 250 ms:
        measuring costs about a twentieth of the default MLP's step)?"""
        now = self._clock()
        if self._memory_due_at is not None and now < self._memory_due_at:
            return False
        self._memory_due_at = now + self.memory_interval_ns
        return True

    def loss(self, value) -> None:
        """This step's loss: a float or a 0-dim tensor (read only when resolved: no sync here)."""
        self._raw.append(("loss", self._step, self._clock(), value))

    # --- steps and clocks ------------------------------------------------------------
    def next_step(self) -> int:
        """Start the next training step (the first call makes it step 0); returns its index."""
        self._step = 0 if self._step is None else self._step + 1
        self._fresh = True
        self._loop_began = False
        self.loop_spans = False
        return self._step

    def begin_step(self) -> int:
        """What ``train_step`` calls first: start the next step, unless ``next_step()`` just did."""
        if not self._fresh:
            self.next_step()
        self._fresh = False
        self._loop_began = True  # the step's forward, through a wrapper, begins no other
        self.loop_spans = True   # ... and the loop times its forward and backward itself
        return self._step

    def begin_forward(self) -> int:
        """What a wrapper's training forward calls: start the next step, unless the loop began this
        one and no forward has run in it yet (as torch's DDP counts iterations by forwards)."""
        if self._fresh or self._loop_began:
            self._fresh = self._loop_began = False
        else:
            self.next_step()
            self._fresh = False
        return self._step

    @property
    def step(self) -> int | None:
        return self._step

    def align_clocks(self, group=None, rounds: int = 8) -> int:
        """Estimate (and return) this rank's clock offset in ns to rank 0 of ``group``; every rank calls it."""
        self.clock_offset_ns, self.clock_rtt_ns = align_clocks(self._clock, self.device, group, rounds)
        return self.clock_offset_ns

    # --- reading back ----------------------------------------------------------------
    def _cuda_event(self):
        return cuda_event(self.device)

    @property
    def records(self) -> list[Record]:
        """Every call so far as a ``Record`` (picklable plain data), in call order."""
        if self._resolved is not None and self._resolved_len == len(self._raw):
            return self._resolved
        if self._cuda:
            self._cuda_anchor.synchronize()
        raw = self._raw[:]  # other threads (autograd's, a collective's) may append meanwhile
        out = [self._resolve(r) for r in raw]
        # kept only once no collective awaits its completion callback (gloo's thread runs it late)
        if all(r.end_ns is not None for r in out if r.kind == "span"):
            self._resolved, self._resolved_len = out, len(raw)
        return out

    def drain(self, final: bool = False) -> list[Record]:
        """The records made since the last ``drain()``, resolved, in call order, up to the first
        still in flight; ``final=True``: everything left (unfinished: ``end_ns`` None)."""
        raw, i = self._raw, self._drained
        stop = len(raw)
        if not final:
            for j in range(i, stop):
                if not self._complete(raw[j]):
                    stop = j
                    break
        elif self._cuda:
            self._cuda_anchor.synchronize()
        self._drained = stop
        return [self._resolve(r) for r in raw[i:stop]]

    def _complete(self, raw) -> bool:
        """Can ``raw`` be resolved for good now (its collective done, its CUDA events reached)?"""
        kind = raw[0]
        if kind == "comm" and raw[4][0] is None:
            return False
        if not self._cuda:
            return True
        if kind == "span":
            events = raw[7:9]
        elif kind == "comm":
            events = (raw[7], raw[4][1])
        elif kind == "ready":
            events = raw[5:6]
        else:  # loss, memory: no event
            events = ()
        return all(ev is None or ev.query() for ev in events)

    def _resolve(self, raw) -> Record:
        """One raw tuple as a Record, on rank 0's clock."""
        off, rank, gpu = self.clock_offset_ns, self.rank, self._cuda
        kind = raw[0]
        if kind == "span":
            _, cat, name, step, t0, t1, fields, ev0, ev1 = raw
            clock = "host"
            if gpu:  # GPU time of the work launched inside the span
                t0, t1 = self._cuda_anchor.to_host_ns(ev0), self._cuda_anchor.to_host_ns(ev1)
                clock = "cuda"
            return Record("span", cat, name, rank, step, t0 - off, t1 - off, clock=clock, **_split_fields(fields))
        if kind == "comm":
            _, name, step, t0, done, nbytes, fields, ev0 = raw
            t1, clock = done[0], "host"
            if gpu and done[1] is not None:
                t0, t1 = self._cuda_anchor.to_host_ns(ev0), self._cuda_anchor.to_host_ns(done[1])
                clock = "cuda"
            return Record("span", "comm", name, rank, step, t0 - off, None if t1 is None else t1 - off,
                          nbytes=nbytes, clock=clock, **_split_fields(fields))
        if kind == "ready":
            _, name, step, t, fields, ev = raw
            clock = "host"
            if gpu:
                t, clock = self._cuda_anchor.to_host_ns(ev), "cuda"
            return Record("instant", "grad_ready", name, rank, step, t - off, clock=clock, **_split_fields(fields))
        if kind == "loss":
            _, step, t, value = raw
            return Record("counter", "loss", "loss", rank, step, t - off, args={"loss": float(value)})
        _, step, t, values = raw
        return Record("counter", "memory", "memory", rank, step, t - off, args=dict(values))

    def trace(self) -> Trace:
        """This rank's records as a Trace (merge the ranks' with ``Trace.merge``)."""
        return Trace(list(self.records), self.world_size, self.backend)

    def clear(self) -> None:
        """Forget every record (the step counter and clock offset are kept)."""
        self._raw = []
        self._resolved, self._resolved_len = None, -1
        self._drained = 0


def _split_fields(fields: dict) -> dict:
    """Record keyword arguments: bucket and unit have their own attributes, the rest -> args."""
    out = {k: fields[k] for k in ("bucket", "unit") if k in fields}
    out["args"] = {k: v for k, v in fields.items() if k not in ("bucket", "unit")}
    return out
