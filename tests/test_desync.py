"""A hang is diagnosed, not timed out: the flight recorder, the diagnosis, ``DesyncError``, the view.

The seeded faults run on a Cluster whose collective timeout is 60 s: each must end in
``DesyncError`` within 10 s (detection, stopping and restarting the ranks included), naming the
collective and what each rank issued there, and the next job must run. They use their own
Cluster (never the shared ``cluster_of`` ones): every fault restarts its ranks.
"""
from __future__ import annotations

import os
import time

import pytest

import ddpkit
from ddpkit.comm import flight
from ddpkit.cluster import Cluster, RankError, jobs
from ddpkit.comm.desync import RankView, diagnose
from ddpkit.comm.flight import Entry, FlightRecorder

TIMEOUT = 60.0    # the issue's setting: detection must not depend on it
WITHIN_S = 10.0   # ... and must come well before it


@pytest.fixture(scope="module")
def c60():
    c = Cluster(world_size=2, backend="gloo", timeout=TIMEOUT)
    yield c
    c.shutdown()


def _usable(c):
    assert c.run(lambda: ddpkit.rank()) == [0, 1]


def _desync(c, job, *args):
    start = time.monotonic()
    with pytest.raises(ddpkit.DesyncError) as info:
        c.run(job, *args)
    took = time.monotonic() - start
    return info.value, took


# ---------------------------------------------------------------------- the flight recorder
def test_the_ring_keeps_the_newest_collectives(tmp_path):
    import torch

    fr = FlightRecorder(slots=8)
    world = fr.new_group([0, 1])
    for i in range(1, 13):
        fr.issue(world, i, "all_reduce", 4 * i, torch.float32, None)
    path = tmp_path / "ring"
    path.write_bytes(bytes(fr.buf))
    job, entries = flight.read(str(path), os.getpid())
    assert [e.index for e in entries] == list(range(5, 13))  # the newest 8, oldest first
    e = entries[-1]
    assert (e.key, e.op, e.nbytes, e.dtype, e.labels) == (((0, 1), 0), "all_reduce", 48, "float32", "")
    assert flight.read(str(path), pid=os.getpid() + 1) is None  # another process's ring: not this rank's


def test_a_slot_written_as_int64s_is_the_slot_pack_into_writes():
    """``issue`` stores a slot through an int64 view of the ring (``FlightRecorder._use``): byte for byte
    what ``_SLOT.pack_into`` writes (the path of a big-endian machine), the two seqs, the bytes, index and text."""
    import torch

    rings = []
    for view in (True, False):
        fr = FlightRecorder(slots=4)
        if not view:
            fr._q = None
        group = fr.new_group([0, 1])
        for i, nbytes in enumerate([0, 4, 2**40, 12, 7], start=1):  # wraps the ring of 4
            fr.issue(group, i, "all_gather" if i % 2 else "all_reduce", nbytes, torch.float16, None)
        rings.append(bytes(fr.buf))
    assert rings[0] == rings[1]
    assert flight._SLOT.unpack_from(rings[0], flight._HEADER_SIZE + 32 * 3) == (3, 2**40, 3, 0, 3)


def test_a_group_is_named_alike_by_its_members_though_each_rank_makes_only_its_own():
    # 4 ranks, pairs as hybrid sharding makes them: rank 0 creates (0, 1), rank 2 creates (2, 3)
    rank0, rank2 = FlightRecorder(slots=4), FlightRecorder(slots=4)
    for fr, pair in ((rank0, (0, 1)), (rank2, (2, 3))):
        fr.new_group(range(4))
        fr.new_group(pair)
    again0, again2 = rank0.new_group(range(4)), rank2.new_group(range(4))  # a second group of every rank
    assert rank0.groups[again0] == rank2.groups[again2] == ((0, 1, 2, 3), 1)


def test_a_slot_read_while_it_is_written_is_skipped(tmp_path):
    import torch

    fr = FlightRecorder(slots=4)
    fr.issue(fr.new_group([0]), 1, "barrier", 0, torch.float32, None)
    buf = bytearray(fr.buf)
    end = flight._HEADER_SIZE + 2 * flight._SLOT.size - 8  # slot 1's closing seq: half written
    buf[end:end + 8] = (99).to_bytes(8, "little")
    (tmp_path / "ring").write_bytes(bytes(buf))
    assert flight.read(str(tmp_path / "ring"))[1] == []


