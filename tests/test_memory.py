"""Memory by category, the activation meter, and the ZeRO formulas."""
from __future__ import annotations

import pytest
import torch

from ddpkit.memory import (
    ActivationMeter, cuda_memory_snapshot, memory_by_category, model_state_bytes, record_memory, step_memory,
)
from ddpkit.memory_formulas import zero_predictions
from ddpkit.models import build_model, loss_fn, make_batch


def numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_parameters_gradients_and_adamw_state_in_fp32():
    model = build_model("mlp", width=16, depth=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = numel(model)
    assert model_state_bytes(model, opt) == {"parameters": 4 * n, "gradients": 0, "optimizer_state": 0}
    x, y = make_batch(model, 8, 0)
    loss_fn(model(x), y).backward()
    assert model_state_bytes(model, opt)["gradients"] == 4 * n
    opt.step()
    # AdamW keeps exp_avg and exp_avg_sq: 2 x 4 bytes per parameter (the 0-dim step counters aside)
    assert model_state_bytes(model, opt)["optimizer_state"] == 8 * n
    opt.zero_grad(set_to_none=True)
    assert model_state_bytes(model, opt)["gradients"] == 0


def test_sgd_momentum_is_4_bytes_per_parameter():
    model = build_model("mlp", width=8, depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = make_batch(model, 4, 0)
    loss_fn(model(x), y).backward()
    opt.step()
    assert model_state_bytes(model, opt)["optimizer_state"] == 4 * numel(model)


def test_tied_parameters_count_once():
    model = build_model("gpt", vocab=32, dim=16, layers=1, heads=2, seq=8)
    assert model.head.weight is model.tok.weight
    assert model_state_bytes(model)["parameters"] == 4 * numel(model)  # parameters() lists it once


def test_activation_meter_counts_saved_tensors_not_parameters():
    model = build_model("mlp", width=32, depth=4)
    sizes = {}
    for batch in (8, 16):
        x, y = make_batch(model, batch, 0)
        with ActivationMeter(model) as act:
            loss_fn(model(x), y)
        sizes[batch] = act.peak_bytes
    assert sizes[8] > 0
    # Each Linear saves its input (batch x 32 fp32) and each ReLU its output, sharing storage
    # with the next Linear's input: at least depth x batch x width x 4 bytes.
    assert sizes[8] >= 4 * 8 * 32 * 4
    # activations scale with the batch; parameters (fixed size) are not counted
    assert sizes[16] == pytest.approx(2 * sizes[8], rel=0.05)
    with ActivationMeter(model) as act, torch.no_grad():
        model(x)
    assert act.peak_bytes == 0  # nothing is saved without autograd


def test_memory_by_category_and_the_recorder():
    from ddpkit.trace import Recorder

    model = build_model("mlp", width=16, depth=2)
    opt = torch.optim.AdamW(model.parameters())
    x, y = make_batch(model, 8, 0)
    rec = Recorder(rank=0, world_size=1)
    model_ddp = _NoSync(model)
    sample = step_memory(model_ddp, opt, x, y, loss_fn, recorder=rec)
    n = numel(model)
    # sampled after optimizer.step(), before zero_grad: every model state exists
    assert sample["parameters"] == 4 * n and sample["gradients"] == 4 * n
    assert sample["optimizer_state"] == 8 * n
    assert sample["activations"] > 0 and sample["communication_buffers"] == 0
    assert model.layers[0][0].weight.grad is None  # ... and zero_grad ran afterwards
    (mem,) = rec.records
    assert mem.kind == "counter" and mem.args == sample
    assert record_memory(rec, model_ddp, opt)["gradients"] == 0


class _NoSync(torch.nn.Module):
    """A one-process 'wrapper' with the shared interface, for tests without a process group."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        pass


def test_zero_formulas_match_the_paper():
    # Rajbhandari et al.: 7.5 B parameters, N = 64, mixed-precision Adam (K = 12)
    gb = {k: v["total"] / 1e9 for k, v in zero_predictions(7.5e9, 64, k=12, param_bytes=2, grad_bytes=2).items()}
    assert gb["DDP"] == pytest.approx(120, abs=0.05)
    assert gb["ZeRO-1"] == pytest.approx(31.4, abs=0.05)
    assert gb["ZeRO-2"] == pytest.approx(16.6, abs=0.05)
    assert gb["ZeRO-3"] == pytest.approx(1.9, abs=0.05)
    # fp32 Adam, as on CPU: 4 + 4 + 8 = 16 bytes per parameter for DDP, all of it / N for ZeRO-3
    fp32 = zero_predictions(1000, 4)
    assert fp32["DDP"] == {"parameters": 4000, "gradients": 4000, "optimizer_state": 8000, "total": 16000}
    assert fp32["ZeRO-1"]["optimizer_state"] == 2000 and fp32["ZeRO-1"]["gradients"] == 4000
    assert fp32["ZeRO-2"]["gradients"] == 1000 and fp32["ZeRO-2"]["parameters"] == 4000
    assert fp32["ZeRO-3"]["total"] == 4000
    with pytest.raises(ValueError):
        zero_predictions(10, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_cuda_snapshot_refuses_on_cpu(tmp_path):
    with pytest.raises(RuntimeError, match="CUDA"):
        with cuda_memory_snapshot(tmp_path / "snap.pickle"):
            pass


@pytest.mark.gpu
def test_cuda_snapshot_writes_a_file(tmp_path):
    path = tmp_path / "snap.pickle"
    with cuda_memory_snapshot(path):
        torch.ones(1024, device="cuda").sum()
    assert path.stat().st_size > 0
    model = build_model("mlp", width=16, depth=2).cuda()
    sample = memory_by_category(model)
    assert sample["cuda_allocated"] >= sample["parameters"]


# ----------------------------------------------------------------------------- with the strategies
def _per_rank_memory(strategy: str):
    def job():
        import torch
        import torch.distributed as dist

        import ddpkit
        from ddpkit.experiment import local_batch
        from ddpkit.memory import step_memory
        from ddpkit.models import build_model, loss_fn

        rank, ws = dist.get_rank(), dist.get_world_size()
        module = build_model("mlp", width=32, depth=4)
        if strategy == "fsdp":
            model = ddpkit.FSDP(module)
            opt = torch.optim.AdamW(model.parameters())
        elif strategy == "sharded_optimizer":
            model = ddpkit.BucketedDDP(module)
            opt = ddpkit.ShardedOptimizer(model.parameters(), torch.optim.AdamW)
        else:
            model = ddpkit.BucketedDDP(module)
            opt = torch.optim.AdamW(model.parameters())
        x, y = local_batch(module, 8, 0, rank, ws)
        return step_memory(model, opt, x, y, loss_fn), model.comm_buffer_bytes()

    return job


def test_sharding_shrinks_memory_per_rank_as_zero_predicts(cluster_of):
    n = numel(build_model("mlp", width=32, depth=4))
    ddp = cluster_of(2).run(_per_rank_memory("ddp"))
    for sample, comm in ddp:
        assert sample["parameters"] == 4 * n and sample["optimizer_state"] == 8 * n
        assert sample["communication_buffers"] == comm == 4 * n  # one flat copy of the gradients
    sharded = cluster_of(2).run(_per_rank_memory("sharded_optimizer"))
    # whole parameters are assigned to ranks, so each rank's share is near 1/2
    assert sum(s["optimizer_state"] for s, _ in sharded) == 8 * n
    assert all(s["optimizer_state"] < 0.75 * 8 * n for s, _ in sharded)
    fsdp = cluster_of(2).run(_per_rank_memory("fsdp"))
    for sample, _ in fsdp:
        # 1/N of the flat parameters (padding adds at most N-1 elements per unit)
        assert 4 * n / 2 <= sample["parameters"] <= 4 * n / 2 + 4 * 8
        assert sample["gradients"] == sample["parameters"]
        assert sample["optimizer_state"] == 2 * sample["parameters"]


def test_hybrid_sharding_state_divides_by_the_real_node_size():
    from ddpkit.memory_formulas import predicted_model_state, shard_group_size
    from ddpkit.network import Network
    from ddpkit.topology import Topology

    psi = 1000  # fp32 AdamW: 16 bytes per parameter, all of it sharded under ZeRO-3
    assert predicted_model_state("hsdp", psi, 8)["total"] == 16 * psi / 2  # the default: nodes of 2
    assert predicted_model_state("hsdp", psi, 8, Network.of("10GbE", gpus_per_node=4))["total"] == 16 * psi / 4
    assert predicted_model_state("hsdp", psi, 8, Topology(8, 8))["total"] == 16 * psi / 8
    assert predicted_model_state("fsdp", psi, 8, Topology(8, 4))["total"] == 16 * psi / 8  # all ranks
    assert shard_group_size("overlapped", 8, Topology(8, 4)) == 8
    with pytest.raises(ValueError, match="gpus_per_node=4 does not divide world_size=6"):
        predicted_model_state("hsdp", psi, 6, Network.of("10GbE", gpus_per_node=4))


def test_memory_against_n_follows_the_formulas_and_says_what_they_leave_out(cluster_of):
    """memory_sweep on 1 and 2 ranks: model states equal the ZeRO formula at each N; DDP's buckets
    and the activations stay whole; no optimizer state before the first step; FSDP holds a unit."""
    from ddpkit import Workload
    from ddpkit.memory_formulas import parameter_count
    from ddpkit.memory_sweep import formula_totals, memory_against_n

    workload = Workload.builtin("mlp", width=64, depth=4)
    rungs = ["overlapped", "zero1", "zero2", "fsdp"]
    sweep = {n: memory_against_n(cluster_of(n), rungs, workload, per_rank_batch=8) for n in (1, 2)}
    psi = parameter_count(workload)
    formula = formula_totals(sweep, psi)
    for n in (1, 2):
        for s in rungs:
            m = sweep[n][s]
            assert abs(m["model_state"] - formula[s, n]) / formula[s, n] < 0.05, (s, n)
            assert m["optimizer_state_before_first_step"] == 0 and m["activations"] > 0
            assert m["total"] == sum(m[c] for c in ("parameters", "gradients", "optimizer_state",
                                                      "communication_buffers", "unsharded_parameters", "activations"))
        assert sweep[n]["overlapped"]["communication_buffers"] == 4 * psi  # a full copy of the gradients
    assert sweep[2]["fsdp"]["unsharded_parameters"] > 0
    assert sweep[2]["fsdp"]["activations"] == sweep[1]["fsdp"]["activations"]  # same samples per rank
    from ddpkit.viz import plot_memory_against_n

    plot = plot_memory_against_n(sweep, formula)
    assert plot._repr_png_().startswith(b"\x89PNG") and [a.get_title() for a in plot.axes] == rungs


def _train_and_keep_a_weak_reference(strategy):
    import builtins
    import weakref

    from ddpkit.experiment import run_strategy, wrap
    from ddpkit.models import build_model

    model = build_model("mlp", width=32, depth=3)
    wrapped, _ = wrap(strategy, model, "sgd", 25.0, None)
    builtins._ddpkit_test_refs = (weakref.ref(model), weakref.ref(wrapped))
    run_strategy(strategy, steps=1, warmup=0, model_kwargs=dict(width=32, depth=3), record=True,
                 report_progress=False)
    return None


def _still_alive():
    import builtins
    import gc

    gc.collect()  # a cycle the collector can see is freed; one through C++ hooks never was
    return [ref() is not None for ref in builtins._ddpkit_test_refs]


@pytest.mark.parametrize("strategy", ["bucketed", "overlapped", "zero1", "zero2", "fsdp", "torch_ddp"])
def test_a_rank_lets_go_of_an_earlier_runs_model_and_wrapper(cluster_of, strategy):
    # A rank outlives its jobs. Gradient hooks live in a parameter's C++ autograd data, out of the
    # garbage collector's sight: a hook holding its wrapper kept every run's model, buckets and
    # optimizer alive even after a collection (on a GPU the allocator's figures grew by a model
    # per run, seen on an H200)
    cluster = cluster_of(1)
    cluster.run(_train_and_keep_a_weak_reference, strategy)
    assert cluster.run(_still_alive) == [[False, False]]
