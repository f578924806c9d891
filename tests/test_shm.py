"""The shared-memory transport (``ddpkit.comm.transport``, ``Cluster(transport="shm")``).

- every collective form it carries gives gloo's result, bit for bit, at 1, 2 and 4 ranks, for
  several dtypes, ops and sizes (regions of 256 bytes, so most tensors go through in many
  chunks), non-contiguous tensors included; and through a Cluster's own group at the default
  1 MiB regions;
- subgroups, async collectives waited for in any order, what falls back to gloo;
- faults are errors, never hangs: a dead peer (within a fraction of a second), a stuck peer (at
  the group's timeout), ranks that issue different collectives; ``/dev/shm`` keeps nothing;
- strategies, ours and torch's, train equal to one process on the shm transport (the cases of
  ``test_equivalence``, on a shm Cluster);
- for ranks sharing a GPU, without one: the staging path (``HostStaged``) with CPU tensors standing
  in for CUDA ones, every form against gloo and under ddpkit's own process group (counted, recorded,
  emulated); the GPU slab's waits (``device_slab``) in their place in each piece, with a stand-in
  slab that notes them. The GPU itself: ``tests/test_shared_gpu.py`` (``-m gpu``).
The comparisons run on private groups (``_groups``: a ShmBackend and a plain gloo group over a
fresh store), so a test that breaks one leaves the cluster's own group intact.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

import ddpkit
import test_equivalence as eq
from ddpkit.cluster import RankError
from ddpkit.comm.transport.segment import SHM_DIR

TIMEOUT = 10.0
SMALL_CHUNK = 256   # bytes per region in the comparisons: 1000 float64 move in 32 chunks
DTYPES = ("float32", "float64", "bfloat16", "float16", "int64", "int32", "uint8")
NUMELS = (1, 37, 1000)


@pytest.fixture(scope="module")
def _shm_clusters():
    made: dict = {}
    yield made
    for c in made.values():
        c.shutdown()


@pytest.fixture
def shm_cluster_of(_shm_clusters):
    """``shm_cluster_of(n)``: a Cluster of n ranks on the shm transport, shared by this file's tests."""
    def get(world_size: int) -> ddpkit.Cluster:
        c = _shm_clusters.get(world_size)
        if c is None:
            c = _shm_clusters[world_size] = ddpkit.Cluster(world_size, backend="gloo", transport="shm",
                                                           timeout=TIMEOUT)
        elif any(r.status in ("dead", "stopped") for r in c.ranks):
            c.restart()
        return c
    return get


def _leftovers(prefix: str) -> list[str]:
    return [e for e in os.listdir(SHM_DIR) if e.startswith(prefix) or e.startswith("sem." + prefix)]


# ---------------------------------------------------------------------- inside the ranks
def _groups(chunk_bytes: int = SMALL_CHUNK, timeout: float = TIMEOUT, staged: bool = False):
    """Inside a rank: a ShmBackend and a plain ProcessGroupGloo over all ranks, on a fresh store.
    ``staged``: the ShmBackend wrapped as for ranks sharing a GPU (``HostStaged``), CPU tensors
    standing in for CUDA ones: every tensor goes through a host buffer of its own, and back."""
    from datetime import timedelta

    import torch.distributed as dist

    from ddpkit.cluster.processes import loopback_store
    from ddpkit.comm.transport import HostStaged, ShmBackend

    rank, n = dist.get_rank(), dist.get_world_size()
    store = loopback_store(30.0) if rank == 0 else None
    port = [store.port if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    if rank:
        store = dist.TCPStore("127.0.0.1", port[0], n, False, timeout=timedelta(seconds=30))
    limit = timedelta(seconds=timeout)
    shm = ShmBackend(dist.PrefixStore("shm", store), rank, n, limit, chunk_bytes=chunk_bytes)
    return (HostStaged(shm, devices=("cpu",)) if staged else shm,
            dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, n, limit))