def test_the_users_line_is_found_in_a_traceback_a_stack_or_a_fatal_errors_dump():
    import torch

    torch_file = os.path.join(os.path.dirname(torch.__file__), "distributed", "distributed_c10d.py")
    ddpkit_dir = os.path.dirname(ddpkit.__file__)
    strategy = os.path.join(ddpkit_dir, "strategies", "overlapped.py")
    worker = os.path.join(ddpkit_dir, "cluster", "worker.py")
    traceback_text = (f'Traceback (most recent call last):\n  File "/home/me/train.py", line 12, in job\n'
                      f'    loss.backward()\n  File "{strategy}", line 107, in _sync_gradients\n'
                      f'  File "{torch_file}", line 3252, in all_reduce\n    work.wait()\nRuntimeError: timed out')
    assert flight.where_in(traceback_text) == ("/home/me/train.py", 12, "job", "overlapped.py: _sync_gradients")
    dump = (f'Thread 0x7f (most recent call first):\n  File "{torch_file}", line 3252 in all_reduce\n'
            f'  File "/home/me/train.py", line 9 in skip\n  File "{worker}", line 270 in main\n')
    assert flight.where_in(dump) == ("/home/me/train.py", 9, "skip", "")
    # a ddpkit function run as the job: its outermost ddpkit frame
    only_ddpkit = (f'  File "{worker}", line 270, in main\n  File "{strategy}", line 107, in _sync_gradients\n'
                   f'  File "{torch_file}", line 3252, in all_reduce\n')
    assert flight.where_in(only_ddpkit)[:3] == (strategy, 107, "_sync_gradients")
    assert flight.where_in("no frames here") is None


# ---------------------------------------------------------------------- the diagnosis, by itself
WORLD = ((0, 1), 0)  # the default group of 2 ranks: (its ranks, ordinal)


def _e(index, op="all_reduce", nbytes=4096, group=0, ranks=(0, 1), via="", seq=None):
    return Entry(seq or index, group, index, nbytes, op, "float32", ranks, "", "job.py", 7, "job", via)


def test_different_collectives_at_one_index_are_a_mismatch():
    views = [RankView(0, "running", [_e(1), _e(2), _e(3, nbytes=12)], (WORLD, 3), 1.2),
             RankView(1, "died", [_e(1), _e(2), _e(3, nbytes=16)], note="killed by signal SIGABRT")]
    d = diagnose(views)
    assert (d.kind, d.index, d.issued[0].nbytes, d.issued[1].nbytes) == ("mismatch", 3, 12, 16)
    text = d.explain()
    assert text.startswith("desync at collective #3 of the default group (ranks 0, 1): the ranks issued different")
    assert "rank 0: all_reduce of 12 B float32, at job.py:7 in job; waiting in it for 1.2 s" in text
    assert "rank 1: all_reduce of 16 B float32" in text and "it died: killed by signal SIGABRT" in text
    assert "  >  3  all_reduce 12 B" in text  # the lanes, the parted index marked


def test_a_rank_that_finished_while_another_waits_parted_it_and_join_is_suggested_for_ddp():
    via = "overlapped.py: _grad_ready_hook"
    views = [RankView(0, "running", [_e(i, via=via) for i in range(1, 5)], (WORLD, 4), 2.0),
             RankView(1, "finished", [_e(i, via=via) for i in range(1, 4)])]
    d = diagnose(views)
    assert (d.kind, d.index, d.issued[1]) == ("finished", 4, None)
    text = d.explain()
    assert "rank 1 had finished its job and will never issue it" in text
    assert "rank 1: issued nothing there: it finished its job after collective #3" in text
    assert "use Join" in text and "via overlapped.py: _grad_ready_hook" in text
    # without a DDP wrapper there is no Join to use: the hint says to even out the steps
    plain = diagnose([RankView(0, "running", [_e(1), _e(2)]), RankView(1, "finished", [_e(1)])])
    assert plain.kind == "finished" and "use Join" not in plain.explain()  # found without a stuck report too


def test_ranks_blocked_in_collectives_the_others_never_issue_are_a_deadlock():
    # the wrong process group: rank 0 all-reduces on group 1, rank 1 on the default group
    views = [RankView(0, "running", [_e(1), _e(1, group=1, seq=2)], (((0, 1), 1), 1), 1.5),
             RankView(1, "running", [_e(1), _e(2, seq=2)], (WORLD, 2), 1.5)]
    d = diagnose(views)
    assert d.kind == "deadlock" and (d.key, d.index) == (((0, 1), 1), 1)
    assert d.summary() == "desync at collective #1 of group 1 of ranks 0, 1"
    assert "it is waiting in collective #2 of the default group" in d.describe(1)


