"""The Cluster: jobs, results, errors, output, life cycle, bad input, stale imports, %%ranks."""
from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import threading
import time
from types import SimpleNamespace

import psutil

import pytest
import torch

import ddpkit
from ddpkit import magic
from ddpkit.cluster import Cluster, RankError


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


# ---------------------------------------------------------------------- jobs and results
def test_results_in_rank_order_with_closures_lambdas_and_kwargs(cluster_of):
    c = cluster_of(2)
    offset = 100  # captured by the closure below, shipped by value

    def job(scale, *, extra=0):
        return (ddpkit.rank(), ddpkit.rank() * scale + offset + extra)

    assert c.run(job, 10, extra=5) == [(0, 105), (1, 115)]
    assert c.run(lambda: ddpkit.world_size()) == [2, 2]
    assert c.last_results == [2, 2]
    assert c.backend == "gloo" and c.devices == ["cpu", "cpu"]
    assert c.run(lambda: str(ddpkit.device())) == ["cpu", "cpu"]


# ---------------------------------------------------------------------- the recording switch
def _every_keyword(fn=None, args=None, kwargs=None, record=None, recorder=None, interval_s=None, **more):
    """Keyword names the recording switch uses itself must still reach the job."""
    return dict(fn=fn, args=args, kwargs=kwargs, record=record, recorder=recorder, interval_s=interval_s,
                **more)


def test_every_keyword_reaches_the_job_with_recording_on_or_off(cluster_of):
    c = cluster_of(2)
    kw = dict(fn=1, args=2, kwargs=3, record=4, recorder=5, interval_s=6, runner=7)
    assert c.run(_every_keyword, **kw) == [kw, kw]
    with c.recording():
        assert c.run(_every_keyword, **kw) == [kw, kw]