def _compare_every_form(staged: bool = False) -> list[str]:
    """Inside a rank: each collective form on shm (``staged``: through host buffers, as CUDA tensors
    are) and on gloo; what differed (empty: nothing)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import AllgatherOptions

    shm, gloo = _groups(staged=staged)
    rank, n = dist.get_rank(), dist.get_world_size()
    bad, salt = [], [0]

    def data(dtype, numel, factors=False):
        # multiples of 1/4 (or +-2^k for products): every sum and product is exact in every
        # dtype, in any order, so shm and gloo must agree bit for bit
        salt[0] += 1
        g = torch.Generator().manual_seed(1000 * rank + salt[0])
        if factors:
            pool = torch.tensor([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0] if dtype.is_floating_point else [-2, -1, 1, 2])
            return pool[torch.randint(0, len(pool), (numel,), generator=g)].to(dtype)
        v = torch.randint(-32, 33, (numel,), generator=g)
        return v.to(dtype) / 4 if dtype.is_floating_point else v.to(dtype)

    def check(what, ours, theirs):
        for a, b in zip(ours, theirs, strict=True):
            if a.dtype != b.dtype or not torch.equal(a, b):
                bad.append(f"rank {rank}/{n}: {what}: {a[:6].tolist()} vs gloo {b[:6].tolist()}")
                return

    def opts(kind, op=None, root=None):
        o = kind()
        if op is not None:
            o.reduceOp = op
        if root is not None:
            o.rootRank = root
        return o

    R = dist.ReduceOp
    for dtype in (getattr(torch, d) for d in DTYPES):
        ops = [R.SUM, R.MAX, R.MIN, R.PRODUCT] + ([R.AVG] if dtype.is_floating_point else [])
        for numel in NUMELS:
            what = f"{dtype} x {numel}"
            for op in ops:   # all-reduce, every op; AVG against gloo's SUM / N
                x = data(dtype, numel, factors=op == R.PRODUCT)
                a, b = x.clone(), x.clone()
                shm.allreduce([a], opts(dist.AllreduceOptions, op)).wait()
                gloo.allreduce([b], opts(dist.AllreduceOptions, R.SUM if op == R.AVG else op)).wait()
                check(f"all_reduce {op} {what}", [a], [b / n if op == R.AVG else b])
            x = data(dtype, 2 * numel).view(2, numel).t()   # non-contiguous, in place
            a, b = x.clone().t().contiguous().t(), x.clone().t().contiguous().t()
            shm.allreduce([a]).wait()
            gloo.allreduce([b]).wait()
            check(f"all_reduce non-contiguous {what}", [a], [b])
            xs = [data(dtype, numel), data(dtype, 3)]        # coalesced
            a, b = [t.clone() for t in xs], [t.clone() for t in xs]
            shm.allreduce_coalesced(a, dist.AllreduceCoalescedOptions()).wait()
            gloo.allreduce_coalesced(b, dist.AllreduceCoalescedOptions()).wait()
            check(f"all_reduce_coalesced {what}", a, b)
            x = data(dtype, numel)                           # all-gather: list and flat forms
            a, b = [torch.empty_like(x) for _ in range(n)], [torch.empty_like(x) for _ in range(n)]
            shm.allgather([a], [x]).wait()
            gloo.allgather([b], [x]).wait()
            check(f"all_gather (list) {what}", a, b)
            a, b = x.new_empty(n * numel), x.new_empty(n * numel)
            shm._allgather_base(a, x, AllgatherOptions()).wait()
            gloo._allgather_base(b, x, AllgatherOptions()).wait()
            check(f"all_gather (flat) {what}", [a], [b])
            y = data(dtype, 5)
            a, b = [x.new_empty(n * numel), y.new_empty(n * 5)], [x.new_empty(n * numel), y.new_empty(n * 5)]
            shm.allgather_into_tensor_coalesced(a, [x, y]).wait()
            for out, inp in zip(b, [x, y], strict=True):
                gloo._allgather_base(out, inp, AllgatherOptions()).wait()
            check(f"all_gather (coalesced) {what}", a, b)
            # reduce-scatter, against this rank's block of gloo's all-reduce of the whole input
            # (gloo's own reduce-scatter lacks the list form on torch 2.7, and its MAX is wrong on 2.8)
            def scattered(flat, op=R.SUM):
                whole = flat.clone()
                gloo.allreduce([whole], opts(dist.AllreduceOptions, op)).wait()
                block = flat.numel() // n
                return whole[rank * block:(rank + 1) * block]

            for op in (R.SUM, R.MAX):                      # list and flat forms
                ins = [data(dtype, numel) for _ in range(n)]
                flat = torch.cat(ins)
                a = torch.empty_like(ins[0])
                shm.reduce_scatter([a], [ins], opts(dist.ReduceScatterOptions, op)).wait()
                check(f"reduce_scatter (list) {op} {what}", [a], [scattered(flat, op)])
                shm._reduce_scatter_base(a, flat, opts(dist.ReduceScatterOptions, op)).wait()
                check(f"reduce_scatter (flat) {op} {what}", [a], [scattered(flat, op)])
            flats = [torch.cat([data(dtype, numel) for _ in range(n)]), data(dtype, 2 * n)]
            a = [torch.empty(numel, dtype=dtype), torch.empty(2, dtype=dtype)]
            shm.reduce_scatter_tensor_coalesced(a, flats, dist.ReduceScatterOptions()).wait()
            check(f"reduce_scatter (coalesced) {what}", a, [scattered(f) for f in flats])
            for root in range(n):                           # broadcast from every rank
                x = data(dtype, numel)
                a, b = x.clone(), x.clone()
                shm.broadcast([a], opts(dist.BroadcastOptions, root=root)).wait()
                gloo.broadcast([b], opts(dist.BroadcastOptions, root=root)).wait()
                check(f"broadcast from {root} {what}", [a], [b])
    shm.barrier().wait()
    if n == 1 and shm._seq:  # a group of one has nothing to exchange: nothing goes through the slab
        bad.append(f"1 rank: {shm._seq} collectives went through the slab")
    return bad


def _through_the_cluster_group() -> list[str]:
    """Inside a rank of a shm Cluster: dist.* on the cluster's own group (ddpkit's, over shm with
    1 MiB regions) at sizes above a region, against a plain gloo group."""
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    plain = dist.new_group(backend="gloo")
    x = torch.arange(300_001, dtype=torch.float64) * (rank + 1)     # 2.3 MiB: 3 chunks
    a, b = x.clone(), x.clone()
    dist.all_reduce(a)
    dist.all_reduce(b, group=plain)
    out_a, out_b = [torch.empty_like(x) for _ in range(n)], [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(out_a, x)
    dist.all_gather(out_b, x, group=plain)
    flat_a, flat_b = x.new_empty(n * x.numel()), x.new_empty(n * x.numel())
    dist.all_gather_into_tensor(flat_a, x)
    dist.all_gather_into_tensor(flat_b, x, group=plain)
    rs_a, rs_b = x.new_empty(x.numel() // n), x.new_empty(x.numel() // n)
    dist.reduce_scatter_tensor(rs_a, x[: n * (x.numel() // n)])
    dist.reduce_scatter_tensor(rs_b, x[: n * (x.numel() // n)], group=plain)
    c = x.clone()
    dist.broadcast(c, src=n - 1)
    pairs = [("all_reduce", a, b), ("all_gather", torch.cat(out_a), torch.cat(out_b)),
             ("all_gather_into_tensor", flat_a, flat_b), ("reduce_scatter_tensor", rs_a, rs_b),
             ("broadcast", c, torch.arange(300_001, dtype=torch.float64) * n)]
    return [f"rank {rank}: {name}" for name, p, q in pairs if not torch.equal(p, q)]


def _new_group() -> None:
    import torch.distributed as dist

    dist.new_group([0, 1])


# ---------------------------------------------------------------------- the collectives
@pytest.mark.parametrize("world_size", [1, 2, 4], ids=lambda n: f"{n}ranks")
def test_every_form_equals_gloo(cluster_of, world_size):
    bad = [b for rank_bad in cluster_of(world_size).run(_compare_every_form) for b in rank_bad]
    assert not bad, "\n".join(bad[:20])


@pytest.mark.parametrize("world_size", [2, 4], ids=lambda n: f"{n}ranks")
def test_every_form_staged_through_host_buffers_equals_gloo(cluster_of, world_size):
    # the path of ranks sharing a GPU with transport="shm", CPU tensors standing in for CUDA ones:
    # each is copied into a buffer of its own at the issue, the transport runs on those, and the
    # results are copied back before the future completes (the comparisons read them)
    bad = [b for rank_bad in cluster_of(world_size).run(_compare_every_form, True) for b in rank_bad]
    assert not bad, "\n".join(bad[:20])


@pytest.mark.parametrize("world_size", [2, 4], ids=lambda n: f"{n}ranks")
def test_a_shm_cluster_group_carries_big_tensors(shm_cluster_of, world_size):
    bad = [b for rank_bad in shm_cluster_of(world_size).run(_through_the_cluster_group) for b in rank_bad]
    assert not bad, bad


def test_the_cluster_runs_on_the_transport_it_was_given(shm_cluster_of):
    def backend_class():
        import torch
        import torch.distributed as dist

        from ddpkit import rankside

        group = dist.distributed_c10d._get_default_group()
        return type(group._get_backend(torch.device("cpu"))).__name__, rankside.backend(), rankside.transport()

    assert shm_cluster_of(2).run(backend_class) == [("ShmBackend", "gloo", "shm")] * 2
    with pytest.raises(ValueError, match="transport"):
        ddpkit.Cluster(2, backend="gloo", transport="tcp")


def _staged_under_ddpkits_group():
    """Inside a rank of a shm Cluster: a group of ddpkit's process group whose real backend is the
    staged transport (CPU tensors standing in), as a rank sharing a GPU builds it; its collectives
    give the right results, are counted, recorded and carried by an emulated link."""
    import time

    import torch
    import torch.distributed as dist

    from ddpkit import rankside
    from ddpkit.comm import process_group
    from ddpkit.comm.transport import HostStaged
    from ddpkit.network import Network
    from ddpkit.trace import Recorder
    from ddpkit.trace.seam import recording
    from solutions.collectives import ring_all_reduce

    built = process_group.build_real_backend
    process_group.build_real_backend = lambda *a, **k: HostStaged(built(*a, **k), devices=("cpu",))
    try:
        group = dist.new_group([0, 1])
    finally:
        process_group.build_real_backend = built
    rank, out = dist.get_rank(), {}
    out["staged"] = type(group._get_backend(torch.device("cpu"))).__name__  # torch holds the real one
    before = rankside.comm().snapshot()
    x = torch.arange(10.0) * (rank + 1)
    dist.all_reduce(x, group=group)
    y = torch.full((3,), float(rank))
    work = dist.all_reduce(y, group=group, async_op=True)
    work.wait()
    flat = torch.empty(4)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(rank)), group=group)
    part = torch.empty(2)
    dist.reduce_scatter_tensor(part, torch.arange(4.0) + rank, group=group)
    ring = torch.arange(7.0) * (rank + 1)
    ring_all_reduce(ring, group)  # the course's exercise: send and recv, which gloo takes for CPU tensors only
    out["results"] = [x.tolist(), y.tolist(), flat.tolist(), part.tolist(), ring.tolist()]
    after = rankside.comm().snapshot()
    out["counted"] = {op: after[(op, link)][0] - before.get((op, link), (0,))[0] for op, link in after
                      if after[(op, link)] != before.get((op, link))}
    rec = Recorder()
    with recording(rec):
        dist.all_reduce(torch.ones(8), group=group)
    out["recorded"] = [(r.name, r.nbytes) for r in rec.records if r.cat == "comm"]
    net = Network("10GbE")
    rankside.comm().set_network(net)
    try:
        z = torch.ones(2**18)  # 1 MiB
        t0 = time.perf_counter()
        dist.all_reduce(z, group=group, async_op=True).wait()  # bytes moved at the wait (at_wait)
        out["emulated"] = (time.perf_counter() - t0, net.collective_time("all_reduce", 2**20, 2), z[0].item())
    finally:
        rankside.comm().set_network(Network("loopback"))
    return out


def test_the_staged_transport_under_ddpkits_process_group_is_counted_recorded_and_emulated(cluster_of):
    for rank, out in enumerate(cluster_of(2).run(_staged_under_ddpkits_group)):
        assert out["staged"] == "ShmBackend"
        assert out["results"] == [[3.0 * i for i in range(10)], [1.0] * 3, [0.0, 0.0, 1.0, 1.0],
                                  [1.0 + 4 * rank, 3.0 + 4 * rank], [3.0 * i for i in range(7)]], out
        assert out["counted"] == {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}, out
        assert out["recorded"] == [("all_reduce", 32)]
        took, link, value = out["emulated"]
        assert value == 2.0 and took >= 0.9 * link, out["emulated"]


class _NotingSlab:
    """Stands in for a GPU slab (``device_slab.DeviceSlab``) on the CPU: notes each wait it is asked for."""

    def __init__(self, log):
        self.log, self.made = log, 0

    def inputs_ready(self):
        self.made += 1
        self.log.append(("inputs ready", self.made))
        return self.made

    def before_deposit(self, ready):
        self.log.append(("before deposit", ready))

    def settle(self):
        self.log.append(("settle",))


def _slab_waits() -> list:
    """Inside a rank: the waits a GPU slab is asked for around two collectives (the second in 3
    pieces, one per region), noted in order with the doorbells rung."""
    import torch

    shm, _ = _groups(chunk_bytes=64)
    log = []
    seg = shm._seg
    seg.data = _NotingSlab(log)
    ring = seg.ring

    def noting_ring(bells):
        log.append(("ring", "deposited" if bells is seg.deposited_out else "freed"))
        ring(bells)

    seg.ring = noting_ring
    shm.allreduce([torch.ones(4)]).wait()
    shm.allreduce([torch.ones(40)]).wait()  # 160 bytes: 3 pieces of at most 64
    return log


def test_a_gpu_slab_is_waited_for_before_every_doorbell(cluster_of):
    # on a GPU the copies and sums are queued on a stream: a peer that takes a doorbell must find
    # them done, and a piece deposited later, on another thread, must wait for its inputs
    for log in cluster_of(2).run(_slab_waits):
        rings = [i for i, e in enumerate(log) if e[0] == "ring"]
        assert len(rings) == 2 * (1 + 3)  # every piece: deposited, then freed
        assert all(log[i - 1] == ("settle",) for i in rings), log  # each after a settle
        deposits = [i for i in rings if log[i][1] == "deposited"]
        assert all(log[i - 2][0] == "before deposit" for i in deposits), log
        assert [log[i - 2][1] for i in deposits] == [1, 2, 2, 2]  # its collective's inputs event
        assert log.index(("inputs ready", 2)) < deposits[1]


def test_subgroups(shm_cluster_of):
    def job():
        import torch
        import torch.distributed as dist

        rank = dist.get_rank()
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]     # every rank creates every group
        cross = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        mine, other = pairs[rank // 2], cross[rank % 2]
        t, u = torch.tensor([float(rank)]), torch.tensor([float(rank)])
        w = dist.all_reduce(t, group=mine, async_op=True)
        dist.all_reduce(u, group=other)
        w.wait()
        gathered = [torch.empty(1) for _ in range(2)]
        dist.all_gather(gathered, torch.tensor([float(rank)]), group=other)
        return t.item(), u.item(), [g.item() for g in gathered]

    assert shm_cluster_of(4).run(job) == [(1.0, 2.0, [0.0, 2.0]), (1.0, 4.0, [1.0, 3.0]),
                                          (5.0, 2.0, [0.0, 2.0]), (5.0, 4.0, [1.0, 3.0])]


def test_async_collectives_complete_in_issue_order_whichever_is_waited_for_first(shm_cluster_of):
    def job():
        import torch
        import torch.distributed as dist

        rank, n = dist.get_rank(), dist.get_world_size()
        ts = [torch.full((1000 * (i % 3) + 1,), float(rank + i)) for i in range(12)]
        works = [dist.all_reduce(t, async_op=True) for t in ts]
        gathered = [torch.empty(3) for _ in range(n)]
        works.append(dist.all_gather(gathered, torch.full((3,), float(rank)), async_op=True))
        # rank 0 waits for the last first (its wait runs the queue up to it), rank 1 in order:
        # either way every rank runs them in issue order (else the fingerprints would disagree)
        for w in (reversed(works) if rank == 0 else works):
            w.wait()
        dist.barrier()
        ok = all(torch.equal(t, torch.full_like(t, sum(r + i for r in range(n)))) for i, t in enumerate(ts))
        # a callback that issues a collective and waits for it (as a comm hook may) runs on the
        # thread that completed the first one: the second must run there too, not deadlock
        u = torch.ones(1)
        chained = dist.all_reduce(torch.ones(1), async_op=True).get_future().then(
            lambda _: (dist.all_reduce(u), u.item())[1])
        return ok, [g[0].item() for g in gathered], all(w.is_completed() for w in works), chained.wait()

    for ok, gathered, completed, chained in shm_cluster_of(2).run(job):
        assert ok and gathered == [0.0, 1.0] and completed and chained == 2.0


def test_what_shm_does_not_carry_runs_on_gloo(shm_cluster_of):
    def job():
        import torch
        import torch.distributed as dist

        rank = dist.get_rank()
        flags = torch.tensor([0b1100 | rank])
        dist.all_reduce(flags, op=dist.ReduceOp.BAND)                  # a bitwise op: gloo's
        got = [None, None]
        dist.all_gather_object(got, {"rank": rank})                    # pickles over all-gathers
        out = [torch.empty(2) for _ in range(2)] if rank == 0 else None
        dist.gather(torch.full((2,), float(rank)), out, dst=0)         # rooted gather: gloo's
        return flags.item(), got, out and [o.tolist() for o in out]

    assert shm_cluster_of(2).run(job) == [(0b1100, [{"rank": 0}, {"rank": 1}], [[0.0, 0.0], [1.0, 1.0]]),
                                          (0b1100, [{"rank": 0}, {"rank": 1}], None)]


# ---------------------------------------------------------------------- faults and cleanup
def test_a_stuck_peer_is_an_error_at_the_timeout_and_the_group_stays_failed(cluster_of):
    def job():
        import time

        import torch
        import torch.distributed as dist

        shm, _ = _groups(timeout=1.0)
        if dist.get_rank() == 1:
            return None            # never joins the collective
        t0 = time.monotonic()
        errors = []
        for _ in range(2):
            try:
                shm.allreduce([torch.ones(4)]).wait()
            except dist.DistError as exc:
                errors.append(str(exc))
        return time.monotonic() - t0, errors

    elapsed, errors = cluster_of(2).run(job)[0]
    assert 1.0 <= elapsed < 5.0, elapsed
    assert "timed out" in errors[0] and "rank(s) [1]" in errors[0], errors
    assert "failed earlier" in errors[1], errors


def test_ranks_that_issue_different_collectives_get_an_error_not_garbage(cluster_of):
    def job():
        import torch
        import torch.distributed as dist

        shm, _ = _groups(timeout=5.0)
        try:
            shm.allreduce([torch.ones(8 * (dist.get_rank() + 1))]).wait()
        except dist.DistError as exc:
            return str(exc)
        return "no error"

    for text in cluster_of(2).run(job):
        assert "disagree" in text, text


def test_a_dead_peer_is_an_error_within_a_second_not_a_hang():
    with ddpkit.Cluster(2, backend="gloo", transport="shm", timeout=30.0) as c:
        def job():
            import os

            import torch
            import torch.distributed as dist

            if dist.get_rank() == 1:
                os._exit(3)
            dist.all_reduce(torch.ones(4))

        t0 = time.monotonic()
        with pytest.raises(RankError) as info:
            c.run(job)
        assert time.monotonic() - t0 < 20.0       # the restart included; the timeout is 30 s
        assert 1 in info.value.failures and "died" in info.value.failures[1]
        went_down = info.value.affected.get(0, "")   # rank 0's own error: its peer died, seen at once
        assert "rank 1 of this group" in went_down and "died" in went_down, str(info.value)
        assert c.run(lambda: ddpkit.rank()) == [0, 1]   # restarted, usable


def test_dev_shm_keeps_nothing_while_running_after_a_kill_and_after_shutdown():
    c = ddpkit.Cluster(2, backend="gloo", transport="shm", timeout=TIMEOUT)
    first = c._workers.shm_prefix
    try:
        c.run(_new_group)
        assert _leftovers(first) == []   # every group unlinked its names once all ranks had them
        # what a rank killed while setting up a group would leave behind
        for name in (f"{first}deadbeefm", f"sem.{first}deadbeefs0"):
            open(os.path.join(SHM_DIR, name), "wb").close()
        os.kill(c.ranks[1].pid, signal.SIGKILL)
        c._workers.procs[1].wait()
        with pytest.raises(RuntimeError, match="dead"):
            c.run(lambda: None)
        c.restart()
        assert _leftovers(first) == []
        second = c._workers.shm_prefix
        assert second != first and c.run(lambda: ddpkit.rank()) == [0, 1]
    finally:
        c.shutdown()
    assert _leftovers(second) == []


# ---------------------------------------------------------------------- strategies on shm
EQUIVALENCE = [eq.Case(s, 2, "mlp", "sgd") for s in ("naive", "bucketed", "overlapped", "sharded_optimizer",
                                                      "zero1", "zero2", "fsdp", "torch_ddp", "torch_zero",
                                                      "torch_fsdp")]
EQUIVALENCE += [eq.Case("overlapped", 2, "gpt", "adamw"), eq.Case("torch_fsdp", 2, "gpt", "adamw"),
                eq.Case("hsdp", 4, "mlp", "sgd"), eq.Case("torch_hsdp", 4, "mlp", "sgd")]


@pytest.mark.parametrize("case", EQUIVALENCE, ids=str)
def test_strategies_equal_one_process_on_shm(shm_cluster_of, case):
    eq.test_equal_to_single_process(shm_cluster_of, case)
