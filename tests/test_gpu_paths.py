"""The CUDA/NCCL paths, proven on the CPU where a fake can stand in for the GPU, and on a GPU where
only a GPU can show it (``@pytest.mark.gpu``: skipped without CUDA, see conftest.py).

What each test guards (issue 21): the clock probe on the rank's GPU and waited for (1); indexed
devices and every thread ddpkit starts on the rank's GPU (2); the Cluster's timeout and the
group's name and ranks reaching NCCL (4); results back on the CPU (5); every torchrun rank of a
node choosing its backend alike (6); the emulator waiting for a CUDA collective without touching
the caller's streams (7); a collective's start marked before its launch (8); hybrid sharding's
groups made once (9); the allocator's peak per job and per timed steps (10); the ring exercise on
NCCL (11).
"""
from __future__ import annotations

import pickle
import threading
import time
import types
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit import rankside
from ddpkit.trace.seam import NullRecorder


class _SetDeviceSpy:
    """Stands in for ``torch.cuda.set_device``: which thread asked for which device."""

    def __init__(self):
        self.calls: list[tuple[str, torch.device]] = []

    def __call__(self, dev):
        self.calls.append((threading.current_thread().name, torch.device(dev)))


@pytest.fixture
def set_device(monkeypatch, no_rank_device):
    spy = _SetDeviceSpy()
    monkeypatch.setattr(torch.cuda, "set_device", spy)
    return spy


def _wait_for(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


# ----------------------------------------------------------------------------- 1: the clock probe
class _Stop(Exception):
    pass


def _probe_under_nccl():
    """Inside a gloo rank, pretend the real backend is NCCL: where does the probe go, and is the
    GPU waited for around the timed all-gather?"""
    from ddpkit.trace import clocks

    events = []
    saved = rankside.backend, dist.all_gather, torch.cuda.synchronize

    def gather(out, probe, group=None):
        events.append(("all_gather", str(probe.device), sorted({str(o.device) for o in out})))
        if sum(e[0] == "all_gather" for e in events) == 2:
            raise _Stop  # round 1 is all we need to see

    rankside.backend = lambda: "nccl"
    dist.all_gather = gather
    torch.cuda.synchronize = lambda dev=None: events.append(("synchronize", str(dev)))
    try:
        clocks.align_clocks(lambda: events.append("clock") or 0, torch.device("meta"))
    except _Stop:
        pass
    finally:
        rankside.backend, dist.all_gather, torch.cuda.synchronize = saved
    return events, str(clocks.probe_device(torch.device("meta")))


def test_the_clock_probe_goes_to_the_ranks_gpu_under_nccl_and_the_gpu_is_waited_for(cluster_of):
    # a stand-in device (meta) for the rank's GPU: the probe must be made there, not on the CPU
    # (a Cluster's group is called "ddpkit": asking it for its name said CPU on every GPU run)
    events, gloo_probe = cluster_of(2).run(_probe_under_nccl)[0]
    assert gloo_probe == "cpu"  # the rank's real backend (gloo, unpatched): the CPU
    first_round = events[:events.index(("all_gather", "meta", ["meta"])) + 3]
    assert first_round == [("synchronize", "meta"), "clock", ("all_gather", "meta", ["meta"]),
                           ("synchronize", "meta"), "clock"]  # t_b read after the GPU finished


# ----------------------------------------------------------------------------- 2: devices, threads
class _FakeClock:
    def __init__(self, device, clock):
        self.device = device


def test_a_recorder_keeps_the_ranks_gpu_with_its_index(monkeypatch, set_device):
    from ddpkit.trace import recorder as recorder_module

    monkeypatch.setattr(recorder_module, "CudaClock", _FakeClock)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    rankside.set_device(5)  # what a Cluster's worker does with gpus=[..., 5, ...]
    assert set_device.calls == [("MainThread", torch.device("cuda", 5))]
    assert rankside.device() == torch.device("cuda", 5)
    assert _recorder_device() == torch.device("cuda", 5)  # the default: the rank's GPU
    assert _recorder_device("cuda") == torch.device("cuda", 3)  # no index given: the current one
    assert _recorder_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="GPU index"):
        rankside.set_device("cuda")


def _recorder_device(device=None):
    from ddpkit.trace import Recorder

    return Recorder(rank=0, world_size=1, device=device).device


class _FakeCudaTensor:
    """What the emulator asks of a collective's output: its device."""

    def __init__(self, index):
        self.device = torch.device("cuda", index)


