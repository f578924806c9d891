"""The recorder, the Chrome trace export, and the figures derived from records."""
from __future__ import annotations

import json
import pickle
import time

import pytest
import torch

from ddpkit.network import ring_bytes
from ddpkit.trace import (
    LANES, Record, Recorder, Trace, bucket_fill_order, collective_bytes, collective_counts,
    comm_bytes_per_step, launch_order, overlap_fraction, to_chrome_trace,
)


class FakeWork:
    """A stand-in for a c10d Work: its future completes when the test says so."""

    def __init__(self):
        self.future = torch.futures.Future()

    def get_future(self):
        return self.future


class FakeClock:
    """A clock the test advances by hand, so times in records are exact."""

    def __init__(self, t=1_000):
        self.t = t

    def __call__(self):
        return self.t


def span(rank, step, name, start, end, cat="compute", **kw):
    return Record("span", cat, name, rank, step, start, end, **kw)


def comm(rank, step, name, start, end, nbytes, bucket=None, unit=None):
    return Record("span", "comm", name, rank, step, start, end, nbytes=nbytes, bucket=bucket, unit=unit)


# ----------------------------------------------------------------------------- the recorder
def test_recorder_keeps_every_seam_call_as_a_record():
    clock = FakeClock()
    rec = Recorder(rank=3, world_size=4, clock=clock)
    assert rec.enabled and (rec.rank, rec.world_size) == (3, 4)
    with rec.span("broadcast_setup", cat="compute"):
        clock.t += 5
    assert rec.next_step() == 0
    clock.t = 2_000
    with rec.span("backward"):
        clock.t = 2_100
        work = FakeWork()
        rec.collective("all_reduce", work, nbytes=4096, bucket=1, extra="x")
        clock.t = 2_150
        rec.grad_ready("layers.0.weight", bucket=1)
        clock.t = 2_300
        work.future.set_result(None)  # completion: the callback reads the clock now
        clock.t = 2_400
    rec.collective("broadcast", None, nbytes=8)  # synchronous: completed at launch
    rec.collective("all_gather", FakeWork(), nbytes=16, unit="layers")  # never completes
    rec.memory(parameters=100, gradients=50)
    setup, ar, ready, backward, bc, ag, mem = rec.records

    assert (setup.step, setup.start_ns, setup.end_ns) == (None, 1_000, 1_005)
    assert (ar.kind, ar.cat, ar.name, ar.rank, ar.step) == ("span", "comm", "all_reduce", 3, 0)
    assert (ar.start_ns, ar.end_ns, ar.nbytes, ar.bucket, ar.args) == (2_100, 2_300, 4096, 1, {"extra": "x"})
    assert (ready.kind, ready.name, ready.bucket, ready.start_ns) == ("instant", "layers.0.weight", 1, 2_150)
    assert (backward.start_ns, backward.end_ns) == (2_000, 2_400)
    assert bc.end_ns == bc.start_ns == 2_400
    assert ag.end_ns is None and ag.unit == "layers"
    assert (mem.kind, mem.cat, mem.args) == ("counter", "memory", {"parameters": 100, "gradients": 50})


class FakeEvent:
    """A CUDA event stand-in: its GPU time is the fake clock's reading when it was recorded."""

    def __init__(self, t):
        self.t = t

    def query(self):
        return True


class FakeAnchor:
    def synchronize(self):
        pass

    def to_host_ns(self, ev):
        return ev.t + 7  # the GPU's time, on the host clock


def cuda_recorder(clock):
    """A Recorder that takes the CUDA path (events, the anchor) with fakes, on a CPU machine:
    what a rank on NCCL records, checked without a GPU."""
    rec = Recorder(rank=0, world_size=1, clock=clock)
    rec._cuda, rec._cuda_anchor = True, FakeAnchor()
    rec._cuda_event = lambda: FakeEvent(clock.t)
    return rec


def test_on_cuda_a_synchronous_collective_is_timed_by_events_queued_around_it():
    # NCCL's synchronous collectives hand back no Work (torch 2.11, one H200): the collective
    # is queued on the current stream, so an event queued right after it fires when it is done
    clock = FakeClock(1_000)
    rec = cuda_recorder(clock)
    mark = rec.launch_mark()
    clock.t = 1_500
    rec.collective("broadcast", None, nbytes=8, launched=mark)
    (bc,) = rec.records
    assert (bc.clock, bc.start_ns, bc.end_ns) == ("cuda", 1_007, 1_507)