def test_a_straggler_has_not_parted_and_a_failure_is_not_a_desync():
    waiting, computing = RankView(0, "running", [_e(1), _e(2)], (WORLD, 2), 5.0), RankView(1, "running", [_e(1)])
    assert diagnose([waiting, computing]) is None  # rank 1 may still issue #2: the timeout decides
    assert diagnose([waiting, RankView(1, "stopped", [_e(1)])]) is None
    failed = diagnose([waiting, RankView(1, "failed", [_e(1)], note="ValueError: no")])
    assert failed.kind == "failed" and failed.index == 2  # a RankError; rank 0 is stopped at once


def test_a_ring_that_dropped_a_groups_collectives_is_not_read_as_never_having_issued_them():
    # rank 1 finished a job of many collectives on a group of its own (timing a wrapper alone): its
    # ring (the newest SLOTS) holds none of the default group's; rank 0, slower, is still on its own
    own = [_e(i, group=0, ranks=(1,), seq=600 + i) for i in range(1, 513)]
    running = RankView(0, "running", [_e(1), _e(2)] + [_e(i, ranks=(0,), seq=2 + i) for i in range(1, 50)])
    assert diagnose([running, RankView(1, "finished", own)]) is None
    # with its first collectives still in the ring, none of the group's there means none issued
    kept_all = [_e(i, ranks=(1,), seq=i) for i in range(1, 9)]
    assert diagnose([running, RankView(1, "finished", kept_all)]).kind == "finished"


def test_collective_failures_and_timeouts_count_as_a_broken_group():
    for message in ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer",
                    "RuntimeError: Timed out waiting 60000ms for send operation to complete",
                    "RuntimeError: [/gloo/transport/tcp/unbound_buffer.cc:81] Application timeout caused pair closure",
                    "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970"):
        assert jobs.broke_the_group("Traceback (most recent call last):\n  ...\n" + message), message
    assert not jobs.broke_the_group("Traceback (most recent call last):\nValueError: bad shape")


# ---------------------------------------------------------------------- seeded faults on a Cluster
def test_a_skipped_all_reduce_is_a_desync_within_seconds(c60):
    def skip_one():
        import torch
        import torch.distributed as dist

        for i in range(5):
            if dist.get_rank() == 1 and i == 2:
                continue  # rank 1 skips the third all-reduce; from then on the sizes differ
            dist.all_reduce(torch.ones(1000 * (i + 1)))

    err, took = _desync(c60, skip_one)
    assert took < WITHIN_S, took
    assert isinstance(err, RankError) and (err.index, err.group) == (3, (0, 1))
    assert err.diagnosis.kind == "mismatch"
    assert (err.diagnosis.issued[0].nbytes, err.diagnosis.issued[1].nbytes) == (12000, 16000)
    text = str(err)
    assert text.startswith("desync at collective #3 of the default group (ranks 0, 1)")
    assert "dist.all_reduce(torch.ones(1000 * (i + 1)))" in text  # the line that issued it
    assert text.index("desync at") < text.index("--- rank") and "restarted its ranks" in text
    _usable(c60)


def test_a_different_op_on_each_rank_is_a_desync_not_a_hang(c60):
    def all_reduce_or_all_gather():
        import torch
        import torch.distributed as dist

        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(1000))
        else:  # the same 4000 bytes, another collective
            dist.all_gather_into_tensor(torch.empty(1000), torch.ones(500))

    err, took = _desync(c60, all_reduce_or_all_gather)
    assert took < WITHIN_S, took
    d = err.diagnosis
    assert (d.kind, d.index, d.issued[0].op, d.issued[1].op) == ("mismatch", 1, "all_reduce", "all_gather")
    assert d.issued[0].nbytes == d.issued[1].nbytes == 4000
    if c60.transport == "gloo":  # both waited; the watchdog's report says where (their stacks)
        assert "waiting in it for" in d.describe(0) and "where it was waiting" in err.failures[1]
    else:  # shared memory compares the ranks' collectives itself, before any waiting
        assert "ranks disagree" in d.describe(0) and "ranks disagree" in err.failures[1]
    assert "all_gather_into_tensor" in err.failures[1]
    _usable(c60)


def _uneven(join: bool, steps: int = 3):
    def job():
        import torch
        import torch.distributed as dist
        from torch.distributed.algorithms import Join

        torch.manual_seed(0)
        model = ddpkit.OverlappedDDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        batches = [torch.randn(4, 8) for _ in range(steps - dist.get_rank())]  # rank 1: one fewer
        with Join([model], enable=join):
            for x in batches:
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()
        return [p.detach().clone() for p in model.parameters()]
    return job


