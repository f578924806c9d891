"""ddpkit's process group and the emulated network: every collective counted at ring theory (torch's
wrappers included), recorded once, delayed as the network says, without burning the CPU."""
from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.network import LINKS, Link, Network, collective_time
from ddpkit.strategies.table import NAMES, strategy
from helpers import SMALL_MLP

# A slow link on purpose: 2 ms per message, 0.1 GB/s (an all-reduce of 400 kB on 2 ranks: 8 ms).
SLOW = "2000,0.1"


@contextlib.contextmanager
def on_network(cluster, network):
    """Emulate ``network`` on a shared cluster for the block, then back to loopback."""
    cluster.network = network
    try:
        yield cluster
    finally:
        cluster.network = None


# ----------------------------------------------------------------------------- counting
def _bytes_per_step(name, steps=3):
    from ddpkit.experiment import local_batch, train_step, wrap
    from ddpkit.models import build_model
    from ddpkit import rankside

    rank, n = dist.get_rank(), dist.get_world_size()
    module = build_model("mlp", seed=0, **SMALL_MLP)
    model, opt = wrap(name, module, bucket_cap_mb=0.001)
    train_step(model, opt, *local_batch(module, 12, 0, rank, n))  # warm-up: torch DDP rebuilds buckets
    before = rankside.comm().snapshot()
    for step in range(1, 1 + steps):
        train_step(model, opt, *local_batch(module, 12, step, rank, n))
    after = rankside.comm().snapshot()
    sent = {}  # per op, over every link (a shared cluster's earlier jobs may have used other links)
    for (op, link), (calls, b, _) in after.items():
        was = before.get((op, link), (0, 0, 0))
        c0, b0 = sent.get(op, (0, 0))
        sent[op] = (c0 + calls - was[0], b0 + b - was[1])
    param_bytes = sum(p.numel() * p.element_size() for p in build_model("mlp", **SMALL_MLP).parameters())
    return {op: (c / steps, b / steps) for op, (c, b) in sent.items() if c}, param_bytes


@pytest.mark.parametrize("name", [n for n in NAMES if strategy(n).bytes_vs_ddp is not None])
def test_bytes_per_step_equal_ring_theory_for_every_strategy(cluster_of, name):
    per_op, param_bytes = cluster_of(2).run(_bytes_per_step, name)[0]
    if name == "torch_ddp":  # rank 0 broadcasts the buckets it rebuilt after the first step: a few bytes
        calls, sent = per_op.pop("broadcast")
        assert calls * 3 == 2 and sent < 100
    total = sum(b for _, b in per_op.values())
    ddp = 2 * (2 - 1) / 2 * param_bytes  # a ring all-reduce of every gradient, per rank
    # DDP moves exactly its gradients; sharded strategies pad: FSDP each unit's flat parameter to
    # a multiple of N, ZeRO-1's all-gather every rank's slot to the largest rank's share
    rel = 1e-9 if strategy(name).zero_stage == "DDP" else 0.05
    assert total == pytest.approx(strategy(name).bytes_vs_ddp * ddp, rel=rel), per_op


def _one_all_reduce_counted():
    from ddpkit import rankside

    before = rankside.comm().snapshot().get(("all_reduce", "inter-node"), (0, 0.0, 0.0))
    dist.all_reduce(torch.ones(1000))
    after = rankside.comm().snapshot()[("all_reduce", "inter-node")]
    return after[0] - before[0], after[1] - before[1], type(dist.group.WORLD).__name__


def test_a_cluster_runs_on_ddpkits_process_group(cluster_of):
    for calls, sent, kind in cluster_of(4).run(_one_all_reduce_counted):
        assert (calls, sent, kind) == (1, 2 * 3 / 4 * 4000, "DdpkitProcessGroup")