class _FakeCudaWork:
    """A CUDA collective's Work: queued at once, finished on the GPU when the test says."""

    def __init__(self, result):
        self.finished = threading.Event()
        self.waits: list[str] = []
        self._future = torch.futures.Future()
        self._future.set_result(result)  # NCCL's future completes at launch, not at the end

    def is_completed(self):
        return self.finished.is_set()

    def wait(self, timeout=None):
        self.waits.append(threading.current_thread().name)
        return True

    def get_future(self):
        return self._future


def test_the_emulator_waits_for_a_cuda_collective_on_the_host_and_leaves_the_real_wait_to_the_caller(
        monkeypatch, set_device):
    from ddpkit.comm.emulator import Emulator

    streams = []  # the link thread's own stream: completion events must not queue behind compute
    monkeypatch.setattr(torch.cuda, "Stream", lambda dev: ("stream on", torch.device(dev)))
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: streams.append((threading.current_thread().name, s)))

    result = [_FakeCudaTensor(3)]
    work = _FakeCudaWork(result)
    emulated = Emulator().submit("intra-node", work, 0.05, result)
    time.sleep(0.1)  # longer than the link takes: only the GPU's completion holds it back now
    assert not emulated.is_completed() and work.waits == []  # no wait() in the link's thread:
    # on NCCL that would only queue a stream wait, on the link thread's (the default) stream
    work.finished.set()  # the GPU reached the collective's end
    t0 = time.perf_counter()
    assert emulated.wait()
    # the link's 50 ms ran beside the GPU's work, from issue: once the GPU is done, little is left to wait
    assert time.perf_counter() - t0 < 0.045
    assert work.waits == ["MainThread"]  # the real wait, in the caller's thread: its stream waits
    assert emulated.get_future().value() is result
    assert ("ddpkit-link-intra-node", torch.device("cuda", 3)) in set_device.calls
    assert streams == [("ddpkit-link-intra-node", ("stream on", torch.device("cuda", 3)))]


class _FakeCpuWork:
    def __init__(self):
        self.waits: list[str] = []

    def is_completed(self):
        return True

    def wait(self, timeout=None):
        self.waits.append(threading.current_thread().name)
        return True

    def get_future(self):
        raise RuntimeError("Work::getFuture not implemented")


def test_on_the_cpu_the_link_thread_waits_once_and_the_caller_does_not_wait_again(set_device):
    from ddpkit.comm.emulator import Emulator

    work, result = _FakeCpuWork(), [torch.ones(2)]
    emulated = Emulator().submit("inter-node", work, 0.0, result)
    emulated.wait()
    assert emulated.get_future().value() is result
    # gloo's own Work may redo its copy on every wait(): waited once, by the link
    assert work.waits == ["ddpkit-link-inter-node"]
    assert set_device.calls == []  # the CPU: no CUDA call at all


def test_the_streaming_thread_and_the_recorders_watcher_work_on_the_ranks_gpu(monkeypatch, set_device):
    from ddpkit.trace import recorder as recorder_module
    from ddpkit.trace.live import Streamer
    from ddpkit.trace.recorder import Recorder

    rec = types.SimpleNamespace(device=torch.device("cuda", 2), drain=lambda final=False: [])
    with Streamer(rec, lambda **batch: None, interval_s=0.01):
        _wait_for(lambda: set_device.calls)
    assert set_device.calls == [("ddpkit-stream", torch.device("cuda", 2))]

    monkeypatch.setattr(recorder_module, "CudaClock", _FakeClock)
    watched = Recorder(rank=0, world_size=1, device="cuda:6")
    done = threading.Event()
    watched._watch(_FakeCpuWork(), done.set)  # a Work without a future: the watcher waits on it
    assert done.wait(5.0)
    assert ("ddpkit-recorder-watch", torch.device("cuda", 6)) in set_device.calls


def test_a_streaming_thread_that_stops_early_says_so_at_the_end():
    from ddpkit.trace.live import Streamer

    def drain(final=False):
        if not final:
            raise RuntimeError("Both events must be recorded on the same device")
        return []

    sent = []
    rec = types.SimpleNamespace(device=torch.device("cpu"), drain=drain)
    with pytest.raises(RuntimeError, match="streaming this rank's records stopped early.*same device"):
        with Streamer(rec, lambda **batch: sent.append(batch), interval_s=0.01):
            time.sleep(0.1)
    assert sent == [dict(records=[], final=True)]  # the final batch still left


