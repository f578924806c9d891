"""The recorder: plain records of what each rank did, merged into a Trace, exported for Perfetto.

Strategies talk to a recorder through four calls (see ``ddpkit/strategies/_common.py``):
``span``, ``collective``, ``grad_ready`` and ``memory``. ``Recorder`` implements them by
appending a tuple to a list -- nothing else happens on the hot path. Turning tuples into
``Record`` dataclasses (completion times, CUDA event times, the clock offset to rank 0) is
done later, when ``.records`` is read.

    rec = Recorder()                   # inside a rank; rank/world size from the process group
    rec.align_clocks()                 # optional: put every rank on rank 0's clock
    model = OverlappedDDP(module, recorder=rec)
    for i in range(3):
        rec.next_step()                # records carry the step index (None before step 0)
        train_step(model, opt, x, y, recorder=rec)
    return rec.trace()                 # picklable: a Cluster job can return it

    trace = Trace.merge(cluster.run(job))      # all ranks' records in one Trace
    trace.to_chrome_trace("trace.json")        # open in ui.perfetto.dev or chrome://tracing

Derived figures (bytes on the wire, collective counts, overlap, bucket fill order) are pure
functions of the records, at the bottom of this file.
"""
from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field


@dataclass
class Record:
    """One thing that happened on one rank; times in ns on rank 0's clock (after alignment)."""

    kind: str                # "span" (has an end), "instant" (grad ready), "counter" (memory)
    cat: str                 # "compute" | "comm" | "grad_ready" | "memory" (or a caller's own)
    name: str                # "forward", "all_reduce", a parameter name, "memory", ...
    rank: int
    step: int | None         # recorder.next_step() count from 0; None = before the first step
    start_ns: int
    end_ns: int | None = None    # spans only; None if a collective never reported completion
    nbytes: int = 0              # collectives: the FULL size S (see ring_bytes below)
    bucket: int | None = None    # DDP bucket index, for collectives and grad_ready
    unit: str | None = None      # FSDP unit name, for collectives
    args: dict = field(default_factory=dict)  # counters: bytes by category; else extra fields
    clock: str = "host"          # "host": time.perf_counter_ns; "cuda": CUDA events (GPU time)

    @property
    def dur_ns(self) -> int:
        return 0 if self.end_ns is None else self.end_ns - self.start_ns