def _point_to_point_and_rooted_collectives():
    from ddpkit import rankside

    rank = dist.get_rank()
    before = rankside.comm().snapshot()
    t = torch.full((3,), float(rank + 1))
    if rank == 0:
        dist.send(t, dst=1)
    else:
        dist.recv(t, src=0)  # now rank 0's ones
    dist.reduce(t, dst=0)  # rank 0: 1 + 1
    gathered = [torch.zeros(3) for _ in range(2)] if rank == 0 else None
    dist.gather(torch.full((3,), float(rank)), gathered, dst=0)
    return t.tolist(), gathered and [g.tolist() for g in gathered], rankside.comm().snapshot() == before


def test_what_no_strategy_issues_passes_through_uncounted(cluster_of):
    (t0, gathered, uncounted0), (_, _, uncounted1) = cluster_of(2).run(_point_to_point_and_rooted_collectives)
    assert t0 == [2.0] * 3  # rank 1 received rank 0's ones; reduced onto rank 0
    assert gathered == [[0.0] * 3, [1.0] * 3]
    assert uncounted0 and uncounted1


def _reduce_scatter_counts():
    from ddpkit import rankside
    from ddpkit.torch_internals import reduce_scatter_flat

    before = rankside.comm().snapshot().get(("reduce_scatter", "inter-node"), (0, 0.0, 0.0))
    reduce_scatter_flat(torch.empty(500), torch.ones(1000))
    _, sent, moved = rankside.comm().snapshot()[("reduce_scatter", "inter-node")]
    return sent - before[1], moved - before[2]


def test_reduce_scatter_counts_the_algorithm_and_what_the_transport_moved(cluster_of):
    # gloo reduce-scatters a flat tensor by an all-reduce and a chunk: twice the algorithm's bytes;
    # the shared-memory transport moves the algorithm's own
    c = cluster_of(2)
    for sent, moved in c.run(_reduce_scatter_counts):
        assert sent == 1 / 2 * 4000 and moved == (2 if c.transport == "gloo" else 1) * sent


def _reduce_scatter_waited_twice():
    rank = dist.get_rank()
    out = torch.empty(3)
    work = dist.reduce_scatter_tensor(out, torch.arange(6.0) + rank, async_op=True)
    work.wait()
    first = out.clone()
    out.mul_(10)   # what HSDP does next: the shard all-reduced across nodes, in place
    work.wait()    # a second wait (a recorder's watcher thread waits on works too)
    return first.tolist(), out.tolist(), hasattr(work, "get_future") and work.get_future() is not None


def test_a_reduce_scatter_waited_twice_keeps_what_the_caller_wrote_since(cluster_of):
    # gloo's own flat reduce-scatter copied its chunk out again on every wait(): a recorded hsdp
    # run then lost the cross-node all-reduce of a gradient shard now and then
    for rank, (first, after, has_future) in enumerate(cluster_of(2).run(_reduce_scatter_waited_twice)):
        expected = [2 * (3 * rank + i) + 1 for i in range(3)]   # rank 0's + rank 1's chunk
        assert first == expected
        assert after == [10 * v for v in expected]
        assert has_future


# ----------------------------------------------------------------------------- recording
def _recorded_bucketed():
    from ddpkit.experiment import local_batch, train_step, wrap
    from ddpkit.models import build_model
    from ddpkit.trace.seam import recording
    from ddpkit.trace import Recorder

    rank, n = dist.get_rank(), dist.get_world_size()
    module = build_model("mlp", seed=0, **SMALL_MLP)
    rec = Recorder()
    with recording(rec):
        model, opt = wrap("bucketed", module, bucket_cap_mb=0.001)
        rec.next_step()
        train_step(model, opt, *local_batch(module, 12, 0, rank, n))
    comm = [r for r in rec.records if r.cat == "comm" and r.step == 0]
    return [(r.name, r.bucket, r.args.get("link"), r.args.get("group"), r.end_ns is not None) for r in comm], \
        len(model.buckets)


def test_each_collective_is_recorded_once_with_its_link_and_bucket(cluster_of):
    comm, buckets = cluster_of(2).run(_recorded_bucketed)[0]
    assert len(comm) == buckets  # one record per bucket's all-reduce, written by the process group
    assert [c[1] for c in comm] == list(range(buckets))  # the strategy's labels
    assert all(c[0] == "all_reduce" and c[2] == "inter-node" and c[3] == (0, 1) and c[4] for c in comm)