# ----------------------------------------------------------------------------- 4: NCCL's options
class _FakeNCCL:
    """A recording stand-in for ``dist.ProcessGroupNCCL`` (absent from a CPU build of torch)."""

    made: list = []

    class Options:
        pass

    def __init__(self, store, rank, size, options=None):
        _FakeNCCL.made.append((store, rank, size, options))


def test_the_nccl_group_gets_the_clusters_timeout_its_name_and_its_global_ranks(monkeypatch):
    from ddpkit.comm import process_group

    monkeypatch.setattr(dist, "ProcessGroupNCCL", _FakeNCCL, raising=False)
    monkeypatch.setattr(_FakeNCCL, "made", [])
    opts = types.SimpleNamespace(store="store", group_rank=1, group_size=2, timeout=timedelta(seconds=7),
                                 group_id="3", global_ranks_in_group=[2, 5])
    process_group.build_real_backend("nccl", opts)
    default = types.SimpleNamespace(**{**vars(opts), "group_id": "0", "global_ranks_in_group": []})
    process_group.build_real_backend("nccl", default)
    (store, rank, size, o), (_, _, _, d) = _FakeNCCL.made
    assert (store, rank, size) == ("store", 1, 2)
    assert o._timeout == timedelta(seconds=7)  # not NCCL's own 10 minutes
    assert (o.group_name, o.global_ranks_in_group, o.is_high_priority_stream) == ("3", [2, 5], False)
    assert (d.group_name, d.global_ranks_in_group) == ("0", [0, 1])  # the default group: every rank
    # what the backend creator is handed (torch's _DistributedBackendOptions) has what we read
    given = dist.distributed_c10d._DistributedBackendOptions()
    assert all(hasattr(given, a) for a in ("store", "group_rank", "group_size", "timeout", "group_id",
                                           "global_ranks_in_group"))


# ----------------------------------------------------------------------------- 5: results on the CPU
def test_a_result_is_pickled_with_its_tensors_copied_to_the_cpu():
    from ddpkit.cluster.worker import pickle_result

    base = torch.arange(1000.0)
    param = torch.nn.Parameter(torch.ones(3))
    result = {"view": base[10:13], "param": param, "nested": [(base[:2],)], "n": 1}
    # the CPU stands in for CUDA here: what is done to a CUDA tensor is done to these
    back = pickle.loads(pickle_result(result, devices=("cpu",)))
    assert torch.equal(back["view"], base[10:13]) and back["view"].untyped_storage().nbytes() == 12
    assert type(back["param"]) is torch.nn.Parameter and back["param"].requires_grad
    assert torch.equal(back["nested"][0][0], base[:2]) and back["n"] == 1
    # by default only CUDA tensors are copied: a CPU view keeps its storage as before
    assert pickle.loads(pickle_result(base[10:13])).untyped_storage().nbytes() == 4000


# ----------------------------------------------------------------------------- 6: torchrun's backend
@pytest.mark.parametrize("gpus, expected", [(1, "gloo"), (2, "nccl")])
def test_every_torchrun_rank_of_a_node_chooses_the_same_backend(monkeypatch, set_device, gpus, expected):
    from ddpkit import train

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    chosen = []

    def install(network, real_backend, *a, **k):  # ddpkit's process group over the real backend chosen
        chosen.append(real_backend)
        raise _Stop

    monkeypatch.setattr(train.process_group, "install", install)
    for local_rank in (0, 1):  # torchrun --nproc-per-node 2: two ranks, one node
        env = dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", RANK=str(local_rank), LOCAL_RANK=str(local_rank))
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(_Stop):
            train.main(["--steps", "1"])
    # one GPU for two ranks: both gloo (rank 0 on NCCL and rank 1 on gloo never meet)
    assert chosen == [expected, expected]
    assert [d for _, d in set_device.calls] == ([torch.device("cuda", 0), torch.device("cuda", 1)]
                                                if expected == "nccl" else [])


# ----------------------------------------------------------------------------- 8: start before launch
def _order_of_mark_and_launch():
    from ddpkit.trace.seam import recording

    events = []

    class Marking(NullRecorder):
        enabled = True

        def launch_mark(self):
            events.append("mark")
            return "the start"

        def collective(self, name, work, nbytes, launched=None, **fields):
            events.append(("collective", name, launched))

    class Launching:  # the real backend, as the group sees it, noting each launch
        def __init__(self, real):
            self.real = real

        def allreduce(self, tensors, opts):
            events.append("launch")
            return self.real.allreduce(tensors, opts)

    group = dist.group.WORLD
    real = group.real
    group.real = Launching(real)
    try:
        with recording(Marking()):
            dist.all_reduce(torch.ones(2))
    finally:
        group.real = real
    return events


