"""Several ranks on one GPU (``Cluster(4, gpus=[0, 0, 0, 0])``; ``ddpkit.cluster.placement``).

Without a GPU (every run): a rank out of GPU memory gives a ``GpuOutOfMemoryError`` naming what
each rank sharing the GPU held and how to fit, from a faked ``torch.OutOfMemoryError`` and faked
figures, and the cluster runs on; what a worker on a GPU reports after each job, with torch.cuda
faked. (Placement and its refusals: ``test_cluster.py``; the staging path and the GPU slab's waits
with CPU tensors standing in: ``test_shm.py``.)

On a GPU (``-m gpu``, one GPU is enough): every strategy, ours and torch's, equals one process at 2
and 4 ranks sharing the GPU (hybrid sharding at 4 as 2 emulated nodes), on the default transport;
every transport carries every collective exactly, over more than one of its pieces (and the ring
exercise's send and recv); a skipped collective is a ``DesyncError``; memory per rank follows the
ZeRO formulas at N = 1, 2, 4; a rank out of its capped share says what each held. The emulated
network's wait on a CUDA collective and CUDA-event spans at 2 ranks: ``test_gpu_paths.py``, on ranks
sharing the GPU where there is one.
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

import ddpkit
from ddpkit.cluster.gpu_memory import GpuHeld, explain_out_of_memory

GIB, MIB = 2**30, 2**20
OOM = ("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
       "3.12 GiB is free.")


def _held(allocated_gib: float, cap=None, context=512 * MIB) -> GpuHeld:
    return GpuHeld("cuda:0", int(allocated_gib * GIB), int(1.5 * allocated_gib * GIB), int(2 * allocated_gib * GIB),
                   context, cap, 80 * GIB)


# ============================================================================= without a GPU
def test_the_message_names_what_each_rank_sharing_the_gpu_held_and_how_to_fit():
    held = {0: _held(10), 1: _held(20, cap=20 * GIB), 2: _held(1, context=None)}
    text = explain_out_of_memory({1: f"torch.OutOfMemoryError: {OOM}"}, held,
                                 {0: "cuda:0", 1: "cuda:0", 2: "cuda:0", 3: "cuda:0"})
    lines = text.splitlines()
    assert lines[0] == f"rank 1 ran out of GPU memory on cuda:0 (80.00 GiB): torch.OutOfMemoryError: {OOM}"
    assert lines[1].startswith("cuda:0 is shared by ranks 0, 1, 2, 3; what each held when its job ended")
    assert lines[2] == "  rank 0: 10.00 GiB in use, peak 15.00 GiB, 20.00 GiB reserved, 512.00 MiB outside it"
    assert lines[3] == ("  rank 1: 20.00 GiB in use, peak 30.00 GiB, 40.00 GiB reserved, 512.00 MiB outside it "
                        "(capped at 20.00 GiB) <- ran out")
    assert lines[4] == "  rank 2: 1.00 GiB in use, peak 1.50 GiB, 2.00 GiB reserved"  # NVML could not tell
    assert lines[5] == "  rank 3: not reported (it was stopped before it could say)"
    assert lines[6].startswith("To fit: fewer ranks on the GPU") and "a smaller batch per rank" in lines[6]
    assert "zero1" in lines[6] and "fsdp" in lines[6] and "memory_fraction" in lines[6]


def _runs_out_of_memory():
    """Inside a rank: report what a rank on a shared GPU would, then rank 1 runs out while rank 0
    waits for it in a collective (it is stopped, as a rank sharing the GPU would be)."""
    import torch.distributed as dist

    from ddpkit.cluster.worker import report

    rank = dist.get_rank()
    report("gpu_memory", held=_held(10 * (rank + 1)))  # what the worker sends after a job on a GPU
    if rank == 1:
        raise torch.OutOfMemoryError(OOM)
    dist.barrier()


def test_a_rank_out_of_gpu_memory_says_what_each_rank_held_and_the_cluster_runs_on(cluster_of):
    c = cluster_of(2)
    with pytest.raises(ddpkit.GpuOutOfMemoryError) as info:
        c.run(_runs_out_of_memory)
    err = info.value
    assert isinstance(err, ddpkit.RankError) and err.out_of_memory == [1] and sorted(err.held) == [0, 1]
    text = str(err)
    assert text.startswith(f"rank 1 ran out of GPU memory on cuda:0 (80.00 GiB): torch.OutOfMemoryError: {OOM}")
    assert "  rank 0: 10.00 GiB in use" in text and "  rank 1: 20.00 GiB in use" in text
    assert "To fit: fewer ranks on the GPU" in text
    assert text.index("To fit") < text.index("[ddpkit]") < text.index("--- rank 1 ---")  # then as any RankError
    assert c.run(ddpkit.rank) == [0, 1]  # usable again (restarted: rank 0 was stopped inside a collective)


def test_after_each_job_on_a_gpu_a_rank_says_what_it_held_and_one_out_of_memory_gives_back_its_cache(
        monkeypatch, no_rank_device):
    from ddpkit import rankside
    from ddpkit.cluster import gpu_memory, worker

    sent, emptied = [], []
    worker.after_job(sent.append, None, None)  # a CPU rank: nothing to say
    assert sent == []
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: None)  # no GPU here: the rank's is pretended
    rankside.set_device(0)
    for name, value in (("memory_allocated", 3 * GIB), ("max_memory_allocated", 4 * GIB),
                        ("memory_reserved", 5 * GIB)):
        monkeypatch.setattr(torch.cuda, name, lambda dev=None, v=value: v)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(total_memory=16 * GIB))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(gpu_memory, "cuda_context_bytes", lambda dev: 300 * MIB)
    worker.after_job(sent.append, None, 0.25)
    assert sent == [("event", "gpu_memory", {"held": GpuHeld("cuda:0", 3 * GIB, 4 * GIB, 5 * GIB, 300 * MIB,
                                                             4 * GIB, 16 * GIB)})]
    assert emptied == []  # a job that went well keeps its allocator's cache
    worker.after_job(sent.append, torch.OutOfMemoryError(OOM), None)
    assert len(sent) == 2 and emptied == [True]  # ranks sharing the GPU may need what it cached


# ============================================================================= on a GPU
def _shared(n: int, **kwargs) -> ddpkit.Cluster:
    """n ranks on GPU 0 (one rank: NCCL, as backend='auto' gives it)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return ddpkit.Cluster(n, gpus=[0] * n, timeout=60.0, **kwargs)