def _labels_on_this_thread_only():
    import threading

    from ddpkit.trace.seam import NULL_RECORDER, NullRecorder, recording
    from ddpkit.trace import Recorder

    class Counting(NullRecorder):  # a recorder that is on, as a test's counting one
        enabled = True

        def __init__(self):
            self.seen = []

        def collective(self, name, work, nbytes, **fields):
            self.seen.append((name, nbytes, fields.get("bucket")))

    rank_rec, own, counting = Recorder(), Recorder(), Counting()
    with recording(rank_rec):
        rank_rec.next_step()
        own.next_step()
        with own.labels(bucket=7):
            # issued on another thread while this one is inside the block: not labelled by it
            other = threading.Thread(target=lambda: dist.all_reduce(torch.ones(4)))
            other.start()
            other.join()
            dist.all_reduce(torch.ones(8))
        with rank_rec.labels(unit="u"):  # labelled by the rank's own recorder: one record there
            dist.all_reduce(torch.ones(2))
        with counting.labels(bucket=3), NULL_RECORDER.labels(bucket=9):  # a recorder that is off
            dist.all_reduce(torch.ones(1))                                 # labels (and hides) nothing
        with counting.labels(bucket=4), own.labels(bucket=5):  # blocks nest: the innermost labels
            dist.all_reduce(torch.ones(1))
    comm = lambda rec: [(r.nbytes, r.bucket, r.unit) for r in rec.records if r.cat == "comm"]  # noqa: E731
    return comm(rank_rec), comm(own), counting.seen, NULL_RECORDER.labels(bucket=1) is NULL_RECORDER.labels()


def test_labels_reach_the_collectives_issued_in_the_block_on_its_thread(cluster_of):
    for rank_comm, own_comm, counted, shared in cluster_of(2).run(_labels_on_this_thread_only):
        assert rank_comm == [(16, None, None), (32, 7, None), (8, None, "u"), (4, 3, None), (4, 5, None)]
        assert own_comm == [(32, 7, None), (4, 5, None)]  # a job's own recorder: what it labelled, once
        assert counted == [("all_reduce", 4, 3)]
        assert shared  # recording off: every labels() is the same empty with


# ----------------------------------------------------------------------------- emulation
def _timed_all_reduce(numel, calls=3):
    from ddpkit import rankside

    t = torch.ones(numel)
    dist.all_reduce(t)  # warm-up
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(t)
    return (time.perf_counter() - t0) / calls, rankside.comm().network.emulated_time("all_reduce", numel * 4, [0, 1])


def test_a_collective_takes_at_least_what_the_emulated_link_takes(cluster_of):
    with on_network(cluster_of(2), SLOW) as c:
        for took, link_s in c.run(_timed_all_reduce, 100_000):
            assert link_s == pytest.approx(2 * 2e-3 + 400_000 / 0.1e9)  # 2 alphas + 2(N-1)/N S beta
            assert link_s <= took < link_s + 0.5  # the floor is the point; the ceiling only catches a runaway


class _SlowWork:
    """A stand-in for a real collective that moves its bytes in ``seconds``."""

    def __init__(self, seconds):
        self.done_at = time.perf_counter() + seconds

    def wait(self):
        time.sleep(max(0.0, self.done_at - time.perf_counter()))
        return True

    def is_completed(self):
        return time.perf_counter() >= self.done_at

    def get_future(self):
        raise RuntimeError("Work::getFuture not implemented")


@pytest.mark.parametrize(("real_s", "link_s", "outran"), [(0.04, 0.08, 0), (0.08, 0.04, 1)])
def test_the_link_counts_from_issue_and_the_slower_of_link_and_transport_decides(real_s, link_s, outran):
    from ddpkit.comm.emulator import Emulator

    emulator = Emulator()
    t0 = time.perf_counter()
    work = emulator.submit("inter-node", _SlowWork(real_s), link_s, [torch.ones(1)])
    work.wait()
    took = time.perf_counter() - t0
    # the link replaces the real transfer where it is slower: max(real, link), not real + link
    assert max(real_s, link_s) <= took < max(real_s, link_s) + 0.03, took
    assert emulator.fidelity()["inter-node"] == (1, outran)  # the machine outran the link, or not