def test_a_collectives_start_is_marked_before_it_is_launched(cluster_of):
    # on NCCL a synchronous collective runs on the current stream: an event recorded after the
    # launch fires after the collective, and its span has no length
    for events in cluster_of(2).run(_order_of_mark_and_launch):
        assert events == ["mark", "launch", ("collective", "all_reduce", "the start")]


def test_the_recorder_starts_a_collectives_span_at_the_mark_taken_before_launch():
    from ddpkit.trace import Recorder

    now = [100]
    rec = Recorder(rank=0, world_size=1, clock=lambda: now[0])
    mark = rec.launch_mark()
    now[0] = 250  # the launch took 150 ns
    rec.collective("all_reduce", None, 8, launched=mark)
    rec.collective("broadcast", None, 8)  # no mark: the start is now
    spans = [(r.name, r.start_ns) for r in rec.records]
    assert spans == [("all_reduce", 100), ("broadcast", 250)]


# ----------------------------------------------------------------------------- 9: HSDP's groups
def _hybrid_groups_made(builds):
    from ddpkit.models import build_model
    from ddpkit.strategies.hsdp import hybrid_groups

    made = []
    saved = dist.new_group
    dist.new_group = lambda *a, **k: made.append(a) or saved(*a, **k)
    try:
        first = hybrid_groups(1)
        after_first = len(made)
        for _ in range(builds):
            ddpkit.HSDP(build_model("mlp", seed=0, width=8, depth=2), gpus_per_node=1)
            assert hybrid_groups(1) == first  # the very same groups
    finally:
        dist.new_group = saved
    return after_first, len(made)


def test_hybrid_sharding_makes_its_groups_once_per_layout(cluster_of):
    # a comparison builds HSDP many times in one long-lived rank; on NCCL each new group holds
    # communicators (GPU memory, a stream) until the process group ends
    for after_first, total in cluster_of(2).run(_hybrid_groups_made, 3):
        assert after_first <= 3  # 2 shard groups + 1 replicate group, unless made before
        assert total == after_first  # three more builds: no new group


# ----------------------------------------------------------------------------- 10: peak per job
def test_each_job_starts_a_fresh_allocator_peak_on_the_ranks_gpu(monkeypatch, set_device):
    from ddpkit.cluster.worker import before_job

    resets = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda dev=None: resets.append(dev))
    before_job()  # a CPU rank: nothing to reset
    assert resets == []
    rankside.set_device(4)
    before_job()
    assert resets == [torch.device("cuda", 4)]


# ============================================================================= on a GPU only
def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cuda_ranks(n: int, **kwargs) -> ddpkit.Cluster:
    """n ranks on CUDA: NCCL with a GPU each where there are n GPUs, else n ranks sharing GPU 0 (their
    collectives on CUDA tensors through ddpkit's transport), for what holds of CUDA ranks either way:
    CUDA-event spans and streaming, the emulator's wait on a CUDA collective."""
    if _gpus() >= n:
        return ddpkit.Cluster(n, backend="nccl", timeout=60.0, **kwargs)
    return ddpkit.Cluster(n, gpus=[0] * n, timeout=60.0, **kwargs)


def _recorded_overlapped():
    from ddpkit.experiment import run_strategy

    return run_strategy("overlapped", steps=2, warmup=1, model_kwargs=dict(width=64, depth=3),
                        record=True, return_records=True)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_a_recorded_cuda_run_records_cuda_spans_and_streams(world):
    with _cuda_ranks(world) as c:  # one GPU: 2 ranks sharing it
        with c.recording():
            out = c.run(_recorded_overlapped)
        comm = [r for r in out[0]["records"] if r.cat == "comm"]
        host = [(r.name, r.nbytes, r.step) for r in comm if r.clock != "cuda" or r.end_ns is None]
        assert comm and not host, f"{len(host)} of {len(comm)} collectives not timed by CUDA events: {host[:6]}"
        streamed = c.last_trace.records
        assert {r.rank for r in streamed} == set(range(world)) and any(r.cat == "comm" for r in streamed)


def _synchronous_all_reduce_span():
    from ddpkit.trace.seam import recording
    from ddpkit.trace import Recorder

    rec = Recorder()
    with recording(rec):
        dist.all_reduce(torch.ones(64 * 2**20, device=ddpkit.device()))  # 256 MiB: not instant
    (span,) = [r for r in rec.records if r.cat == "comm"]
    return span.clock, span.end_ns - span.start_ns