# ----------------------------------------------------------------------------- recording
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
        self.backend = str(dist.get_backend()) if initialized else "none"
        if device is None:
            device = "cuda" if self.backend == "nccl" else "cpu"
        self.device = torch.device(device)
        self.clock_offset_ns = 0   # this rank's clock minus rank 0's (align_clocks sets it)
        self.clock_rtt_ns = 0      # the bound on that estimate's error
        self._clock = clock
        self._step = None  # None until next_step(): construction broadcasts etc. ("setup")
        self._raw: list[tuple] = []
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            self._cuda_anchor = _CudaClock(self.device, clock)
        self._resolved: list[Record] | None = None
        self._resolved_len = -1
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

            def watch(q=self._watched):
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

    def collective(self, name: str, work, nbytes: int, **fields) -> None:
        """Note an async collective launched just now; its completion is noted by a callback.

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
        t0 = self._clock()
        ev0 = self._cuda_event() if self._cuda else None
        done = [None, None]  # [host ns at completion, CUDA event after the collective]
        if work is None:     # a synchronous call: it has already finished
            done[0] = t0
        else:
            clock, cuda, event = self._clock, self._cuda, self._cuda_event

            def on_done(fut):  # runs on gloo's thread (gloo) or inline (NCCL)
                done[0] = clock()
                if cuda:
                    done[1] = event()

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

    # --- steps and clocks ------------------------------------------------------------
    def next_step(self) -> int:
        """Start the next training step (the first call makes it step 0); returns its index."""
        self._step = 0 if self._step is None else self._step + 1
        return self._step

    @property
    def step(self) -> int | None:
        return self._step

    def align_clocks(self, group=None, rounds: int = 8) -> int:
        """Estimate this rank's clock offset to rank 0 of ``group``; returns it in ns.

        Each round: a barrier, then every rank reads its clock (t_a), joins an all-gather,
        and reads it again (t_b). The all-gather ends on every rank at about the same real
        time: every rank's window [t_a, t_b] contains the moment the last rank entered (no
        one can leave before that). So the midpoints (t_a + t_b) / 2 are readings of one
        instant, each off by at most half its round trip. We keep the round whose slowest
        rank had the smallest round trip and take offset = my midpoint - rank 0's midpoint;
        its error is at most that round trip (``clock_rtt_ns``). Every rank must call it.
        """
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            self.clock_offset_ns = 0
            return 0
        n = dist.get_world_size(group)
        dev = self.device if str(dist.get_backend(group)) == "nccl" else torch.device("cpu")
        probe = torch.zeros(1, dtype=torch.int64, device=dev)
        out = [torch.zeros_like(probe) for _ in range(n)]
        mine = []  # (round trip, midpoint) per round
        for _ in range(rounds):
            dist.barrier(group=group)
            t_a = self._clock()
            dist.all_gather(out, probe, group=group)
            t_b = self._clock()
            mine.append((t_b - t_a, (t_a + t_b) // 2))
        # share every rank's rounds: (n, rounds, 2) int64
        local = torch.tensor(mine, dtype=torch.int64, device=dev)
        every = [torch.zeros_like(local) for _ in range(n)]
        dist.all_gather(every, local, group=group)
        every = torch.stack(every).cpu()
        best = int(every[:, :, 0].max(dim=0).values.argmin())
        me = dist.get_rank(group)
        self.clock_offset_ns = int(every[me, best, 1] - every[0, best, 1])
        self.clock_rtt_ns = int(every[:, best, 0].max())
        return self.clock_offset_ns

    # --- reading back ----------------------------------------------------------------
    def _cuda_event(self):
        """A timing event on this rank's device's current stream (also right from a callback
        thread whose current device is another GPU)."""
        import torch

        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    @property
    def records(self) -> list[Record]:
        """Every call so far as a ``Record`` (picklable plain data), in call order."""
        if self._resolved is not None and self._resolved_len == len(self._raw):
            return self._resolved
        if self._cuda:
            self._cuda_anchor.synchronize()
        off, rank, gpu = self.clock_offset_ns, self.rank, self._cuda
        out = []
        for raw in self._raw:
            kind = raw[0]
            if kind == "span":
                _, cat, name, step, t0, t1, fields, ev0, ev1 = raw
                clock = "host"
                if gpu:  # GPU time of the work launched inside the span
                    t0, t1 = self._cuda_anchor.to_host_ns(ev0), self._cuda_anchor.to_host_ns(ev1)
                    clock = "cuda"
                out.append(Record("span", cat, name, rank, step, t0 - off, t1 - off,
                                  clock=clock, **_split_fields(fields)))
            elif kind == "comm":
                _, name, step, t0, done, nbytes, fields, ev0 = raw
                t1, clock = done[0], "host"
                if gpu and done[1] is not None:
                    t0, t1 = self._cuda_anchor.to_host_ns(ev0), self._cuda_anchor.to_host_ns(done[1])
                    clock = "cuda"
                out.append(Record("span", "comm", name, rank, step, t0 - off,
                                  None if t1 is None else t1 - off, nbytes=nbytes,
                                  clock=clock, **_split_fields(fields)))
            elif kind == "ready":
                _, name, step, t, fields, ev = raw
                clock = "host"
                if gpu:
                    t, clock = self._cuda_anchor.to_host_ns(ev), "cuda"
                out.append(Record("instant", "grad_ready", name, rank, step, t - off,
                                  clock=clock, **_split_fields(fields)))
            else:
                _, step, t, values = raw
                out.append(Record("counter", "memory", "memory", rank, step, t - off,
                                  args=dict(values)))
        # Keep the result only if no collective is still waiting for its completion callback
        # (gloo runs it on its own thread, a moment after work.wait() may have returned).
        if all(r.end_ns is not None for r in out if r.kind == "span"):
            self._resolved, self._resolved_len = out, len(self._raw)
        return out

    def trace(self) -> "Trace":
        """This rank's records as a Trace (merge the ranks' with ``Trace.merge``)."""
        return Trace(list(self.records), self.world_size, self.backend)

    def clear(self) -> None:
        """Forget every record (the step counter and clock offset are kept)."""
        self._raw = []
        self._resolved, self._resolved_len = None, -1


def _split_fields(fields: dict) -> dict:
    """Record keyword arguments: bucket and unit have their own attributes, the rest -> args."""
    out = {k: fields[k] for k in ("bucket", "unit") if k in fields}
    out["args"] = {k: v for k, v in fields.items() if k not in ("bucket", "unit")}
    return out


class _CudaClock:
    """Converts CUDA event times to host ns: one (event, host time) anchor taken at start.

    ``event.elapsed_time(other)`` gives GPU milliseconds between two events; with an anchor
    event whose host time we know, any later event's GPU time maps onto the host clock.
    """

    def __init__(self, device, clock):
        import torch

        self.device = device
        with torch.cuda.device(device):
            torch.cuda.synchronize()
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
            torch.cuda.synchronize()  # the stream was idle: the anchor fired just now
            self.host_ns = clock()

    def synchronize(self):
        import torch

        torch.cuda.synchronize(self.device)

    def to_host_ns(self, ev) -> int:
        return self.host_ns + int(self.event.elapsed_time(ev) * 1e6)


# ----------------------------------------------------------------------------- a merged trace
@dataclass
class Trace:
    """Records of one or more ranks, with the run's world size and backend."""

    records: list[Record]
    world_size: int = 1
    backend: str = "gloo"

    @classmethod
    def merge(cls, parts, world_size: int | None = None, backend: str | None = None) -> "Trace":
        """One Trace from per-rank Traces or per-rank lists of Records (e.g. ``cluster.run``)."""
        if isinstance(parts, Trace):
            return parts
        records, sizes, backends = [], [], []
        for part in parts:
            if isinstance(part, Recorder):
                part = part.trace()
            if isinstance(part, Trace):
                records += part.records
                if part.world_size:  # a Recorder made without world_size leaves it None
                    sizes.append(part.world_size)
                backends.append(part.backend)
            else:
                records += list(part)
        ranks = {r.rank for r in records}
        ws = world_size or max(sizes + [max(ranks) + 1 if ranks else 1])
        return cls(records, ws, backend or (backends[0] if backends else "gloo"))

    @property
    def ranks(self) -> list[int]:
        return sorted({r.rank for r in self.records})

    @property
    def steps(self) -> list[int]:
        """Training step indices, in order: steps with a compute span (forward, backward, ...).

        Setup records are not a step, and neither is a step that holds only collectives or
        memory samples (e.g. an evaluation or state-dict gather after training, which a job
        puts in a step of its own); a trace without any compute span keeps every step.
        """
        stepped = {r.step for r in self.records if r.step is not None}
        trained = {r.step for r in self.records if r.step is not None and r.cat == "compute"}
        return sorted(trained or stepped)

    def select(self, rank=None, step=None, cat=None, kind=None, name=None) -> list[Record]:
        """Records matching every given field. ``step``: an index (negative counts from the
        last step, -1 = the last), or ``"setup"`` for records made before the first step."""
        want = None if step is None else (None if step == "setup" else self.resolve_step(step))
        return [r for r in self.records
                if (rank is None or r.rank == rank) and (step is None or r.step == want)
                and (cat is None or r.cat == cat) and (kind is None or r.kind == kind)
                and (name is None or r.name == name)]

    def resolve_step(self, step: int) -> int:
        """Python-style step index: -1 is the last training step, -2 the one before, ..."""
        steps = self.steps
        if step < 0:
            if -step > len(steps):
                raise IndexError(f"step {step}: the trace has {len(steps)} step(s)")
            return steps[step]
        if step not in steps:
            raise IndexError(f"step {step} is not in the trace; steps: {steps}")
        return step

    def to_chrome_trace(self, path=None) -> dict:
        return to_chrome_trace(self, path)