def _emulated_share():
    from ddpkit.experiment import run_strategy

    out = run_strategy("bucketed", steps=2, model_kwargs=SMALL_MLP)
    return out.emulated_collectives, out.outran_link


def test_a_run_counts_the_collectives_whose_real_transfer_outran_the_link(cluster_of):
    with on_network(cluster_of(2), "0,1000") as c:       # 1 TB/s, no latency: loopback takes longer
        for carried, outran in c.run(_emulated_share):
            assert carried >= 2 and outran == carried
    with on_network(c, "20000,0.1"):                     # 20 ms a message: the link is slower
        for carried, outran in c.run(_emulated_share):
            assert carried >= 2 and outran == 0
    assert c.run(_emulated_share) == [(0, 0), (0, 0)]    # loopback: nothing emulated


def test_compare_says_where_the_network_is_faster_than_this_machine_can_emulate():
    from ddpkit.compare import format_table

    row = dict(strategy="overlapped", ms_per_step=30.0, comm_bytes_per_step=2**20, max_param_diff=0.0)
    table = " ".join(format_table([dict(row, outran_link=0.6)]).split())  # its notes are wrapped
    assert "faster than this machine can emulate" in table and "overlapped 60%" in table
    assert "emulate" not in format_table([dict(row, outran_link=0.1)])
    assert "emulate" not in format_table([row])


def _async_overlaps_compute_and_sleeps():
    """Launch an all-reduce on a slow link, compute while it travels, then wait."""
    t = torch.ones(100_000)
    dist.barrier()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    work = dist.all_reduce(t, async_op=True)
    x = torch.randn(200, 200)
    busy_until = time.perf_counter() + 0.006
    while time.perf_counter() < busy_until:  # ~6 ms of "backward"
        x = x @ x.T / 200
    work.wait()
    return time.perf_counter() - wall0, time.process_time() - cpu0, t[0].item()


def test_an_async_collective_overlaps_compute_and_waiting_does_not_burn_the_cpu(cluster_of):
    with on_network(cluster_of(2), SLOW) as c:
        for wall, cpu, value in c.run(_async_overlaps_compute_and_sleeps):
            assert value == 2.0
            assert 0.008 <= wall < 0.5  # at least the link's 8 ms (the overlap: test_ddp.py, during backward)
            assert cpu < wall / 2 + 0.01  # the rest of the wait was spent sleeping


def _three_async_in_a_row():
    ts = [torch.ones(100_000) for _ in range(3)]
    dist.barrier()
    t0 = time.perf_counter()
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for w in works:
        w.wait()
    return time.perf_counter() - t0


def test_collectives_on_one_link_run_one_after_another(cluster_of):
    with on_network(cluster_of(2), SLOW) as c:
        link_s = Network.of(SLOW).emulated_time("all_reduce", 400_000, [0, 1])
        for took in c.run(_three_async_in_a_row):
            assert took >= 3 * link_s