def test_on_cuda_every_kind_of_record_streams():
    # drain() on CUDA asks each record's events whether the GPU reached them; a loss, a memory
    # sample, a span, a gradient-ready and a collective must all pass (a span once failed it)
    clock = FakeClock(1_000)
    rec = cuda_recorder(clock)
    rec.next_step()
    with rec.span("backward"):
        clock.t += 10
        rec.grad_ready("w")
        rec.collective("all_reduce", None, nbytes=4)
    rec.loss(0.5)
    rec.memory(parameters=1)
    batch = rec.drain()
    assert [(r.kind, r.name) for r in batch] == [("instant", "w"), ("span", "all_reduce"), ("span", "backward"),
                                                 ("counter", "loss"), ("counter", "memory")]
    assert {r.clock for r in batch if r.kind != "counter"} == {"cuda"}


def test_records_are_picklable_and_merge_into_one_trace():
    parts = []
    for rank in range(2):
        rec = Recorder(rank=rank, world_size=2)
        rec.next_step()
        with rec.span("forward"):
            pass
        parts.append(pickle.loads(pickle.dumps(rec.trace())))
    trace = Trace.merge(parts)
    assert trace.ranks == [0, 1] and trace.world_size == 2 and trace.steps == [0]
    assert {r.rank for r in trace.select(name="forward")} == {0, 1}
    # plain lists of records merge too
    assert Trace.merge([p.records for p in parts]).ranks == [0, 1]


def test_steps_and_setup_records():
    rec = Recorder(rank=0, world_size=1)
    with rec.span("construct"):
        pass
    for _ in range(3):
        rec.next_step()
        with rec.span("forward"):
            pass
    trace = rec.trace()
    assert trace.steps == [0, 1, 2] and rec.step == 2
    assert [r.name for r in trace.select(step="setup")] == ["construct"]
    assert [r.step for r in trace.select(step=-1)] == [2]   # -1: the last step
    assert [r.step for r in trace.select(step=-3)] == [0]
    with pytest.raises(IndexError):
        trace.select(step=-4)


def test_begin_step_starts_a_step_unless_next_step_just_did():
    rec = Recorder(rank=0, world_size=1)
    assert [rec.begin_step() for _ in range(3)] == [0, 1, 2]  # train_step alone: a step each
    rec.next_step()                                            # a job that marks its own steps
    assert rec.begin_step() == 3 and rec.begin_step() == 4
    rec.next_step()
    rec.next_step()                                            # twice: an empty step 5 is skipped
    assert rec.begin_step() == 6


def test_memory_samples_are_due_at_most_every_interval():
    clock = FakeClock(0)
    rec = Recorder(rank=0, world_size=1, clock=clock)
    rec.memory_interval_ns = 100
    due = []
    for t in range(0, 350, 25):  # a step every 25 ns: every fourth one samples
        clock.t = t
        due.append(rec.memory_due())
    assert [t for t, d in zip(range(0, 350, 25), due, strict=True) if d] == [0, 100, 200, 300]


def test_the_loss_is_a_counter_read_when_resolved():
    rec = Recorder(rank=1, world_size=2, clock=FakeClock(7))
    rec.next_step()
    rec.loss(torch.tensor(2.5))
    (r,) = rec.records
    assert (r.kind, r.cat, r.step, r.start_ns, r.args) == ("counter", "loss", 0, 7, {"loss": 2.5})