def as_trace(trace_or_records) -> Trace:
    """Accept a Trace, a Recorder, a list of Records, or a list of per-rank parts."""
    if isinstance(trace_or_records, Trace):
        return trace_or_records
    if isinstance(trace_or_records, Recorder):
        return trace_or_records.trace()
    items = list(trace_or_records)
    if items and all(isinstance(x, Record) for x in items):
        return Trace.merge([items])
    return Trace.merge(items)


# ----------------------------------------------------------------------------- Chrome trace
# Lanes become Chrome "threads" (tid) inside each rank's "process" (pid = rank).
LANES = {"compute": 0, "comm": 1, "buckets": 2}
_COMM_EXTRA_TID = 10  # overlapping collectives go to extra comm lanes 10, 11, ...


def to_chrome_trace(trace, path=None) -> dict:
    """Chrome trace JSON (``traceEvents``) for Perfetto / chrome://tracing; written if ``path``.

    pid = rank (named "rank N"); tid = lane: compute (forward/backward/sync/step), comm
    (each collective from launch to completion; collectives in flight at the same time are
    put on extra "comm 2", "comm 3" lanes, since Chrome's "X" events on one thread must
    nest), buckets (an instant per gradient becoming ready). Memory samples are "C"
    counters. Times are microseconds since the first record.
    """
    trace = as_trace(trace)
    t_zero = min((r.start_ns for r in trace.records), default=0)
    us = lambda ns: (ns - t_zero) / 1e3  # noqa: E731
    events: list[dict] = []
    for rank in trace.ranks:
        events.append(dict(ph="M", name="process_name", pid=rank, tid=0, args={"name": f"rank {rank}"}))
        events.append(dict(ph="M", name="process_sort_index", pid=rank, tid=0, args={"sort_index": rank}))
        for lane, tid in LANES.items():
            events.append(dict(ph="M", name="thread_name", pid=rank, tid=tid, args={"name": lane}))
            # the buckets lane goes last, so extra comm lanes ("comm 2", ...) sit under "comm"
            order = 100 if lane == "buckets" else tid
            events.append(dict(ph="M", name="thread_sort_index", pid=rank, tid=tid, args={"sort_index": order}))
        comm_lane_ends: list[int] = []  # end time of the last collective on each comm lane
        for r in sorted(trace.select(rank=rank), key=lambda r: r.start_ns):
            args = {"step": r.step, **_json_safe(r.args)}
            if r.kind == "span":
                if r.cat == "comm":
                    args.update(bytes=r.nbytes, bucket=r.bucket, unit=r.unit,
                                completed=r.end_ns is not None)
                    tid = _comm_tid(comm_lane_ends, r, events, rank)
                else:
                    tid = LANES.get(r.cat, LANES["compute"])
                end = r.end_ns if r.end_ns is not None else r.start_ns
                events.append(dict(ph="X", name=r.name, cat=r.cat, pid=rank, tid=tid,
                                   ts=us(r.start_ns), dur=(end - r.start_ns) / 1e3, args=args))
            elif r.kind == "instant":
                args.update(bucket=r.bucket)
                events.append(dict(ph="i", s="t", name=r.name, cat=r.cat, pid=rank,
                                   tid=LANES["buckets"], ts=us(r.start_ns), args=args))
            else:
                events.append(dict(ph="C", name=r.name, cat=r.cat, pid=rank, tid=0,
                                   ts=us(r.start_ns), args={k: int(v) for k, v in r.args.items()}))
    ranks = trace.ranks
    out = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        # as torch.profiler writes it (one rank per file there; a merged trace lists them all)
        "distributedInfo": {"backend": trace.backend, "rank": ranks[0] if ranks else 0,
                            "world_size": trace.world_size, "ranks": ranks},
    }
    if path is not None:
        with open(path, "w") as f:
            json.dump(out, f)
    return out