def _links_of_groups():
    from ddpkit import rankside

    rank = dist.get_rank()
    node = dist.new_group([0, 1]), dist.new_group([2, 3])  # every rank creates every group
    across = dist.new_group([0, 2]), dist.new_group([1, 3])
    before = rankside.comm().snapshot()
    dist.all_reduce(torch.ones(100), group=node[rank // 2])
    dist.all_reduce(torch.ones(100), group=across[rank % 2])
    after = rankside.comm().snapshot()
    grew = {k for k in after if after[k][0] > before.get(k, (0,))[0]}
    return sorted(grew), type(node[rank // 2]).__name__


def test_two_tiers_put_a_nodes_group_on_the_fast_link_and_others_on_the_slow_one(cluster_of):
    with on_network(cluster_of(4), Network.of("10GbE", gpus_per_node=2)) as c:
        for grew, kind in c.run(_links_of_groups):
            assert kind == "DdpkitProcessGroup"  # subgroups are ddpkit's too
            assert grew == [("all_reduce", "inter-node"), ("all_reduce", "intra-node")]


def test_switching_the_network_keeps_the_ranks(cluster_of):
    c = cluster_of(2)
    pids = [r.pid for r in c.ranks]
    with on_network(c, "10GbE"):
        assert c.network.inter.name == "10GbE"
        assert c.run(lambda: ddpkit.rankside.comm().network.inter.name) == ["10GbE", "10GbE"]
    assert c.run(lambda: ddpkit.rankside.comm().network.emulated) == [False, False]
    assert [r.pid for r in c.ranks] == pids


def test_switching_the_network_while_recording_leaves_the_last_trace_alone(cluster_of):
    c = cluster_of(2)
    with c.recording():
        c.run(lambda: dist.all_reduce(torch.ones(10)))
        kept = c.last_trace
        with on_network(c, "10GbE"):
            assert c.last_trace is kept  # switching is the cluster's own job, not a recorded run


def test_a_rank_that_dies_under_emulation_is_a_rank_error_and_the_cluster_recovers():
    with ddpkit.Cluster(2, timeout=3, network="1GbE") as c:
        c.network = "10GbE"  # the ranks started after the fault come back on the network switched to
        def die():
            import os

            if dist.get_rank() == 1:
                os._exit(3)
            dist.all_reduce(torch.ones(10))

        with pytest.raises(ddpkit.RankError) as info:
            c.run(die)
        assert 1 in info.value.ranks
        assert c.run(lambda: dist.get_world_size()) == [2, 2]  # restarted, still emulating
        assert c.run(lambda: ddpkit.rankside.comm().network.inter.name) == ["10GbE", "10GbE"]


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("spec, message", [
    ("carrier-pigeon", "valid presets: loopback, nvlink, 100GbE, 10GbE, 1GbE, paper"),
    ("20,0", "bandwidth > 0"),
    ("-1,10", "latency must be >= 0"),
    ("20,nan", "bandwidth > 0"),
])
def test_a_bad_network_is_a_value_error_naming_what_is_valid(spec, message):
    with pytest.raises(ValueError, match=message):
        Network.of(spec)


def test_a_bad_cluster_network_fails_before_any_rank_starts(monkeypatch):
    from ddpkit.cluster.processes import Workers

    monkeypatch.setattr(Workers, "start", lambda *a: pytest.fail("a rank was started"))
    with pytest.raises(ValueError, match="gpus_per_node=2 does not divide world_size=3"):
        ddpkit.Cluster(3, network=Network.of("10GbE", gpus_per_node=2))
    with pytest.raises(ValueError, match="valid presets"):
        ddpkit.Cluster(2, network="56k-modem")
    with pytest.raises(ValueError, match="gpus_per_node must be a whole number >= 1"):
        Network.of("10GbE", gpus_per_node=0)
    with pytest.raises(TypeError, match="a network is"):
        ddpkit.Cluster(2, network=10)


# ----------------------------------------------------------------------------- the model of it
def test_network_times_follow_the_ring_formulas_and_the_tiers():
    net = Network.of("10GbE", gpus_per_node=2)
    s = 1e6
    inter, intra = LINKS["10GbE"], LINKS["nvlink"]
    assert net.link_for([0, 1]) == ("intra-node", intra)
    assert net.link_for([0, 2]) == ("inter-node", inter)
    assert net.emulated_time("all_reduce", s, [0, 1, 2, 3]) == pytest.approx(collective_time("all_reduce", s, 4, inter))
    assert net.emulated_time("all_gather", s, [2, 3]) == pytest.approx(intra.alpha + s / 2 * intra.beta)
    assert Network.of("loopback").emulated_time("all_reduce", s, [0, 1]) == 0.0
    floor = Link("floor", alpha=1e-3, beta=0.0)  # the slower of the real transport and the link decides
    assert Network.of("10GbE").with_floor(floor).collective_time("all_reduce", s, 2) == pytest.approx(
        max(2e-3, collective_time("all_reduce", s, 2, inter)))
    slow_floor = Link("floor", alpha=1.0, beta=0.0)
    assert Network.of("10GbE").with_floor(slow_floor).collective_time("all_reduce", s, 2) == pytest.approx(2.0)
    assert Network.from_dict(net.to_dict()) == net


def test_a_link_matched_to_backward_carries_a_steps_buckets_in_backwards_time():
    """04 and 08's network: the bandwidth solved so that k all-reduces of S bytes in all take the
    measured backward, latency included; its arithmetic prints the numbers it was solved from."""
    from ddpkit.matched_link import match_backward

    S, backward = 8 * 2**20, 0.025
    for n, k in ((2, 8), (4, 3)):
        m = match_backward(backward, S, n, buckets=k)
        per_bucket = [S / k] * k
        step = sum(m.network.emulated_time("all_reduce", b, range(n)) for b in per_bucket)
        assert step == pytest.approx(backward)  # the whole point
        assert m.latency_s == pytest.approx(k * 2 * (n - 1) * 100e-6)
    m = match_backward(backward, S, 2, buckets=8)
    text = m.arithmetic()
    assert "25.00 ms" in text and "16 messages x 100 us = 1.60 ms" in text and f"{m.link.gbytes_per_s:.3g} GB/s" in text
    assert Network.from_dict(m.network.to_dict()).describe() == m.network.describe() == m.link.describe()
    with pytest.raises(ValueError, match="longer than backward"):
        match_backward(0.001, S, 2, buckets=8)  # 16 x 100 us > 1 ms: no bandwidth matches
    with pytest.raises(ValueError, match="world_size >= 2"):
        match_backward(backward, S, 1)


def test_a_work_made_from_a_failed_future_raises_on_wait():
    # torch's _create_work_from_future returned True from wait() even when the future failed:
    # a collective that failed behind the emulator (or in a copy-out) went unnoticed
    from ddpkit.torch_internals import work_from_future

    future = torch.futures.Future()
    future.set_exception(RuntimeError("the peer went away"))
    work = work_from_future(future)
    assert work.is_completed()
    with pytest.raises(RuntimeError, match="the peer went away"):
        work.wait()
    done = torch.futures.Future()
    done.set_result([torch.ones(1)])
    assert work_from_future(done).wait() is True


def _collectives_with_default_options():
    from torch.distributed.distributed_c10d import _get_default_group

    group, n = _get_default_group(), dist.get_world_size()
    out = [[torch.empty(2) for _ in range(n)]]
    group.allgather(out, [torch.full((2,), float(dist.get_rank()))]).wait()  # no options given
    flat = torch.empty(2 * n)
    group._allgather_base(flat, torch.full((2,), float(dist.get_rank()))).wait()
    return [t.tolist() for t in out[0]], flat.tolist()


def test_collectives_called_without_options_take_their_defaults(cluster_of):
    for lists, flat in cluster_of(2).run(_collectives_with_default_options):
        assert lists == [[0.0, 0.0], [1.0, 1.0]] and flat == [0.0, 0.0, 1.0, 1.0]


def test_the_emulated_nic_moves_the_bytes_when_the_rank_waits(cluster_of):
    """On an emulated network the shared-memory transport defers a collective: issuing it moves
    nothing (the peer's bytes are not there before it waits), waiting moves it, the result is
    exact, and the time spent moving is counted (at_wait, ddpkit.comm.emulator)."""
    def job():
        import time

        import torch
        import torch.distributed as dist

        from ddpkit import rankside

        x = torch.full((1 << 18,), float(dist.get_rank() + 1))
        before = rankside.comm().transport_seconds()
        work = dist.all_reduce(x, async_op=True)
        time.sleep(0.05)  # far past the link's time for 1 MiB on 10GbE (~1 ms)
        untouched = bool((x == dist.get_rank() + 1).all())  # nothing moved while the rank "computed"
        work.wait()
        return untouched, bool((x == 3.0).all()), rankside.comm().transport_seconds() - before

    c = cluster_of(2)
    with on_network(c, "10GbE"):
        results = c.run(job)
    for untouched, exact, transport_s in results:
        assert untouched and exact and transport_s > 0, results