def test_drain_hands_out_each_record_once_holding_back_a_collective_in_flight():
    clock = FakeClock()
    rec = Recorder(rank=0, world_size=2, clock=clock)
    rec.next_step()
    with rec.span("forward"):
        clock.t += 10
    assert [r.name for r in rec.drain()] == ["forward"]
    assert rec.drain() == []
    work = FakeWork()
    rec.collective("all_reduce", work, nbytes=8, bucket=0)
    rec.grad_ready("w", bucket=0)
    assert rec.drain() == []  # the collective has no end yet: it and what follows wait
    clock.t += 5
    work.future.set_result(None)
    out = rec.drain()
    assert [r.name for r in out] == ["all_reduce", "w"] and out[0].end_ns == clock.t
    rec.collective("all_gather", FakeWork(), nbytes=8)  # never completes
    rec.memory(parameters=1)
    assert rec.drain() == []
    last = rec.drain(final=True)  # the end of the job: everything, unfinished or not
    assert [r.name for r in last] == ["all_gather", "memory"] and last[0].end_ns is None
    assert len(rec.records) == 5  # .records still has every call


def test_a_streamer_sends_batches_at_its_rate_never_one_message_per_record():
    from ddpkit.trace.live import Collector, Streamer

    rec = Recorder(rank=1, world_size=2)
    sent = []
    t0 = time.monotonic()
    # as on the job channel: each batch pickled on the rank, unpickled in the notebook
    with Streamer(rec, lambda **batch: sent.append(pickle.loads(pickle.dumps(batch))), interval_s=0.05):
        rec.next_step()
        for i in range(20_000):
            rec.grad_ready(f"p{i}", bucket=i % 3)
            if i % 4000 == 0:
                time.sleep(0.06)
    assert sent[-1]["final"] and not any(b["final"] for b in sent[:-1])
    assert 2 <= len(sent) <= (time.monotonic() - t0) / 0.05 + 2  # one batch per interval, plus the last
    names = [r.name for b in sent for r in b["records"]]
    assert names == [f"p{i}" for i in range(20_000)]  # all of them, in order, once
    collector = Collector(2, "gloo")
    for b in sent:
        collector("records", 1, **b)
    assert collector.finished == {1} and collector.trace().records == rec.records  # the Records, as made
    assert collector.trace().records[0] is sent[0]["records"][0]  # kept as they arrived: no copy