@pytest.fixture(scope="module")
def shared_of():
    """``shared_of(n)``: a Cluster of n ranks sharing GPU 0 on the default transport, kept for the module."""
    made: dict = {}

    def get(n: int) -> ddpkit.Cluster:
        c = made.get(n)
        if c is None:
            c = made[n] = _shared(n)
        elif any(r.status in ("dead", "stopped") for r in c.ranks):
            c.restart()
        return c

    yield get
    for c in made.values():
        c.shutdown()


def _cases():
    from ddpkit.strategies.table import NAMES, STRATEGIES

    return [(s, n) for n in (2, 4) for s in NAMES if STRATEGIES[s].fits(n)]


@pytest.mark.gpu
@pytest.mark.parametrize("strategy, n", _cases(), ids=[f"{s}-{n}ranks" for s, n in _cases()])
def test_every_strategy_equals_one_process_on_ranks_sharing_a_gpu(shared_of, strategy, n):
    import test_equivalence as eq
    from ddpkit.experiment import max_abs_diff
    from helpers import reference_params

    c = shared_of(n)
    assert c.devices == ["cuda:0"] * n and "sharing GPU 0" in c.carried_by
    per_rank = c.run(eq._train, strategy, "mlp", "adamw")
    reference = reference_params("mlp", "adamw", steps=eq.STEPS, batch=eq.BATCH, **eq.MODELS["mlp"])
    for rank, full in enumerate(per_rank):
        diff = max_abs_diff(full, reference)
        # float32 on a GPU: sums and products in another order than the CPU reference's (the doctor's 1e-4)
        assert diff <= 1e-4, f"{strategy} at {n} ranks sharing a GPU: rank {rank} off by {diff}"