def _train_recorded(steps):
    """Trains with a strategy built without a recorder: it records into the rank's recorder."""
    from ddpkit.experiment import local_batch, train_step
    from ddpkit.models import build_model
    from ddpkit.trace.seam import recorder

    module = build_model("mlp", seed=0, width=16, depth=3)
    model = ddpkit.OverlappedDDP(module, bucket_cap_mb=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        train_step(model, opt, *local_batch(module, 8, step, ddpkit.rank(), ddpkit.world_size()))
    return type(recorder()).__name__, getattr(recorder(), "rank", None)


def test_recording_is_one_switch_and_run_returns_what_the_job_returned(cluster_of):
    c = cluster_of(2)
    assert not c.record and c.run(_train_recorded, 1) == [("NullRecorder", None)] * 2
    seen = []
    c.subscribe(lambda kind, rank, **f: seen.append((kind, f.get("on"))) if kind == "recording" else None)
    with c.recording() as same:
        assert same is c and c.record
        results = c.run(_train_recorded, 3)
    assert not c.record and seen == [("recording", True), ("recording", False)]
    assert results == [("Recorder", 0), ("Recorder", 1)]  # exactly what the job returned
    trace = c.last_trace
    assert trace.ranks == [0, 1] and trace.steps == [0, 1, 2] and trace.world_size == 2
    # every strategy built inside recorded: 4 buckets of the 4 Linears' 8 tensors, per step and rank
    assert len(trace.select(step=1, rank=0, cat="comm")) == 8
    assert len(trace.select(cat="grad_ready")) == 3 * 8 * 2
    assert {r.name for r in trace.select(cat="compute")} == {"forward", "backward", "sync", "step"}
    assert len(trace.select(cat="loss")) == 6
    # memory: two samples (end of forward, after the step) in the first step, then when due
    assert len(trace.select(step=0, cat="memory")) == 4
    # a later run without recording keeps the last recorded trace
    assert c.run(ddpkit.rank) == [0, 1] and c.last_trace is trace


def test_jobs_that_record_by_hand_still_work_when_the_cluster_records(cluster_of):
    def job():
        from ddpkit.trace import Recorder

        rec = Recorder()
        model = ddpkit.NaiveDDP(torch.nn.Linear(4, 4), recorder=rec)
        rec.next_step()
        model(torch.ones(2, 4)).sum().backward()
        model.finish_gradient_synchronization()
        return rec.trace()

    c = cluster_of(2)
    with c.recording():
        traces = c.run(job)
    assert [len(t.select(cat="comm")) for t in traces] == [2, 2]  # the job's own recorder got them
    # ddpkit's process group sees every collective, so the cluster's trace has them too (with the
    # construction's checks and broadcasts, which the job's recorder did not watch)
    assert len(c.last_trace.select(cat="comm", name="all_reduce")) == 2 * 2


def test_a_failed_recorded_run_keeps_what_was_recorded(cluster_of):
    def job():
        from ddpkit.trace.seam import recorder

        recorder().next_step()
        recorder().loss(1.5)
        if ddpkit.rank() == 0:
            raise RuntimeError("stop here")

    c = cluster_of(2)
    with pytest.raises(RankError, match="stop here"), c.recording():
        c.run(job)
    assert [r.rank for r in c.last_trace.select(cat="loss")] in ([0, 1], [1, 0])


def test_process_group_is_usable_in_a_job(cluster_of):
    def job():
        t = torch.tensor([float(ddpkit.rank() + 1)])
        torch.distributed.all_reduce(t)
        out = [None, None]
        torch.distributed.all_gather_object(out, ddpkit.rank() * 10)
        return t.item(), out

    assert cluster_of(2).run(job) == [(3.0, [0, 10])] * 2


def test_rank_error_names_the_rank_carries_the_remote_traceback_and_the_cluster_recovers(cluster_of):
    c = cluster_of(2)
    pids = [r.pid for r in c.ranks]

    def fails_on_rank_1():
        if ddpkit.rank() == 1:
            raise ValueError("boom on one")
        return "fine"

    with pytest.raises(RankError) as info:
        c.run(fails_on_rank_1)
    err = info.value
    assert err.ranks == [1] and list(err.failures) == [1]
    assert "ValueError: boom on one" in err.failures[1]
    assert "fails_on_rank_1" in err.failures[1]  # the remote frame, not just the message
    assert "rank 1 failed" in str(err) and "ready for the next run()" in str(err)
    assert c.run(lambda: ddpkit.rank()) == [0, 1]
    assert [r.pid for r in c.ranks] == pids  # a plain Python error needs no restart


def test_output_reaches_the_caller_prefixed_with_the_rank(cluster_of, capsys):
    def job():
        print("hello from", ddpkit.rank())
        print("to stderr", file=sys.stderr)

    cluster_of(2).run(job)
    out, err = capsys.readouterr()
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out
    assert "[rank 0] to stderr" in err and "[rank 1] to stderr" in err


def test_progress_and_results_reach_subscribers(cluster_of):
    c = cluster_of(2)
    events = []
    c.subscribe(lambda kind, rank, **f: events.append((kind, rank, f)))

    def job():
        for i in range(3):
            ddpkit.progress(i + 1, 3)

    c.run(job)
    progress = [(r, f["done"]) for k, r, f in events if k == "progress"]
    assert sorted(progress) == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    assert [r.progress for r in c.ranks] == [(3, 3), (3, 3)]
    assert any(k == "results" for k, _, _ in events)
    assert [k for k, _, _ in events].count("status") >= 4  # running and idle, per rank
    c._events.observers.clear()


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, words", [
    (dict(world_size=0), "world_size"), (dict(world_size=-2), "world_size"),
    (dict(world_size=1.5), "world_size"), (dict(world_size=True), "world_size"),
    (dict(backend="mpi"), "unknown backend"), (dict(timeout=0), "timeout"),
    (dict(threads_per_rank=-1), "threads_per_rank"), (dict(threads_per_rank=1.5), "threads_per_rank"),
])
def test_bad_arguments_fail_before_anything_starts(kwargs, words):
    before = _children()
    with pytest.raises(ValueError, match=words):
        Cluster(**kwargs)
    assert _children() == before