def test_align_clocks_finds_a_skewed_clock(cluster_of):
    skew = 5_000_000_000  # rank 1's clock runs 5 s ahead

    def job():
        import time

        import torch.distributed as dist

        from ddpkit.trace import Recorder

        rank = dist.get_rank()
        clock = (lambda: time.perf_counter_ns() + skew) if rank == 1 else time.perf_counter_ns
        rec = Recorder(clock=clock)
        offset = rec.align_clocks()
        rec.next_step()
        dist.barrier()
        rec.grad_ready("after_barrier")
        return offset, rec.clock_rtt_ns, rec.records[-1].start_ns

    (off0, rtt, t0), (off1, _, t1) = cluster_of(2).run(job)
    assert off0 == 0
    # Both ranks' windows [t_a, t_b] of the chosen round contain the moment the last rank
    # entered the all-gather, so the error is at most the largest round trip.
    assert abs(off1 - skew) <= rtt + 1_000, (off1, rtt)
    # after alignment the two ranks' post-barrier records are close, not 5 s apart
    assert abs(t1 - t0) < 100_000_000


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter"])
def test_a_real_gloo_collective_gets_a_completion_time(cluster_of, op):
    """all_reduce completes through its future's callback; gloo's reduce-scatter has no future
    (``Work::getFuture not implemented``), so the recorder's watcher thread waits on it. The
    process group records it, into the recorder whose ``labels()`` block issued it."""
    def job(op):
        import time

        import torch
        import torch.distributed as dist

        from ddpkit.torch_internals import reduce_scatter_flat
        from ddpkit.trace import Recorder

        rec = Recorder()
        rec.next_step()
        t = torch.ones(1000)
        with rec.labels(bucket=0):
            if op == "all_reduce":
                work = dist.all_reduce(t, async_op=True)
            else:
                work = reduce_scatter_flat(torch.empty(1000 // dist.get_world_size()), t, async_op=True)
        work.wait()
        _ = rec.records  # resolve once before completion is certain ...
        dist.barrier()
        for _ in range(100):  # ... the callback runs on another thread, a moment after wait()
            if all(r.end_ns is not None for r in rec.records):
                break
            time.sleep(0.01)
        return rec.trace()

    trace = Trace.merge(cluster_of(2).run(job, op))
    spans = trace.select(cat="comm")
    assert len(spans) == 2
    for r in spans:
        assert r.end_ns is not None and r.end_ns >= r.start_ns
        assert r.nbytes == 4000 and r.bucket == 0 and r.args["group"] == (0, 1)
    sent = 4000.0 if op == "all_reduce" else 2000.0  # 2(N-1)/N S and (N-1)/N S at N=2
    assert comm_bytes_per_step(trace) == {0: {0: sent, 1: sent}}


# ----------------------------------------------------------------------------- Chrome trace
def _synthetic_trace() -> Trace:
    recs = []
    for rank in range(2):
        recs += [
            span(rank, None, "broadcast_setup", 0, 10),
            comm(rank, None, "broadcast", 2, 8, 100),
            span(rank, 0, "forward", 100, 200),
            span(rank, 0, "backward", 200, 400),
            Record("instant", "grad_ready", "head.weight", rank, 0, 220, bucket=0),
            Record("instant", "grad_ready", "layers.0.weight", rank, 0, 300, bucket=1),
            comm(rank, 0, "all_reduce", 230, 350, 1000, bucket=0),
            comm(rank, 0, "all_reduce", 310, 420, 3000, bucket=1),   # in flight with bucket 0
            span(rank, 0, "sync", 400, 420),
            span(rank, 0, "step", 420, 450),
            Record("counter", "memory", "memory", rank, 0, 450, args={"parameters": 4000}),
        ]
    return Trace(recs, world_size=2, backend="gloo")


def test_chrome_trace_schema(tmp_path):
    path = tmp_path / "trace.json"
    out = to_chrome_trace(_synthetic_trace(), path)
    loaded = json.loads(path.read_text())
    assert loaded == json.loads(json.dumps(out))
    events = loaded["traceEvents"]
    assert loaded["distributedInfo"] == {"backend": "gloo", "rank": 0, "world_size": 2, "ranks": [0, 1]}
    for e in events:
        assert {"ph", "name", "pid", "tid"} <= e.keys()
        assert e["pid"] in (0, 1)
    meta = [e for e in events if e["ph"] == "M"]
    names = {(e["pid"], e["args"]["name"]) for e in meta if e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    for rank in (0, 1):
        # the lanes named as on the widget's timeline
        assert [threads[(rank, tid)] for tid in LANES.values()] == ["compute", "collectives", "buckets"]
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == 2 * 8  # per rank: 5 compute spans, 3 collectives
    for e in xs:
        assert e["ts"] >= 0 and e["dur"] >= 0 and e["cat"] in ("compute", "comm")
    fwd = next(e for e in xs if e["name"] == "forward" and e["pid"] == 0)
    assert (fwd["ts"], fwd["dur"], fwd["tid"]) == (0.1, 0.1, LANES["compute"])  # ns -> us
    ars = [e for e in xs if e["name"] == "all_reduce" and e["pid"] == 0]
    assert [e["args"]["bytes"] for e in ars] == [1000, 3000]
    # two collectives in flight at once go to different comm lanes, each one named
    assert ars[0]["tid"] == LANES["comm"] and ars[1]["tid"] != ars[0]["tid"]
    assert threads[(0, ars[1]["tid"])] == "2nd in flight"
    instants = [e for e in events if e["ph"] == "i"]
    assert len(instants) == 4 and all(e["tid"] == LANES["buckets"] and e["s"] == "t" for e in instants)
    counters = [e for e in events if e["ph"] == "C"]
    assert [e["args"] for e in counters] == [{"parameters": 4000}] * 2


def test_flow_events_link_each_collective_from_the_rank_that_launched_last():
    recs = []
    for rank, late in ((0, 0), (1, 50)):  # rank 1 launches every collective 50 ns later
        recs += [comm(rank, 0, "all_reduce", 100 + late, 300, 8, bucket=0),
                 comm(rank, 0, "all_reduce", 320 + late, 500, 8, bucket=1),
                 comm(rank, 1, "all_reduce", 600 + late, 700, 8, bucket=0)]
    events = to_chrome_trace(Trace(recs, 2))["traceEvents"]
    starts = [e for e in events if e["ph"] == "s"]
    ends = [e for e in events if e["ph"] == "f"]
    assert len(starts) == len(ends) == 3 and {e["id"] for e in starts} == {e["id"] for e in ends}
    assert all(e["pid"] == 1 and "rank 1 launched last" in e["name"] for e in starts)
    assert all(e["pid"] == 0 and e["bp"] == "e" and e["args"]["waited_us"] == 0.05 for e in ends)
    xs = {(e["pid"], e["ts"]): e for e in events if e["ph"] == "X"}
    for s_, f in zip(sorted(starts, key=lambda e: e["ts"]), sorted(ends, key=lambda e: e["ts"]), strict=True):
        assert (1, s_["ts"]) in xs and s_["tid"] == xs[(1, s_["ts"])]["tid"]  # on the late rank's slice
        x = next(x for (p, _), x in xs.items() if p == 0 and x["ts"] <= f["ts"] <= x["ts"] + x["dur"])
        assert f["tid"] == x["tid"]  # inside the early rank's slice of the same collective


def _one_all_reduce_per_pair():
    import torch.distributed as dist

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    dist.all_reduce(torch.ones(4), group=pairs[dist.get_rank() // 2])


def test_collectives_on_different_subgroups_are_not_matched_as_one(cluster_of):
    from ddpkit.trace.chrome import same_collectives

    c = cluster_of(4)
    with c.recording():
        c.run(_one_all_reduce_per_pair)
    groups = [g for g in same_collectives(c.last_trace) if g[0].name == "all_reduce"]
    assert sorted(sorted(r.rank for r in g) for g in groups) == [[0, 1], [2, 3]]


def test_x_events_on_one_lane_never_partly_overlap():
    # Chrome's complete events on one thread must nest; collectives in flight together don't.
    recs = [comm(0, 0, "all_reduce", 10 * i, 10 * i + 35, 8, bucket=i) for i in range(6)]
    events = to_chrome_trace(Trace(recs, 2))["traceEvents"]
    by_tid: dict = {}
    for e in events:
        if e["ph"] == "X":
            by_tid.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    assert len(by_tid) == 4  # at most 4 collectives are in flight at once here
    for spans in by_tid.values():
        spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))


# ----------------------------------------------------------------------------- derived figures
def test_memory_over_time_carries_partial_samples_and_finds_the_peak():
    from ddpkit.trace import fill_rows, loss_per_step, memory_peak, memory_series

    recs = [Record("counter", "memory", "memory", 0, 0, 10, args={"parameters": 100, "gradients": 0}),
            Record("counter", "memory", "memory", 0, 0, 20, args={"unsharded_parameters": 50}),
            Record("counter", "memory", "memory", 0, 1, 30, args={"gradients": 100, "cuda_allocated": 9}),
            Record("counter", "memory", "memory", 1, 1, 30, args={"parameters": 10})]
    assert memory_series(recs, 0) == [(10, 0, {"parameters": 100, "gradients": 0}),
                                      (20, 0, {"parameters": 100, "gradients": 0, "unsharded_parameters": 50}),
                                      (30, 1, {"parameters": 100, "gradients": 100, "unsharded_parameters": 50})]
    assert memory_peak(recs) == (0, 30, 1, {"parameters": 100, "gradients": 100, "unsharded_parameters": 50})
    assert memory_peak([]) is None
    losses = [Record("counter", "loss", "loss", r, s, 0, args={"loss": float(r + s)}) for r in (0, 1) for s in (0, 1)]
    assert loss_per_step(losses) == {0: 0.5, 1: 1.5}
    ready = [(f"layers.{i}.{w}", 0, i) for i in range(3) for w in ("weight", "bias")]
    assert [label for label, _ in fill_rows(ready)] == ["layers.0", "layers.1", "layers.2"]
    assert [label for label, _ in fill_rows(ready, max_rows=2)] == ["layers.0 .. layers.1", "layers.2"]


def test_ring_bytes_follow_the_ring_formulas():
    s, n = 1200, 4
    assert ring_bytes("all_reduce", s, n) == 2 * 3 / 4 * s
    assert ring_bytes("all_gather", s, n) == 3 / 4 * s
    assert ring_bytes("reduce_scatter", s, n) == 3 / 4 * s
    # a broadcast's root sends S, the ranks after it forward S, the last sends nothing: on average
    # (N-1)/N S per rank, as an all-gather of S
    assert ring_bytes("broadcast", s, n) == 3 / 4 * s
    assert ring_bytes("all_reduce", s, 1) == 0
    with pytest.raises(ValueError, match="unknown collective"):
        ring_bytes("all_to_all", s, n)


def test_bytes_and_counts_per_step():
    recs = [
        comm(0, None, "broadcast", 0, 1, 500),
        comm(0, 0, "all_reduce", 0, 1, 400), comm(0, 0, "all_reduce", 0, 1, 400),
        comm(1, 0, "all_reduce", 0, 1, 800),
        comm(0, 1, "all_gather", 0, 1, 400), comm(0, 1, "reduce_scatter", 0, 1, 400),
    ]
    trace = Trace(recs, world_size=4)
    assert comm_bytes_per_step(trace) == {
        None: {0: 0.75 * 500},  # a broadcast: the ranks' average, (N-1)/N S
        0: {0: 2 * 1.5 * 400, 1: 1.5 * 800},
        1: {0: 0.75 * 400 + 0.75 * 400},
    }
    assert collective_counts(trace) == {
        None: {0: {"broadcast": 1}},
        0: {0: {"all_reduce": 2}, 1: {"all_reduce": 1}},
        1: {0: {"all_gather": 1, "reduce_scatter": 1}},
    }
    assert collective_bytes(trace)[0] == {0: 800, 1: 800}


def test_overlap_fraction_is_comm_time_inside_backward_compute():
    recs = [
        span(0, 0, "backward", 0, 100),
        comm(0, 0, "all_reduce", 50, 150, 8),
        comm(0, 0, "all_reduce", 60, 80, 8),   # inside the first: the union counts once
        span(0, 1, "backward", 1000, 1100),
        comm(0, 1, "all_reduce", 1200, 1300, 8),  # after backward: nothing hidden
    ]
    trace = Trace(recs, world_size=2)
    assert overlap_fraction(trace, step=0) == pytest.approx(50 / 100)
    assert overlap_fraction(trace, step=1) == 0.0
    assert overlap_fraction(trace) == pytest.approx(50 / 200)
    # the last gradient ready at 90 ends backward's compute: waiting after it is not compute
    recs.append(Record("instant", "grad_ready", "w", 0, 0, 90, bucket=0))
    assert overlap_fraction(Trace(recs, 2), step=0) == pytest.approx(40 / 100)


def test_bucket_fill_and_launch_order():
    recs = [
        Record("instant", "grad_ready", "b", 0, 0, 30, bucket=1),
        Record("instant", "grad_ready", "a", 0, 0, 10, bucket=0),
        Record("instant", "grad_ready", "z", 1, 0, 5, bucket=0),   # another rank
        Record("instant", "grad_ready", "c", 0, 1, 7, bucket=0),   # the last step
        comm(0, 1, "all_reduce", 20, 30, 8, bucket=1),
        comm(0, 1, "all_reduce", 10, 40, 8, bucket=0),
    ]
    trace = Trace(recs, world_size=2)
    assert bucket_fill_order(trace, rank=0, step=0) == [("a", 0, 10), ("b", 1, 30)]
    assert bucket_fill_order(trace, rank=0) == [("c", 0, 7)]  # step=-1: the last step
    assert [r.bucket for r in launch_order(trace, rank=0)] == [0, 1]
    with pytest.raises(IndexError):
        bucket_fill_order(trace, step=5)


# ----------------------------------------------------------------------------- with the strategies
def _traced_run(strategy: str, steps: int = 2):
    """A job: wrap a small MLP, train ``steps`` steps with a recorder, return the rank's trace."""

    def job():
        import torch.distributed as dist

        import ddpkit
        from ddpkit.experiment import local_batch, make_optimizer, train_step
        from ddpkit.models import build_model
        from ddpkit.trace import Recorder

        rank, ws = dist.get_rank(), dist.get_world_size()
        rec = Recorder()
        rec.align_clocks()
        module = build_model("mlp", width=64, depth=6)
        # 64*64*4 B = 16 KiB per weight: a 0.03 MB cap gives a few buckets (naive: one per gradient)
        model = (ddpkit.NaiveDDP(module, recorder=rec) if strategy == "naive" else
                 {"overlapped": ddpkit.OverlappedDDP, "bucketed": ddpkit.BucketedDDP}[strategy](
                     module, bucket_cap_mb=0.03, recorder=rec))
        opt = make_optimizer(model.parameters(), "sgd")
        for step in range(steps):
            rec.next_step()
            x, y = local_batch(module, 16, step, rank, ws)
            train_step(model, opt, x, y, rec)
        return rec.trace(), len(model.buckets or model.named_grads), sum(p.numel() * 4 for p in module.parameters())

    return job


def test_overlapped_ddp_communicates_during_backward_in_bucket_order(cluster_of):
    results = cluster_of(2).run(_traced_run("overlapped"))
    trace = Trace.merge([t for t, _, _ in results])
    buckets, model_bytes = results[0][1], results[0][2]
    assert buckets >= 3
    for rank in trace.ranks:
        for step in trace.steps:
            (backward,) = trace.select(rank=rank, step=step, name="backward")
            launches = launch_order(trace, rank, step)
            assert [r.bucket for r in launches] == list(range(buckets))  # bucket order
            ready = bucket_fill_order(trace, rank, step)
            last_ready = max(t for _, _, t in ready)
            # communication starts during backward, before autograd has produced every grad
            assert backward.start_ns < launches[0].start_ns < last_ready
            # every bucket's gradients were ready before its all-reduce was launched
            for r in launches:
                assert max(t for _, b, t in ready if b == r.bucket) <= r.start_ns
    assert collective_counts(trace)[0] == {0: {"all_reduce": buckets}, 1: {"all_reduce": buckets}}
    assert collective_bytes(trace)[1] == {0: model_bytes, 1: model_bytes}
    assert overlap_fraction(trace) > 0


def _own_loop_bucketed():
    """A loop of its own (no train_step): the wrapper times forward and backward itself."""
    import torch.distributed as dist

    import ddpkit
    from ddpkit.experiment import local_batch
    from ddpkit.models import build_model, loss_fn
    from ddpkit.trace import Recorder

    rec = Recorder()
    module = build_model("mlp", width=64, depth=6)
    model = ddpkit.BucketedDDP(module, bucket_cap_mb=0.03, recorder=rec)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x, y = local_batch(module, 16, step, dist.get_rank(), dist.get_world_size())
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return rec.trace()


def test_a_loop_of_its_own_records_backward_up_to_the_last_gradient_not_the_sync(cluster_of):
    trace = Trace.merge(cluster_of(2).run(_own_loop_bucketed))
    for rank in trace.ranks:
        for step in trace.steps:
            (backward,) = trace.select(rank=rank, step=step, name="backward")
            launches = launch_order(trace, rank, step)
            assert launches and all(backward.end_ns <= r.start_ns for r in launches)


@pytest.mark.parametrize("strategy", ["bucketed", "naive"])
def test_bucketed_and_naive_communicate_only_after_backward_in_the_sync_span(cluster_of, strategy):
    """They sync inside loss.backward() (a callback queued at the end of backward), yet the recorded
    "backward" span is autograd's work only: it ends at the last gradient, and every all-reduce lies
    in the "sync" span after it, so the timeline does not draw them as overlapping backward."""
    results = cluster_of(2).run(_traced_run(strategy))
    trace = Trace.merge([t for t, _, _ in results])
    buckets, model_bytes = results[0][1], results[0][2]
    for rank in trace.ranks:
        for step in trace.steps:
            (backward,) = trace.select(rank=rank, step=step, name="backward")
            (sync,) = trace.select(rank=rank, step=step, name="sync")
            launches = launch_order(trace, rank, step)
            assert len(launches) == buckets
            last_ready = max(t for _, _, t in bucket_fill_order(trace, rank, step))
            assert backward.start_ns <= last_ready <= backward.end_ns <= sync.start_ns
            assert all(sync.start_ns <= r.start_ns and r.end_ns <= sync.end_ns for r in launches)
    assert overlap_fraction(trace) == 0.0
    assert comm_bytes_per_step(trace)[0] == {0: float(model_bytes), 1: float(model_bytes)}