def test_uneven_inputs_without_join_are_a_desync_and_the_next_run_works(c60):
    old = [r.pid for r in c60.ranks]
    err, took = _desync(c60, _uneven(join=False))
    assert took < WITHIN_S, took
    d = err.diagnosis
    assert d.kind == "finished" and d.issued[1] is None and d.issued[0].op == "all_reduce"
    assert "finished its job after collective" in d.describe(1)
    assert "use Join" in str(err) and d.issued[0].via.split(":")[0] in ("overlapped.py", "ddp_module.py")
    assert [r.pid for r in c60.ranks] != old  # the ranks were restarted before run() returned ...
    _usable(c60)                                # ... so the next run works (it used to time out too)
    a, b = c60.run(_uneven(join=True))          # and Join is the fix: the ranks end equal
    assert all((p - q).abs().max() == 0 for p, q in zip(a, b, strict=True))


def test_torch_ddp_uneven_inputs_are_found_without_a_stuck_report(c60):
    def job():  # torch's DDP drops its Work handles: the rule "it finished, you issued more" finds it
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(torch.nn.Linear(8, 1))
        for _ in range(3 - dist.get_rank()):
            model(torch.randn(4, 8)).sum().backward()

    err, took = _desync(c60, job)
    assert took < WITHIN_S, took
    assert err.diagnosis.kind == "finished" and "finished its job" in err.diagnosis.describe(1)
    _usable(c60)


def test_the_wrong_process_group_is_a_deadlock(c60):
    def job():
        import torch
        import torch.distributed as dist

        other = dist.new_group([0, 1])  # the same ranks, another group (its own sequence)
        dist.all_reduce(torch.ones(4), group=other if dist.get_rank() == 0 else None)

    err, took = _desync(c60, job)
    assert took < WITHIN_S, took
    d = err.diagnosis
    assert d.kind == "deadlock" and d.issued[0] is not None and d.issued[1] is None
    assert "waiting in collective" in d.describe(1)
    _usable(c60)


def test_a_slow_rank_is_not_a_desync(c60):
    def job():
        import torch
        import torch.distributed as dist

        if dist.get_rank() == 1:
            time.sleep(flight.STALL_S + 1.0)  # rank 0 waits past the stall and is reported stuck
        t = torch.ones(2)
        dist.all_reduce(t)
        return t.tolist()

    assert c60.run(job) == [[2.0, 2.0], [2.0, 2.0]]


def test_on_nccl_a_failed_job_restarts_the_ranks(c60, monkeypatch):
    # NCCL keeps the collectives a failed job queued: no other rank will match them. Faked here.
    monkeypatch.setattr(jobs.Job, "backend", property(lambda self: "nccl"))
    old = [r.pid for r in c60.ranks]
    with pytest.raises(RankError) as info:
        c60.run(lambda: 1 / 0)
    assert "on NCCL a failed job leaves collectives queued" in str(info.value)
    assert [r.pid for r in c60.ranks] != old
    _usable(c60)


# ---------------------------------------------------------------------- the widget
def test_the_widget_draws_the_lanes_and_marks_the_rows(c60):
    from ddpkit.widget import ClusterWidget
    from ddpkit.widget.desync_view import desync_view

    w = ClusterWidget(c60, cell_output=None)
    try:
        def job():
            import torch
            import torch.distributed as dist

            dist.all_reduce(torch.ones(1 + dist.get_rank()))  # shapes differ: 4 vs 8 bytes

        with pytest.raises(ddpkit.DesyncError) as info:
            c60.run(job)
        k = info.value.index
        rows = [s.value for s in w.ranks.status]
        assert all(f"desync at collective #{k}" in row and "ddpkit-failed" in row for row in rows)
        svg = w.desync.value
        assert w.desync.layout.display is None and svg.startswith("<svg") and svg == desync_view(info.value.diagnosis)
        assert "ddpkit-parted" in svg and f"#{k}" in svg and svg.count("ddpkit-collective") >= 2
        assert "rank 0" in svg and "rank 1" in svg
        assert "The last desync" in w.desync_note.value and "a lambda" not in w.desync_note.value
        assert "<code>job</code>" in w.desync_note.value  # the run it came from
        _usable(c60)  # the next job clears the rows; the lanes stay (notebook 10 scrolls back to them)
        assert w.desync.layout.display is None and w.desync.value == svg
        assert not any("desync at" in s.value for s in w.ranks.status)
    finally:
        w.close()


def test_the_view_says_why_a_rank_issued_nothing():
    from ddpkit.widget.desync_view import desync_view

    d = diagnose([RankView(0, "running", [_e(1), _e(2)], (WORLD, 2), 1.0), RankView(1, "finished", [_e(1)])])
    svg = desync_view(d)
    assert "finished its job" in svg and "ddpkit-missing" in svg and svg.count("ddpkit-collective") == 3