def test_ranks_split_the_cpu_threads_between_them(cluster_of):
    # N ranks each with one thread per core would oversubscribe the cores (20x slower steps
    # on 2 cores); by default each rank gets cores // N threads, at least one.
    cluster = cluster_of(2)
    expected = max(1, (os.cpu_count() or 1) // 2)
    assert cluster.threads_per_rank == expected
    assert cluster.run(torch.get_num_threads) == [expected, expected]
    with Cluster(1, backend="gloo", threads_per_rank=1) as one:
        assert one.run(torch.get_num_threads) == [1]


def test_pinned_ranks_each_run_on_cores_of_their_own_and_keep_them_after_a_restart():
    usable = sorted(os.sched_getaffinity(0))
    before = _children()
    with pytest.raises(ValueError, match="a core per rank"):  # refused before any rank starts
        Cluster(len(usable) + 1, pin_cores=True)
    assert _children() == before

    def cores():
        import threading

        seen = {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}
        return sorted(os.sched_getaffinity(0)), seen, threading.active_count() > 1

    with Cluster(2, pin_cores=True) as c:
        k = len(usable) // 2
        expected = [usable[:k], usable[k:2 * k]]
        assert [list(x) for x in c.cores] == expected
        for _ in range(2):  # and again after a restart
            got = c.run(cores)
            assert [mine for mine, _, _ in got] == expected
            # every thread the rank started (the process group's, the link's) inherited them
            assert all(threads == {tuple(mine)} and more for mine, threads, more in got), got
            c.restart()
    with Cluster(2) as free:  # the default leaves the scheduler free
        assert free.cores is None and all(mine == usable for mine, _, _ in free.run(cores))


def test_nccl_without_one_gpu_per_rank_is_refused():
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    before = _children()
    with pytest.raises(ValueError, match="one GPU per rank"):
        Cluster(world_size=gpus + 1, backend="nccl")
    assert _children() == before


def test_auto_picks_nccl_only_with_one_gpu_per_rank():
    from ddpkit.cluster import resolve_backend

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert resolve_backend("auto", gpus + 1) == "gloo"
    assert resolve_backend("gloo", 1) == "gloo"
    if gpus:
        assert resolve_backend("auto", gpus) == "nccl"


@pytest.mark.gpu
def test_an_nccl_cluster_puts_rank_r_on_cuda_r():
    gpus = torch.cuda.device_count()
    with Cluster(world_size=gpus, backend="auto", timeout=60.0) as c:
        assert c.backend == "nccl" and c.devices == [f"cuda:{r}" for r in range(gpus)]

        def job():
            t = torch.ones(4, device=ddpkit.device()) * (ddpkit.rank() + 1)
            torch.distributed.all_reduce(t)
            return str(t.device), t.sum().item()

        total = 4 * gpus * (gpus + 1) / 2
        assert c.run(job) == [(f"cuda:{r}", total) for r in range(gpus)]


# ---------------------------------------------------------------------- gpus=: which GPUs
@pytest.fixture
def eight_gpus(monkeypatch):
    """A machine that seems to have 8 CUDA GPUs (nothing here touches CUDA)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)


def test_gpus_names_the_ranks_gpus_and_defaults_to_the_first_visible(eight_gpus, monkeypatch):
    from ddpkit.cluster import check_arguments

    settings = check_arguments(2, gpus=[4, 5])
    assert (settings.backend, settings.gpus) == ("nccl", (4, 5))
    assert check_arguments(2, backend="nccl", gpus=(7, 0)).gpus == (7, 0)
    assert check_arguments(3).gpus == (0, 1, 2)  # auto, a GPU per rank: the first 3
    assert check_arguments(2, backend="gloo").gpus is None
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    one = check_arguments(2)  # one GPU for two ranks: NCCL refuses, so they share it on ddpkit's transport
    assert (one.backend, one.gpus, one.transport) == ("gloo", (0, 0), "cuda-ipc")


@pytest.mark.parametrize("gpus, message", [
    ([7, 8], r"no GPU 8 here; 8 GPU\(s\) are visible, numbered 0-7"),
    ([4], r"names 1 GPU\(s\) for world_size=2: one per rank"),
    ([4, 5, 6], r"names 3 GPU\(s\) for world_size=2"),
    ([-1, 0], "whole numbers >= 0"),
    (["4", 5], "whole numbers >= 0"),
    ("45", "a list of CUDA device indices"),
])
def test_bad_gpus_are_refused_before_any_rank_starts(eight_gpus, gpus, message):
    before = _children()
    with pytest.raises(ValueError, match=message):
        Cluster(2, gpus=gpus)
    assert _children() == before


def test_gpus_without_cuda_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = _children()
    for backend in ("auto", "gloo", "nccl"):
        with pytest.raises(ValueError, match=r"gpus=\[0, 1\]: this machine has no CUDA GPU"):
            Cluster(2, backend=backend, gpus=[0, 1])
    with pytest.raises(ValueError, match=r"gpus=\[0, 0\]: this machine has no CUDA GPU"):
        Cluster(2, gpus=[0, 0])
    assert _children() == before


# ---------------------------------------------------------------------- ranks sharing a GPU
@pytest.fixture
def gpus_here(monkeypatch):
    """``gpus_here(n)``: a machine that seems to have n CUDA GPUs and an NCCL without the multi-rank
    switch (nothing here touches CUDA)."""
    from ddpkit.cluster import placement

    def make(n: int, nccl=(2, 28, 9)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(placement, "nccl_version", lambda: nccl)
    return make


def test_ranks_share_a_gpu_asked_simply_or_when_auto_has_fewer_gpus_than_ranks(gpus_here):
    from ddpkit.cluster import check_arguments
    from ddpkit.cluster.placement import carried_by

    gpus_here(1)
    shared = check_arguments(4)  # the learner with one GPU: every rank on it, bytes through CUDA IPC
    assert (shared.backend, shared.gpus, shared.transport) == ("gloo", (0, 0, 0, 0), "cuda-ipc")
    assert check_arguments(4, gpus=[0, 0, 0, 0]) == shared
    assert carried_by(4, "gloo", (0, 0, 0, 0), "cuda-ipc") == "gloo, 4 ranks sharing GPU 0, bytes through CUDA IPC"
    for transport, words in (("shm", "shared memory, staged through pinned host memory"),
                             ("gloo", "gloo (it stages through the host)")):
        s = check_arguments(2, gpus=[0, 0], transport=transport)
        assert (s.backend, s.gpus, s.transport) == ("gloo", (0, 0), transport)
        assert carried_by(2, s.backend, s.gpus, s.transport) == f"gloo, 2 ranks sharing GPU 0, bytes through {words}"
    one = check_arguments(1)  # a GPU for the one rank: NCCL, as before
    assert (one.backend, one.gpus, one.transport) == ("nccl", (0,), "nccl")
    assert check_arguments(2, backend="gloo").gpus is None  # gloo without gpus= is the CPU, as before
    gpus_here(2)
    spread = check_arguments(4)  # rank r on GPU r % 2; one GPU's buffer cannot serve two: staged
    assert (spread.gpus, spread.transport) == ((0, 1, 0, 1), "shm")
    assert carried_by(4, "gloo", spread.gpus, "shm").startswith("gloo, 4 ranks sharing GPUs 0, 1, bytes through")
    # the CPU's and NCCL's words are as they were (the widget's header and compare's head line read them)
    assert carried_by(2, "gloo", None, "shm") == "gloo, bytes through shared memory"
    assert carried_by(2, "gloo", None, "gloo") == "gloo" and carried_by(2, "nccl", (0, 1), "nccl") == "nccl"


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=2, gpus=[0, 1], transport="cuda-ipc"), "'cuda-ipc' shares one GPU's buffer"),
    (dict(world_size=2, gpus=[0, 0], transport="nccl"), r"NCCL refuses that before 2\.30\.3 .*has 2\.28\.9"),
    (dict(world_size=2, gpus=[0, 0], backend="nccl"), "NCCL refuses that before 2.30.3"),
    (dict(world_size=3, backend="nccl"), r"one GPU per rank: 3 rank\(s\).*share the GPU: backend='auto', or gpus="
                                         r"\[0, 1, 0\]"),
    (dict(world_size=2, gpus=[0, 1], backend="nccl", transport="shm"), "backend='nccl' moves its own bytes"),
    (dict(world_size=2, transport="bogus"), "transport must be one of auto, shm, gloo, cuda-ipc, nccl"),
])
def test_what_does_not_fit_a_shared_gpu_is_refused_before_any_rank_starts(gpus_here, kwargs, message):
    gpus_here(2)
    before = _children()
    with pytest.raises(ValueError, match=message):
        Cluster(**kwargs)
    assert _children() == before


def test_cpu_ranks_take_no_gpu_transport(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for transport in ("cuda-ipc", "nccl"):
        with pytest.raises(ValueError, match=f"transport='{transport}' carries CUDA tensors, but these ranks run on "
                                             "the CPU"):
            Cluster(2, transport=transport)


def test_nccl_shares_a_gpu_only_when_asked_by_name_and_only_where_it_can(gpus_here):
    from ddpkit.cluster import check_arguments
    from ddpkit.cluster.placement import rank_environment

    gpus_here(1, nccl=(2, 30, 3))  # an NCCL with NCCL_MULTI_RANK_GPU_ENABLE
    assert check_arguments(2).transport == "cuda-ipc"  # never on by surprise: auto keeps ddpkit's transport
    s = check_arguments(2, transport="nccl")
    assert (s.backend, s.gpus, s.transport) == ("nccl", (0, 0), "nccl")
    assert rank_environment(s.gpus, s.transport) == {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    assert rank_environment((0, 1), "nccl") == {} and rank_environment((0, 0), "cuda-ipc") == {}


@pytest.mark.parametrize("fraction, gpus, message", [
    (0, [0, 0], r"in \(0, 1\]"), (1.5, [0, 0], r"in \(0, 1\]"), ("half", [0, 0], r"in \(0, 1\]"),
    (True, [0, 0], r"in \(0, 1\]"),
    (0.3, [0, 0, 0, 0], "0.3 for 4 ranks on one GPU asks for 1.20 of it; at most 0.250 each"),
    (0.5, None, "these ranks run on the CPU"),
])
def test_a_memory_cap_is_checked_before_any_rank_starts(gpus_here, fraction, gpus, message):
    gpus_here(1)
    before = _children()
    with pytest.raises(ValueError, match=message):
        Cluster(len(gpus or [0, 0]), backend="auto" if gpus else "gloo", gpus=gpus, memory_fraction=fraction)
    assert _children() == before


def test_a_memory_cap_reaches_each_rank_before_it_allocates(gpus_here, monkeypatch, no_rank_device):
    from ddpkit.cluster import check_arguments
    from ddpkit.cluster.events import Events
    from ddpkit.cluster.processes import Workers
    from ddpkit.cluster.rank_setup import join_device

    gpus_here(1)
    workers = Workers(Events())
    workers.settings = check_arguments(4, gpus=[0, 0, 0, 0], memory_fraction=0.25)
    workers.admission = SimpleNamespace(address=("127.0.0.1", 1), key=b"k")
    workers.store = SimpleNamespace(port=2)
    told = [workers.rank_settings(r) for r in range(4)]
    assert [(t.gpu, t.transport, t.memory_fraction) for t in told] == [(0, "cuda-ipc", 0.25)] * 4
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: calls.append(("device", torch.device(dev))))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda f, dev: calls.append(("cap", f, torch.device(dev))))
    assert join_device(told[3]) == "cuda:0"
    assert calls == [("device", torch.device("cuda", 0)), ("cap", 0.25, torch.device("cuda", 0))]


def test_each_rank_is_told_its_gpu_and_binds_it_before_joining(eight_gpus, monkeypatch, no_rank_device):
    from ddpkit import rankside
    from ddpkit.cluster import check_arguments
    from ddpkit.cluster.events import Events
    from ddpkit.cluster.processes import Workers
    from ddpkit.cluster.rank_setup import RankSettings, join_device

    workers = Workers(Events())
    workers.settings = check_arguments(2, gpus=[4, 5])
    workers.admission = SimpleNamespace(address=("127.0.0.1", 1), key=b"k")
    workers.store = SimpleNamespace(port=2)
    told = [RankSettings.from_json(workers.rank_settings(r).to_json()) for r in range(2)]  # as it travels
    assert [(t.rank, t.gpu, t.backend) for t in told] == [(0, 4, "nccl"), (1, 5, "nccl")]

    bound = []  # the worker's side, with CUDA patched out
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: bound.append(torch.device(dev)))
    assert join_device(told[1]) == "cuda:5"
    assert bound == [torch.device("cuda", 5)] and ddpkit.device() == torch.device("cuda", 5)
    rankside.set_device(None)
    assert join_device(dataclasses.replace(told[1], gpu=None)) == "cpu" and bound == [torch.device("cuda", 5)]


@pytest.mark.gpu
def test_a_cluster_on_the_gpus_named():
    n = torch.cuda.device_count()
    with Cluster(1, gpus=[n - 1]) as c:
        assert c.backend == "nccl" and c.gpus == (n - 1,) and c.devices == [f"cuda:{n - 1}"]
        assert c.run(lambda: str(ddpkit.device())) == [f"cuda:{n - 1}"]


def test_a_job_that_cannot_be_pickled_says_why_and_runs_nothing(cluster_of):
    c = cluster_of(2)
    lock = threading.Lock()
    with pytest.raises(TypeError, match=r"the function .*uses_a_lock.*lock"):
        c.run(_make_lock_user(lock))
    with pytest.raises(TypeError, match=r"argument 1 \(a lock\)"):
        c.run(lambda a, b: a, 1, lock)
    with pytest.raises(TypeError, match=r"keyword argument 'gen' \(a generator\)"):
        c.run(lambda gen=None: 1, gen=(i for i in range(3)))
    assert all(r.status in ("idle", "error") for r in c.ranks)
    assert c.run(lambda: 7) == [7, 7]


def _make_lock_user(lock):
    def uses_a_lock():
        return lock.locked()
    return uses_a_lock


def test_a_result_that_cannot_be_pickled_is_a_clear_error_and_the_cluster_is_fine(cluster_of):
    c = cluster_of(2)

    def returns_a_lock():
        import threading
        return threading.Lock() if ddpkit.rank() == 0 else "ok"

    with pytest.raises(RankError) as info:
        c.run(returns_a_lock)
    assert info.value.ranks == [0]
    assert "cannot be pickled" in info.value.failures[0] and "lock" in info.value.failures[0]
    assert c.run(lambda: "next") == ["next", "next"]


# ---------------------------------------------------------------------- life cycle
def test_restart_shutdown_and_context_manager():
    before = _children()
    with Cluster(world_size=1, backend="gloo", timeout=20.0) as c:
        first = c.ranks[0].pid
        assert c.run(lambda: ddpkit.rank()) == [0]
        c.restart()
        assert c.ranks[0].pid != first and not psutil.pid_exists(first)
        assert [r.status for r in c.ranks] == ["idle"]
        assert c.run(lambda: ddpkit.world_size()) == [1]
        second = c.ranks[0].pid
    assert [r.status for r in c.ranks] == ["stopped"]
    assert not psutil.pid_exists(second) and _children() == before
    with pytest.raises(RuntimeError, match="shut down"):
        c.run(lambda: 1)
    c.start()  # a stopped cluster starts again
    try:
        assert c.run(lambda: 2) == [2]
    finally:
        c.shutdown()


def test_a_cluster_nobody_refers_to_any_more_stops_its_ranks():
    import gc

    c = Cluster(world_size=1, backend="gloo", timeout=20.0)
    pid = c.ranks[0].pid
    assert c.run(lambda: 1) == [1]
    del c  # e.g. a notebook cell re-run: `cluster = Cluster(...)` replaces the old one
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and psutil.pid_exists(pid):
        time.sleep(0.05)
    assert not psutil.pid_exists(pid)


# ---------------------------------------------------------------------- stale imports
def test_the_learners_own_modules_ship_by_value_so_edits_reach_the_ranks(cluster_of, tmp_path,
                                                                          monkeypatch):
    # A module under the working directory, which the ranks (started elsewhere, with
    # another sys.path) could not even import: it must travel by value.
    name = f"learner_mod_{time.monotonic_ns()}"
    src = tmp_path / f"{name}.py"
    src.write_text("def answer():\n    return 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module(name)
    c = cluster_of(2)
    assert c.run(mod.answer) == [1, 1]
    assert c.run(lambda: mod.answer() + 10) == [11, 11]  # through a module reference too

    src.write_text("def answer():\n    return 2 + 0  # edited\n")  # another size: the .pyc is stale
    importlib.reload(mod)  # what %autoreload or exercises.use() does in the notebook
    assert c.run(mod.answer) == [2, 2]
    assert c.run(lambda: mod.answer() + 10) == [12, 12]

    shipped = {m.__name__ for m in c._pickler.learner_modules()}
    assert name in shipped
    assert not any(n.split(".")[0] in ("ddpkit", "torch", "pytest", "os") for n in shipped)
    import cloudpickle
    assert name not in cloudpickle.list_registry_pickle_by_value()  # registered only per job
    sys.modules.pop(name, None)


# ---------------------------------------------------------------------- %%ranks
@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "ddpkit")  # ddpkit.load_ipython_extension -> magic.register
    saved = dict(ip.user_ns)
    yield ip
    ip.user_ns.clear()
    ip.user_ns.update(saved)


def test_ranks_magic_runs_the_cell_on_every_rank_and_names_persist(cluster_of, shell, capsys):
    c = cluster_of(2)
    shell.user_ns["cl"] = c
    shell.run_cell_magic("ranks", "", "import ddpkit\nx = ddpkit.rank() * 10\nprint('x is', x)\n")
    out = capsys.readouterr().out
    assert "[rank 0] x is 0" in out and "[rank 1] x is 10" in out
    shell.run_cell_magic("ranks", "cl", "y = x + 1\ny * 2")  # x persisted on each rank
    out = capsys.readouterr().out
    assert "Out[rank 0]: 2" in out and "Out[rank 1]: 22" in out
    assert c.last_results == ["2", "22"]
    shell.run_cell_magic("ranks", "", "z = 5")  # no trailing expression: nothing shown
    assert "Out[" not in capsys.readouterr().out
    shell.run_cell("%%ranks\nz + ddpkit.rank()\n")  # the cell-magic syntax, through IPython
    out = capsys.readouterr().out
    assert "Out[rank 0]: 5" in out and "Out[rank 1]: 6" in out
    with pytest.raises(RankError) as info:
        shell.run_cell_magic("ranks", "", "if ddpkit.rank() == 1:\n    undefined_name\n")
    assert info.value.ranks == [1] and "NameError" in info.value.failures[1]
    assert "undefined_name" in info.value.failures[1]  # the cell's line, via linecache


def test_ranks_magic_picks_the_named_or_the_newest_running_cluster():
    from IPython.core.error import UsageError

    def fake(created, alive=True):
        c = Cluster.__new__(Cluster)  # not started: only what find_cluster looks at
        c._created, c._workers = created, SimpleNamespace(alive=alive)
        return c

    old, new, stopped = fake(1), fake(2), fake(3, alive=False)
    assert magic.find_cluster({"a": old, "b": new, "c": stopped}) is new
    assert magic.find_cluster({"a": old, "b": new}, "a") is old
    with pytest.raises(UsageError, match="no running"):
        magic.find_cluster({"c": stopped, "n": 3})
    with pytest.raises(UsageError, match="not a ddpkit.Cluster"):
        magic.find_cluster({"n": 3}, "n")
    with pytest.raises(UsageError, match="no variable"):
        magic.find_cluster({}, "nope")


# ----------------------------------------------------------------------------- flight rings on disk
def test_shutdown_removes_the_flight_rings_and_a_restart_makes_new_ones():
    c = Cluster(2)
    try:
        c.run(lambda: None)
        first = c._events.rings.dir
        assert first and {"rank0.ring", "rank1.ring"} <= set(os.listdir(first))
        c.restart()
        assert not os.path.exists(first)
        c.run(lambda: None)
        second = c._events.rings.dir
        assert second and second != first and os.path.isdir(second)
    finally:
        c.shutdown()
    assert not os.path.exists(second)


def test_ring_directories_of_parents_no_longer_running_are_swept(tmp_path):
    import subprocess

    from ddpkit.cluster.watch import PREFIX, sweep

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid runs nothing now
    dead = tmp_path / f"{PREFIX}{gone.pid}-abc123"
    mine = tmp_path / f"{PREFIX}{os.getpid()}-def456"
    other = tmp_path / "ddpkit-something-else"
    for d in (dead, mine, other):
        d.mkdir()
        (d / "rank0.ring").write_bytes(b"x")
    assert sweep(str(tmp_path)) == [dead.name]
    assert not dead.exists() and mine.exists() and other.exists()