def _every_collective_on_cuda() -> list[str]:
    """Inside a rank on a GPU: every collective through the cluster's group, on CUDA tensors big
    enough to need several of the transport's pieces (the GPU slab's regions are 4-8 MiB), against
    what it must give (small whole numbers: exact in any order)."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    dev, bad = ddpkit.device(), []
    big = 5 * 2**20 + 3  # 20 MiB of float32, not a multiple of anything
    base = (torch.arange(big, device=dev) % 7).float()
    x = base * (rank + 1)
    dist.all_reduce(x)
    checks = [("all_reduce", x, base * (n * (n + 1) // 2))]
    y = base[:1000] * (rank + 1)
    dist.all_reduce(y, async_op=True).wait()
    checks.append(("all_reduce async", y, base[:1000] * (n * (n + 1) // 2)))
    flat = torch.empty(n * big, device=dev)
    dist.all_gather_into_tensor(flat, x)
    checks.append(("all_gather_into_tensor", flat, x.repeat(n)))
    part = torch.empty(big, device=dev)
    dist.reduce_scatter_tensor(part, base.repeat(n) * (rank + 1))
    checks.append(("reduce_scatter_tensor", part, base * (n * (n + 1) // 2)))
    b = base * (rank + 1)
    dist.broadcast(b, src=n - 1)
    checks.append(("broadcast", b, base * n))
    r = torch.arange(7.0, device=dev) * (rank + 1)
    from solutions.collectives import ring_all_reduce

    ring_all_reduce(r)  # send and recv: staged through the host on every gloo-family transport
    checks.append(("ring (send/recv)", r, torch.arange(7.0, device=dev) * (n * (n + 1) // 2)))
    for name, got, want in checks:
        if got.device != dev or not torch.equal(got, want):
            bad.append(f"rank {rank}: {name} on {got.device}")
    return bad


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["cuda-ipc", "shm", "gloo"])
def test_every_transport_carries_every_collective_exactly_on_a_shared_gpu(transport):
    with _shared(2, transport=transport) as c:
        assert c.transport == transport
        bad = [b for rank_bad in c.run(_every_collective_on_cuda) for b in rank_bad]
    assert not bad, bad


def _skips_one_all_reduce():
    import torch.distributed as dist

    for i in range(4):
        if dist.get_rank() == 1 and i == 2:
            continue
        dist.all_reduce(torch.ones(1000 * (i + 1), device=ddpkit.device()))


@pytest.mark.gpu
def test_a_skipped_collective_on_ranks_sharing_a_gpu_is_a_desync_within_seconds():
    with _shared(2) as c:
        t0 = time.monotonic()
        with pytest.raises(ddpkit.DesyncError) as info:
            c.run(_skips_one_all_reduce)
        assert time.monotonic() - t0 < 15.0  # the cluster's timeout is 60 s
        assert str(info.value).startswith("desync at collective #3 of the default group (ranks 0, 1)")
        assert c.run(ddpkit.rank) == [0, 1]


@pytest.mark.gpu
def test_memory_per_rank_on_a_shared_gpu_follows_the_zero_formulas():
    from ddpkit import Workload
    from ddpkit.memory_formulas import parameter_count
    from ddpkit.memory_sweep import formula_totals, memory_against_n

    workload = Workload.builtin("mlp", width=64, depth=4)
    rungs = ["overlapped", "zero1", "zero2", "fsdp"]
    sweep = {}
    for n in (1, 2, 4):
        with _shared(n) as c:
            sweep[n] = memory_against_n(c, rungs, workload, per_rank_batch=8)
    formula = formula_totals(sweep, parameter_count(workload))
    for n in sweep:
        for s in rungs:
            assert abs(sweep[n][s]["model_state"] - formula[s, n]) / formula[s, n] < 0.05, (s, n)


def _allocate_past_the_cap():
    import torch.distributed as dist

    keep = torch.empty(2**20, device=ddpkit.device())  # 4 MiB, held on both ranks
    if dist.get_rank() == 1:
        total = torch.cuda.get_device_properties(ddpkit.device()).total_memory
        torch.empty(total // 10, dtype=torch.uint8, device=ddpkit.device())  # a tenth of the GPU: past the cap
    dist.barrier()
    return keep.numel()


@pytest.mark.gpu
def test_a_rank_past_its_capped_share_says_what_each_rank_held_and_the_cluster_runs_on():
    with _shared(2, memory_fraction=0.05) as c:
        with pytest.raises(ddpkit.GpuOutOfMemoryError) as info:
            c.run(_allocate_past_the_cap)
        err = info.value
        assert err.out_of_memory == [1] and sorted(err.held) == [0, 1]
        assert all(h.cap is not None and h.device == "cuda:0" for h in err.held.values())
        assert str(err).startswith("rank 1 ran out of GPU memory on cuda:0") and "To fit:" in str(err)
        assert c.run(ddpkit.rank) == [0, 1]