def _comm_tid(lane_ends: list, r: Record, events: list, rank: int) -> int:
    """The first comm lane free at r's launch (greedy interval colouring)."""
    end = r.end_ns if r.end_ns is not None else r.start_ns
    for i, last in enumerate(lane_ends):
        if last <= r.start_ns:
            lane_ends[i] = end
            return LANES["comm"] if i == 0 else _COMM_EXTRA_TID + i
    lane_ends.append(end)
    i = len(lane_ends) - 1
    if i == 0:
        return LANES["comm"]
    tid = _COMM_EXTRA_TID + i
    events.append(dict(ph="M", name="thread_name", pid=rank, tid=tid, args={"name": f"comm {i + 1}"}))
    events.append(dict(ph="M", name="thread_sort_index", pid=rank, tid=tid, args={"sort_index": 1 + i}))
    return tid


def _json_safe(d: dict) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v)) for k, v in d.items()}


# ----------------------------------------------------------------------------- derived figures
def _by_step(d: dict):
    """Items of a {step: ...} dict, setup (None) first, then steps in order."""
    return sorted(d.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0))


def ring_bytes(name: str, nbytes: int, world_size: int) -> float:
    """Bytes one rank sends for a collective of full size S = ``nbytes`` (ring algorithms).

    all-reduce 2(N-1)/N * S (a reduce-scatter then an all-gather); all-gather and
    reduce-scatter (N-1)/N * S; broadcast S (the root sends everything once, pipelined).
    """
    n = world_size
    if n <= 1:
        return 0.0
    if name == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if name in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * nbytes
    if name == "broadcast":
        return float(nbytes)
    raise ValueError(f"unknown collective {name!r}; known: all_reduce, all_gather, reduce_scatter, broadcast")


