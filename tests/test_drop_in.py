"""ddpkit's DDP wrappers in place of torch's DistributedDataParallel: a loop written for torch's
trains the same, or stops with an error naming what to change (never a silent difference).

The whole-script check (torchrun, accumulation, clipping, AdamW, a checkpoint) is
``test_own_script.py``; here each rule on a shared gloo Cluster.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddpkit
from ddpkit.experiment import local_batch, make_optimizer, max_abs_diff, optimizer_class
from ddpkit.models import build_model, loss_fn
from helpers import SMALL_CAP, SMALL_MLP, TOL, reference_params

WRAPPERS = {"naive": ddpkit.NaiveDDP, "bucketed": ddpkit.BucketedDDP, "overlapped": ddpkit.OverlappedDDP,
            "zero1": ddpkit.ZeRO1, "zero2": ddpkit.ZeRO2}


def _wrap(name, module, **kwargs):
    if name in ("bucketed", "overlapped", "zero1", "zero2"):
        kwargs.setdefault("bucket_cap_mb", SMALL_CAP)  # several buckets
    return WRAPPERS[name](module, **kwargs)


def _optimizer(name, model):
    if name.startswith("zero"):
        cls, defaults = optimizer_class("sgd")
        return model.make_optimizer(cls, **defaults)
    return make_optimizer(model.parameters(), "sgd")


def _loop_without_finish(name, steps=5, batch=24):
    """torch DDP's loop: forward, backward, step. No finish_gradient_synchronization() anywhere."""
    rank, world = dist.get_rank(), dist.get_world_size()
    module = build_model("mlp", seed=rank, **SMALL_MLP)
    model = _wrap(name, module)
    opt = _optimizer(name, model)
    for step in range(steps):
        inputs, targets = local_batch(module, batch, step, rank, world)
        loss_fn(model(inputs), targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.full_state_dict()


@pytest.mark.parametrize("name", WRAPPERS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_loop_that_never_calls_finish_trains_as_one_process(cluster_of, name, world_size):
    reference = reference_params("mlp", "sgd", **SMALL_MLP)
    for rank, params in enumerate(cluster_of(world_size).run(_loop_without_finish, name)):
        assert max_abs_diff(params, reference) < TOL, f"{name}: rank {rank} stepped on unaveraged gradients"


def _second_backward(name):
    module = build_model("mlp", seed=0, **SMALL_MLP)
    model = _wrap(name, module)
    inputs, targets = local_batch(module, 8, 0, dist.get_rank(), dist.get_world_size())
    loss = loss_fn(model(inputs), targets)
    loss.backward(retain_graph=True)
    try:
        loss.backward()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("name", WRAPPERS)
def test_a_second_backward_after_the_sync_is_an_error_not_local_gradients(cluster_of, name):
    for message in cluster_of(2).run(_second_backward, name):
        assert message is not None and "already averaged" in message and "no_sync()" in message


# --------------------------------------------------------------------------- torch's arguments
class WithBatchNorm(nn.Module):
    """A BatchNorm between two Linears: its running statistics are buffers each rank updates on
    its own batch, which broadcast_buffers replaces with rank 0's before every forward."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _batchnorm_run(name, broadcast_buffers, steps=4):
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()
    out = {}
    for kind in (name, "torch"):
        torch.manual_seed(rank)  # ranks start apart: construction makes them equal
        module = WithBatchNorm()
        if kind == "torch":
            model = DistributedDataParallel(module, broadcast_buffers=broadcast_buffers)
        else:
            model = _wrap(kind, module, broadcast_buffers=broadcast_buffers)
        opt = _optimizer(kind, model)
        for step in range(steps):
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * step + rank))
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():  # an eval forward: torch's syncs the buffers once more
            model(torch.ones(2, 6))
        out[kind] = {k: v.clone() for k, v in module.state_dict().items()}
    return out


@pytest.mark.parametrize("name", WRAPPERS)
@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_buffers_follow_torch_ddps_broadcast_buffers(cluster_of, name, broadcast_buffers):
    per_rank = cluster_of(2).run(_batchnorm_run, name, broadcast_buffers)
    for out in per_rank:
        assert max_abs_diff(out[name], out["torch"]) < TOL, f"{name} differs from torch's DDP"
    stats = [out[name]["bn.running_mean"] for out in per_rank]
    # broadcast: every rank holds rank 0's statistics; not: each rank its own (as torch's)
    assert torch.equal(stats[0], stats[1]) == broadcast_buffers


def _bad_arguments():
    module = nn.Linear(3, 3)
    errors = {}
    for label, call in {
        "device_ids on cpu": lambda: ddpkit.OverlappedDDP(module, device_ids=[0]),
        "two device_ids": lambda: ddpkit.BucketedDDP(module, device_ids=[0, 1]),
        "output_device alone": lambda: ddpkit.NaiveDDP(module, output_device=0),
        "mixed_precision": lambda: ddpkit.OverlappedDDP(module, mixed_precision=object()),
        "dim": lambda: ddpkit.OverlappedDDP(module, dim=1),
        "naive cap": lambda: ddpkit.NaiveDDP(module, bucket_cap_mb=25),
        "zero unused": lambda: ddpkit.ZeRO1(module, find_unused_parameters=True),
        "unknown": lambda: ddpkit.OverlappedDDP(module, bucket_size=3),
        "torch hook": lambda: ddpkit.BucketedDDP(module).register_comm_hook(None, lambda state, bucket: None),
    }.items():
        try:
            call()
        except (ValueError, TypeError) as e:
            errors[label] = (type(e).__name__, str(e))
    # torch's accepted arguments: no error, and no communication skipped
    ddpkit.OverlappedDDP(module, device_ids=None, output_device=None, static_graph=True, check_reduction=True,
                         init_sync=True, gradient_as_bucket_view=True, find_unused_parameters=False)
    ddpkit.NaiveDDP(module, device_ids=[], gradient_as_bucket_view=True)
    return errors


def test_torch_ddps_arguments_that_cannot_be_honoured_are_refused_by_name(cluster_of):
    errors = cluster_of(2).run(_bad_arguments)[0]
    assert errors["device_ids on cpu"][0] == "ValueError" and "leave device_ids out" in errors["device_ids on cpu"][1]
    assert "single element" in errors["two device_ids"][1]
    assert "needs device_ids" in errors["output_device alone"][1]
    assert "mixed_precision" in errors["mixed_precision"][1]
    assert "dim=1" in errors["dim"][1]
    assert "no buckets" in errors["naive cap"][1]
    assert "find_unused_parameters" in errors["zero unused"][1]
    assert errors["unknown"] == ("TypeError", "OverlappedDDP() got an unexpected keyword argument 'bucket_size'")
    # torch's (state, hook) form is taken for torch's own default hooks (allreduce, fp16, bf16); any
    # other torch hook is refused by name, with the ways to pick one of ours
    assert "has no ddpkit counterpart" in errors["torch hook"][1]


@pytest.mark.parametrize("wrapper", ["NaiveDDP", "BucketedDDP", "OverlappedDDP", "ZeRO1", "ZeRO2"])
def test_device_ids_as_an_int_is_refused_as_torch_refuses_it(wrapper):
    # torch's DDP takes a list (``device_ids=[rank]``); an int was read as "no device" before, and
    # failed later (here: no process group), or trained on the CPU in a GPU script
    with pytest.raises(TypeError, match=rf"{wrapper}: device_ids must be None or a list of one device, as "
                                        r"torch's DDP takes it \(device_ids=\[0\]\), got int 0"):
        getattr(ddpkit, wrapper)(nn.Linear(3, 3), device_ids=0)


def _init_sync_off():
    torch.manual_seed(dist.get_rank())
    module = nn.Linear(3, 3)
    ddpkit.BucketedDDP(module, init_sync=False)
    return module.weight.detach().clone()


def test_init_sync_false_leaves_each_ranks_parameters(cluster_of):
    w0, w1 = cluster_of(2).run(_init_sync_off)
    assert not torch.equal(w0, w1)


def _accumulate_by_flag(name, micro=3):
    """nanoGPT's accumulation: require_backward_grad_sync False on all but the last micro-batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    module = build_model("mlp", seed=rank, **SMALL_MLP)
    model = _wrap(name, module)
    opt = _optimizer(name, model)
    for step in range(3):
        inputs, targets = local_batch(module, 24, step, rank, world)
        for chunk, (x, y) in enumerate(zip(inputs.chunk(micro), targets.chunk(micro), strict=True)):
            model.require_backward_grad_sync = chunk == micro - 1
            (loss_fn(model(x), y) / micro).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.full_state_dict()


@pytest.mark.parametrize("name", WRAPPERS)
def test_require_backward_grad_sync_accumulates_as_torchs(cluster_of, name):
    reference = reference_params("mlp", "sgd", steps=3, **SMALL_MLP)
    for params in cluster_of(2).run(_accumulate_by_flag, name):
        assert max_abs_diff(params, reference) < 1e-4


def _state_dict_round_trip(name):
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    ours = _wrap(name, build_model("mlp", seed=0, **SMALL_MLP))
    theirs = DistributedDataParallel(build_model("mlp", seed=1, **SMALL_MLP))
    theirs.load_state_dict(ours.state_dict())  # strict: the same "module." keys
    ours2 = _wrap(name, build_model("mlp", seed=2, **SMALL_MLP))
    ours2.load_state_dict(theirs.state_dict())
    return sorted(ours.state_dict()) == sorted(theirs.state_dict()), max_abs_diff(ours2.full_state_dict(),
                                                                                  ours.full_state_dict())


@pytest.mark.parametrize("name", WRAPPERS)
def test_state_dict_loads_into_torch_ddp_and_back(cluster_of, name):
    for same_keys, diff in cluster_of(2).run(_state_dict_round_trip, name):
        assert same_keys and diff == 0


def _uneven_with_buffers(name):
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = WithBatchNorm()
    if name == "torch":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
    else:
        model = _wrap(name, model)
    opt = make_optimizer(model.parameters(), "sgd")
    with model.join():  # torch DDP's spelling of Join([model])
        for step in range(2 + 2 * rank):  # rank 1 has two more batches
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * step + rank))
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return {k: v.clone() for k, v in model.module.state_dict().items()}


@pytest.mark.parametrize("name", ["bucketed", "overlapped"])
def test_model_join_with_buffers_finishes_and_equals_torch_ddp(cluster_of, name):
    ours = cluster_of(2).run(_uneven_with_buffers, name)
    theirs = cluster_of(2).run(_uneven_with_buffers, "torch")
    for a, b in zip(ours, theirs, strict=True):
        assert max_abs_diff(a, b) < TOL
