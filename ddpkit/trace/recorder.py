"""The Recorder: each rank's hot path of appending tuples, resolved into Records when read.

Strategies talk to a recorder through the seam (``ddpkit/trace/seam.py``): ``span``,
``labels`` (around the collectives they issue), ``grad_ready``, ``memory`` and ``begin_forward``
(a training forward through a wrapper begins a step, unless the loop began it); the training step
adds ``loss`` and ``begin_step``. ddpkit's process group, the one writer of collective records,
calls ``collective`` for every collective it carries, with the labels of the ``labels()`` block
it was issued in. ``Recorder`` implements them by appending a tuple to a list -- nothing else
happens on the hot path. Turning tuples into ``Record`` dataclasses (completion times, CUDA
event times, the clock offset to rank 0) is done later, when ``.records`` is read, or a batch
at a time by ``drain()`` (what a recorded Cluster run streams to the notebook while it goes).
That is the one change of form a record makes on its way to the notebook: the Record made here
is the one the notebook's trace and widget hold (``Record`` pickles compactly, see records.py).

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
        # always with its index: events and the clock anchor must be on the rank's own GPU, also
        # when made on a thread whose current device is another one (every new thread's is 0)
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
        # train_step times the step's forward and backward itself; in a loop of its own (a user's
        # script) the wrappers do (``strategies.common.forward_timed``)
        self.loop_spans = False
        self._watched = None  # works without a future, waited on by a thread (see _watch)

    def _watch(self, work, on_done) -> None:
        """Call ``on_done`` when ``work`` finishes, for collectives whose Work has no future.

        One daemon thread per recorder waits on them in launch order (a backend runs a group's
        collectives in that order). ``wait`` blocks without spinning, so watching costs no CPU;
        a collective that fails is the strategy's to report, so the watcher just moves on.
        """
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
        """``with rec.labels(bucket=i): work = dist.all_reduce(...)``: the collectives this thread
        issues inside the block are recorded into this recorder with ``fields`` (bucket, unit,
        ...) by ddpkit's process group, their one writer (``seam.Labels``)."""
        return Labels(self, fields)

    def launch_mark(self):
        """The start of a collective about to be launched: (host ns, CUDA event on the current
        stream). ddpkit's process group takes it *before* launching, and passes it as
        ``collective(..., launched=mark)``: a synchronous NCCL op runs on the current stream,
        so an event recorded after the launch would fire after the collective (a span of 0)."""
        return self._clock(), (self._cuda_event() if self._cuda else None)

    def collective(self, name: str, work, nbytes: int, launched=None, **fields) -> None:
        """Note an async collective launched just now; its completion is noted by a callback.
        ddpkit's process group calls this for every collective it carries (``fields``: the
        strategy's labels, the link and the group; ``launched``: the ``launch_mark()`` it took
        before launching, else the start is now).

        What "completion" means depends on the backend:
        - gloo: the future completes when the collective has finished on gloo's own worker
          thread, so the callback's host time is when the bytes had all arrived.
        - NCCL: ``work.get_future()`` completes once NCCL's stream has been made to wait for
          the collective -- right after launch, *not* when the GPU has finished it (torch's
          docs for ``Work.get_future``). The host time is then meaningless, so on CUDA we
          also record CUDA events: one on the current stream at launch, one on the stream the
          callback runs on (which is synchronised with NCCL's stream, so it fires after the
          collective ends). Their GPU times are resolved lazily in ``.records``.
        """
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
        # On CUDA the hook runs when autograd *queued* the gradient's kernels; an event on
        # the current stream marks when the GPU actually produced it.
        ev = self._cuda_event() if self._cuda else None
        self._raw.append(("ready", param_name, self._step, self._clock(), fields, ev))

    def memory(self, **bytes_by_category: int) -> None:
        self._raw.append(("mem", self._step, self._clock(), bytes_by_category))

    def memory_due(self) -> bool:
        """Is it time for another memory sample? ``train_step`` asks once a step: measuring memory
        (walking every parameter, optimizer state and saved activation) costs about as much as
        a twentieth of the default MLP's step, so samples are taken at most every
        ``memory_interval_ns`` (250 ms: every step of a slow model, every tenth of a fast one)."""
        now = self._clock()
        if self._memory_due_at is not None and now < self._memory_due_at:
            return False
        self._memory_due_at = now + self.memory_interval_ns
        return True

    def loss(self, value) -> None:
        """This step's loss on this rank: a float or a 0-dim tensor (read only when resolved,
        so a GPU tensor costs no synchronisation here)."""
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
        """What ``train_step`` calls first: start the next step, unless the caller has just
        started one with ``next_step()`` (jobs written before recording was a switch do)."""
        if not self._fresh:
            self.next_step()
        self._fresh = False
        self._loop_began = True  # the step's forward, through a wrapper, begins no other
        self.loop_spans = True   # ... and the loop times its forward and backward itself
        return self._step

    def begin_forward(self) -> int:
        """What a wrapper's training forward calls (every ddpkit wrapper, and torch's as the kit
        builds them): start the next step, unless the loop began this one and no forward has run
        in it yet (``train_step``, or ``next_step()`` by hand). So any loop gets numbered steps,
        as torch's DDP counts its iterations by forward calls (each micro-batch under
        ``no_sync()`` is one)."""
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
        """Estimate this rank's clock offset to rank 0 of ``group`` (``clocks.align_clocks``; its
        error bound goes to ``clock_rtt_ns``); returns it in ns. Every rank must call it."""
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
        # Keep the result only if no collective is still waiting for its completion callback
        # (gloo runs it on its own thread, a moment after work.wait() may have returned).
        if all(r.end_ns is not None for r in out if r.kind == "span"):
            self._resolved, self._resolved_len = out, len(raw)
        return out

    def drain(self, final: bool = False) -> list[Record]:
        """The records made since the last ``drain()``, resolved; each is handed out once.

        A collective still in flight (or, on CUDA, an event the GPU has not reached) stops the
        batch just before it, so its completion time is known when it is handed out: records
        leave in call order, a step at most late. ``final=True`` hands out everything left
        (a collective that never completed has ``end_ns`` None, as in ``.records``).
        """
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