@pytest.mark.gpu
def test_a_synchronous_nccl_collective_gets_a_span_of_nonzero_length():
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    with ddpkit.Cluster(2, backend="nccl") as c:
        for clock, ns in c.run(_synchronous_all_reduce_span):
            assert clock == "cuda" and ns > 10_000


@pytest.mark.gpu
def test_ranks_use_the_gpus_named_and_no_thread_touches_gpu_0():
    n = _gpus()
    if n < 2:
        pytest.skip("needs 2 GPUs")

    def job():
        from ddpkit.experiment import run_strategy

        run_strategy("overlapped", steps=2, warmup=1, model_kwargs=dict(width=64, depth=3), record=True)
        timeout = dist.group.WORLD._get_backend(torch.device("cuda")).options._timeout
        return str(ddpkit.device()), torch._C._cuda_hasPrimaryContext(0), timeout

    with ddpkit.Cluster(1, gpus=[n - 1], network="1GbE", timeout=17.0) as c:  # emulated: the link thread
        with c.recording():
            dev, context_on_0, timeout = c.run(job)[0]
    assert dev == f"cuda:{n - 1}" and not context_on_0
    assert timeout == timedelta(seconds=17)


@pytest.mark.gpu
def test_results_come_back_to_the_notebook_on_the_cpu():
    if _gpus() < 1:
        pytest.skip("needs a GPU")
    with ddpkit.Cluster(1, backend="nccl") as c:
        (out,) = c.run(lambda: {"t": torch.ones(3, device=ddpkit.device()),
                                "p": torch.nn.Parameter(torch.ones(2, device=ddpkit.device()))})
    assert out["t"].device.type == "cpu" and out["p"].device.type == "cpu"


def _peak_after_a_big_allocation(allocate: bool):
    from ddpkit.experiment import run_strategy
    from ddpkit.memory import cuda_allocator_bytes

    if allocate:
        big = torch.empty(2**30, dtype=torch.uint8, device=ddpkit.device())  # 1 GiB, freed at once
        del big
        return None
    out = run_strategy("naive", steps=2, warmup=1, model_kwargs=dict(width=64, depth=3), record=True,
                       reference=None)
    return cuda_allocator_bytes(ddpkit.device())["cuda_max_allocated"], out.peak_bytes


@pytest.mark.gpu
def test_the_allocator_peak_starts_afresh_with_each_job_and_each_timed_run():
    if _gpus() < 1:
        pytest.skip("needs a GPU")
    with ddpkit.Cluster(1, backend="nccl") as c:
        c.run(_peak_after_a_big_allocation, True)
        (job_peak, step_peak), = c.run(_peak_after_a_big_allocation, False)
    assert job_peak < 2**29 and 0 < step_peak < 2**29  # not the last job's 1 GiB


def _emulated_all_reduce():
    from ddpkit.trace.seam import recording
    from ddpkit.trace import Recorder

    t = torch.ones(2**20, device=ddpkit.device())  # 4 MiB
    rec = Recorder()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with recording(rec):
        work = dist.all_reduce(t, async_op=True)
    work.wait()
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    (span,) = [r for r in rec.records if r.cat == "comm"]
    return took, t[0].item(), (span.end_ns - span.start_ns) / 1e9


@pytest.mark.gpu
def test_an_emulated_cuda_collective_completes_after_the_gpu_work_and_the_link_time():
    from ddpkit.network import Network

    net = Network("1GbE")
    with _cuda_ranks(2, network=net) as c:  # one GPU: 2 ranks sharing it
        expected = net.collective_time("all_reduce", 4 * 2**20, 2)
        for took, value, recorded in c.run(_emulated_all_reduce):
            assert value == 2.0 and took >= 0.9 * expected
            assert 0.9 * expected <= recorded <= took + 0.01  # its span ends at the emulated completion


@pytest.mark.gpu
def test_the_ring_exercise_completes_on_nccl_with_large_chunks():
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    from solutions.collectives import ring_all_reduce

    def job():
        x = torch.ones(2**24, device=ddpkit.device()) * (ddpkit.rank() + 1)  # 32 MiB chunks on 2 ranks
        ring_all_reduce(x)
        return x.min().item(), x.max().item()

    with ddpkit.Cluster(2, backend="nccl", timeout=60.0) as c:
        assert c.run(job) == [(3.0, 3.0)] * 2