def comm_bytes_per_step(trace) -> dict[int, dict[int, float]]:
    """``{step: {rank: bytes sent by that rank}}`` by the ring formulas above (None = setup)."""
    trace = as_trace(trace)
    out: dict = defaultdict(lambda: defaultdict(float))
    for r in trace.records:
        if r.cat == "comm" and r.kind == "span":
            out[r.step][r.rank] += ring_bytes(r.name, r.nbytes, trace.world_size)
    return {s: dict(v) for s, v in _by_step(out)}


def collective_counts(trace) -> dict[int, dict[int, dict[str, int]]]:
    """``{step: {rank: {collective name: count}}}``."""
    trace = as_trace(trace)
    out: dict = defaultdict(lambda: defaultdict(Counter))
    for r in trace.records:
        if r.cat == "comm" and r.kind == "span":
            out[r.step][r.rank][r.name] += 1
    return {s: {rank: dict(c) for rank, c in v.items()} for s, v in _by_step(out)}


def collective_bytes(trace) -> dict[int, dict[int, int]]:
    """``{step: {rank: sum of full sizes S}}`` (what the strategy handed to collectives)."""
    trace = as_trace(trace)
    out: dict = defaultdict(lambda: defaultdict(int))
    for r in trace.records:
        if r.cat == "comm" and r.kind == "span":
            out[r.step][r.rank] += r.nbytes
    return {s: dict(v) for s, v in _by_step(out)}


def _union(intervals) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals) -> int:
    return sum(b - a for a, b in intervals)


def _intersect(xs, ys) -> list[tuple[int, int]]:
    """Intersection of two sorted, disjoint interval lists."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def overlap_intervals(records, rank: int, step: int, compute: str = "backward"):
    """(comm union, ``compute`` union, their intersection) for one rank and step, in ns.

    A backward span ends when ``loss.backward()`` returns, which for OverlappedDDP includes
    waiting for the last buckets (the wait runs in an end-of-backward callback). Waiting is
    not compute, so a backward span is cut at the last gradient that became ready inside it
    (the last ``grad_ready`` instant) when there are any: that is where autograd's work ended.
    """
    mine = [r for r in records if r.rank == rank and r.step == step]
    comm = _union((r.start_ns, r.end_ns) for r in mine
                  if r.kind == "span" and r.cat == "comm" and r.end_ns is not None)
    ready = [r.start_ns for r in mine if r.kind == "instant" and r.cat == "grad_ready"]
    busy = []
    for r in mine:
        if r.kind == "span" and r.cat == "compute" and r.name == compute and r.end_ns is not None:
            inside = [t for t in ready if r.start_ns <= t <= r.end_ns]
            busy.append((r.start_ns, max(inside) if inside and compute == "backward" else r.end_ns))
    busy = _union(busy)
    return comm, busy, _intersect(comm, busy)


def overlap_fraction(trace, rank: int | None = None, step: int | None = None,
                     compute: str = "backward") -> float:
    """Share of communication time hidden under backward compute (0 = none, 1 = all).

    Communication time is the union of every collective's launch -> completion interval
    (several may be in flight at once); hidden time is the part of it inside backward's
    compute (see ``overlap_intervals``). Over all ranks and training steps unless given.
    """
    trace = as_trace(trace)
    ranks = trace.ranks if rank is None else [rank]
    steps = trace.steps if step is None else [trace.resolve_step(step)]
    total = hidden = 0
    for rk in ranks:
        for s in steps:
            comm, _, both = overlap_intervals(trace.records, rk, s, compute)
            total += _length(comm)
            hidden += _length(both)
    return hidden / total if total else 0.0


def bucket_fill_order(trace, rank: int = 0, step: int = -1) -> list[tuple[str, int | None, int]]:
    """``[(parameter name, bucket, time ns)]`` in the order the gradients became ready."""
    trace = as_trace(trace)
    ready = trace.select(rank=rank, step=step, kind="instant", cat="grad_ready")
    return [(r.name, r.bucket, r.start_ns) for r in sorted(ready, key=lambda r: r.start_ns)]


def launch_order(trace, rank: int = 0, step: int = -1, name: str | None = None) -> list[Record]:
    """This rank's collectives in one step, in launch order."""
    trace = as_trace(trace)
    comm = trace.select(rank=rank, step=step, kind="span", cat="comm", name=name)
    return sorted(comm, key=lambda r: r.start_ns)


__all__ = [
    "Record", "Recorder", "Trace", "as_trace", "to_chrome_trace", "ring_bytes",
    "comm_bytes_per_step", "collective_counts", "collective_bytes", "overlap_fraction",
    "overlap_intervals", "bucket_fill_order", "launch_order", "LANES",
]
