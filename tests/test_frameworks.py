"""What accelerate and Lightning read on torch's DDP, on ours (``strategies/torch_ddp_surface.py``), each
beside torch's own answer; and ``ddpkit.frameworks.use``, which puts ours where they build torch's. The
frameworks' whole runs under torchrun are ``test_framework_runs.py``."""
from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ddpkit
from ddpkit.experiment import local_batch, max_abs_diff
from ddpkit.models import build_model, loss_fn
from ddpkit.strategies.torch_ddp_surface import TorchDDPSurface
from helpers import SMALL_CAP, SMALL_MLP, TOL, CountingRecorder

WRAPPERS = {"naive": ddpkit.NaiveDDP, "bucketed": ddpkit.BucketedDDP, "overlapped": ddpkit.OverlappedDDP}


def surfaced(name: str) -> type:
    """The wrapper with torch DDP's surface (mixed in here until the torch-compatibility layer has it)."""
    cls = WRAPPERS[name]
    return cls if issubclass(cls, TorchDDPSurface) else type(cls.__name__, (TorchDDPSurface, cls), {})


def _caps(name: str) -> dict:
    return {} if name == "naive" else {"bucket_cap_mb": SMALL_CAP}  # several buckets


# --------------------------------------------------------------------------- logging data
def _logging_data(name: str):
    module = build_model("mlp", seed=0, **SMALL_MLP)
    theirs = DistributedDataParallel(copy.deepcopy(module), bucket_cap_mb=0 if name == "naive" else SMALL_CAP)
    ours = surfaced(name)(copy.deepcopy(module), **_caps(name))
    before = theirs._get_ddp_logging_data(), ours._get_ddp_logging_data()
    for model in (theirs, ours):  # steps add torch's runtime figures and its rebuilt buckets
        for step in range(3):  # torch logs its rebuilt buckets at the third forward
            x, y = local_batch(module, 8, step, dist.get_rank(), dist.get_world_size())
            loss_fn(model(x), y).backward()
    return before, (theirs._get_ddp_logging_data(), ours._get_ddp_logging_data())


@pytest.mark.parametrize("name", WRAPPERS)
def test_ddp_logging_data_has_torchs_keys_and_this_wrappers_values(cluster_of, name):
    for rank, ((theirs, ours), (theirs_later, ours_later)) in enumerate(cluster_of(2).run(_logging_data, name)):
        assert ours.keys() <= theirs.keys() and ours == ours_later, sorted(ours.keys() - theirs.keys())
        assert ours["rank"] == rank and ours["world_size"] == 2 and ours["module_name"] == "MLP"
        same = ["world_size", "rank", "module_name", "backend_name", "device_ids", "output_device", "broadcast_buffers",
                "find_unused_parameters", "gradient_as_bucket_view", "has_sync_bn", "is_multi_device_module",
                "num_parameter_tensors", "total_parameter_size_bytes", "bucket_cap_bytes"]
        assert {k: ours[k] for k in same} == {k: theirs[k] for k in same}
        sizes = [int(s) for s in ours["bucket_sizes"].split(", ")]
        assert sum(sizes) == ours["total_parameter_size_bytes"]
        if name != "naive":  # torch's buckets once it rebuilt them in arrival order (first: all in one)
            assert ours["bucket_sizes"] == theirs_later["rebuilt_bucket_sizes"] and len(sizes) > 1
        assert "can_set_static_graph" not in ours  # torch sets it when its reducer is destroyed, not before


# --------------------------------------------------------------------------- flags
def _flags(name: str) -> list[list]:
    """require_forward_param_sync after each of: construction, a training step, one in no_sync(), an eval
    forward, a training step, setting it; for torch's DDP and for ours."""
    seen = []
    for build in (DistributedDataParallel, surfaced(name)):
        module = build_model("mlp", seed=0, **SMALL_MLP)
        model = build(module)
        x, y = local_batch(module, 8, 0, dist.get_rank(), dist.get_world_size())
        values = [model.require_forward_param_sync]
        loss_fn(model(x), y).backward()
        values.append(model.require_forward_param_sync)
        with model.no_sync():
            loss_fn(model(x), y).backward()
        values.append(model.require_forward_param_sync)
        with torch.no_grad():
            model(x)
        values.append(model.require_forward_param_sync)
        loss_fn(model(x), y).backward()
        values.append(model.require_forward_param_sync)
        model.require_forward_param_sync = False
        values += [model.require_forward_param_sync, model.static_graph]
        seen.append(values)
    return seen


@pytest.mark.parametrize("name", WRAPPERS)
def test_require_forward_param_sync_and_static_graph_read_as_torchs(cluster_of, name):
    for theirs, ours in cluster_of(2).run(_flags, name):
        assert ours == theirs == [True, True, False, False, True, False, False]


def _static_graph():
    model = surfaced("overlapped")(build_model("mlp", seed=0, **SMALL_MLP))
    before = model.static_graph
    model._set_static_graph()
    with pytest.warns(UserWarning, match="static_graph"):
        model._set_static_graph()  # as torch's: a second time only warns
    return before, model.static_graph, model._get_ddp_logging_data().get("static_graph")


def test_set_static_graph_sets_torchs_flag(cluster_of):
    assert cluster_of(2).run(_static_graph) == [(False, True, 1)] * 2


# --------------------------------------------------------------------------- the reducer
def _trigger_sync(name: str, prepare: bool = True):
    """accelerate's ``trigger_sync_in_backward``: two forwards inside no_sync(), the first backward local,
    then (``prepare``) the flags and ``reducer.prepare_for_backward([])``, and the second backward syncs.
    The gradients, on torch's DDP and on ours."""
    rank, world = dist.get_rank(), dist.get_world_size()
    grads = []
    for build in (DistributedDataParallel, surfaced(name)):
        module = build_model("mlp", seed=0, **SMALL_MLP)
        model = build(module, **({} if build is DistributedDataParallel else _caps(name)))
        (xa, ya), (xb, yb) = local_batch(module, 8, 0, rank, world), local_batch(module, 8, 1, rank, world)
        with model.no_sync():
            first, second = loss_fn(model(xa), ya), loss_fn(model(xb), yb)
        first.backward()
        if prepare or build is DistributedDataParallel:
            model.require_backward_grad_sync = model.require_forward_param_sync = True
            model.reducer.prepare_for_backward([])
        second.backward()
        grads.append({n: p.grad.clone() for n, p in module.named_parameters()})
    return grads


@pytest.mark.parametrize("name", WRAPPERS)
def test_prepare_for_backward_makes_the_next_backward_sync_as_torchs(cluster_of, name):
    for theirs, ours in cluster_of(2).run(_trigger_sync, name):
        assert max_abs_diff(ours, theirs) < TOL
    # and without it ours keeps each rank's own sum: the comparison above can fail
    assert all(max_abs_diff(ours, theirs) > 1e-3 for theirs, ours in cluster_of(2).run(_trigger_sync, name, False))


def _reducer_calls():
    model = surfaced("overlapped")(build_model("mlp", seed=0, **SMALL_MLP))
    rebuilt = model.reducer._rebuild_buckets()
    model.reducer._delay_all_reduce()  # nothing pending: a no-op, as torch's after its static first step
    with pytest.raises(AttributeError, match=r"OverlappedDDP.reducer._set_sparse_metadata: .*no C\+\+ reducer"):
        model.reducer._set_sparse_metadata({})
    return rebuilt


def test_the_reducer_answers_what_the_frameworks_call_and_refuses_the_rest_by_name(cluster_of):
    assert cluster_of(2).run(_reducer_calls) == [False, False]


# --------------------------------------------------------------------------- communication hooks
def _torch_hooks():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    rank, world = dist.get_rank(), dist.get_world_size()
    sent = {}
    defaults = default_hooks.allreduce_hook, default_hooks.fp16_compress_hook, default_hooks.bf16_compress_hook
    for torch_hook in defaults:
        module = build_model("mlp", seed=0, **SMALL_MLP)
        recorder = CountingRecorder()
        model = surfaced("overlapped")(module, recorder=recorder)
        model.register_comm_hook(state=None, hook=torch_hook)  # accelerate's and Lightning's call
        x, y = local_batch(module, 8, 0, rank, world)
        loss_fn(model(x), y).backward()
        sent[torch_hook.__name__] = (sum(n for _, n, _ in recorder.collectives("all_reduce")),
                                     model._get_ddp_logging_data()["comm_hook"])
    model = surfaced("bucketed")(build_model("mlp", seed=0, **SMALL_MLP))
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)  # torch's positional form
    other_group = dist.new_group(list(range(world)))  # the same ranks, but not the wrapper's group
    refused = {}
    for what, (state, hook) in {
            "powerSGD_hook": (powerSGD_hook.PowerSGDState(None), powerSGD_hook.powerSGD_hook),
            "fp16_compress_wrapper": (None, default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)),
            "process group": (other_group, default_hooks.allreduce_hook)}.items():
        with pytest.raises(ValueError) as error:
            surfaced("overlapped")(build_model("mlp", seed=0, **SMALL_MLP)).register_comm_hook(state=state, hook=hook)
        refused[what] = str(error.value)
    with pytest.raises(TypeError) as error:
        surfaced("naive")(build_model("mlp", seed=0, **SMALL_MLP)).register_comm_hook(
            state=None, hook=default_hooks.allreduce_hook)
    refused["naive"] = str(error.value)
    return sent, refused


def test_torchs_default_hooks_become_ours_and_other_hooks_are_refused_by_name(cluster_of):
    for sent, refused in cluster_of(2).run(_torch_hooks):
        full = sent["allreduce_hook"][0]
        assert full == 4 * sum(p.numel() for p in build_model("mlp", seed=0, **SMALL_MLP).parameters())
        assert sent["fp16_compress_hook"][0] == sent["bf16_compress_hook"][0] == full // 2  # 16 bits on the wire
        assert [name for _, name in sent.values()] == ["allreduce", "fp16_compress", "bf16_compress"]
        assert "'powerSGD_hook' has no ddpkit counterpart" in refused["powerSGD_hook"]
        assert "fp16_compress_wrapper" in refused["fp16_compress_wrapper"]
        assert "state=" in refused["process group"] and "give state=None" in refused["process group"]
        assert "NaiveDDP has no buckets" in refused["naive"]


# --------------------------------------------------------------------------- refused at construction
def test_parameters_to_ignore_are_refused_by_name_before_any_communication():
    module = build_model("mlp", seed=0, **SMALL_MLP)
    module._ddp_params_and_buffers_to_ignore = ["layers.0.weight"]
    with pytest.raises(ValueError, match=r"_ddp_params_and_buffers_to_ignore: layers.0.weight"):
        surfaced("overlapped")(module)  # no process group here: it fails before needing one
    with pytest.raises(ValueError, match="_set_params_and_buffers_to_ignore_for_model"):
        surfaced("naive")._set_params_and_buffers_to_ignore_for_model(module, ["layers.0.weight"])


# --------------------------------------------------------------------------- frameworks.use
LIGHTNING = ["pytorch_lightning.strategies.ddp", "lightning_fabric.strategies.ddp", "lightning.pytorch.strategies.ddp",
             "lightning.fabric.strategies.ddp"]


def _holders() -> list:
    return [torch.nn.parallel.DistributedDataParallel, torch.nn.parallel.distributed.DistributedDataParallel] + [
        sys.modules[m].DistributedDataParallel for m in LIGHTNING]


def test_use_rebinds_torchs_names_and_the_frameworks_for_the_block_only(monkeypatch):
    torch_ddp = torch.nn.parallel.distributed.DistributedDataParallel
    for name in LIGHTNING:  # Lightning's strategy modules, as imported before the block (module-level alias)
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(DistributedDataParallel=torch_ddp))
    with pytest.warns(UserWarning, match="no DistributedDataParallel was built in the block"):
        with ddpkit.frameworks.use(ddpkit.OverlappedDDP, bucket_cap_mb=5) as cls:
            assert issubclass(cls, ddpkit.OverlappedDDP) and cls.__name__ == "OverlappedDDP"
            assert _holders() == [cls] * 6
            # a framework module imported inside the block takes ours from torch's name ...
            late = types.SimpleNamespace(DistributedDataParallel=torch.nn.parallel.distributed.DistributedDataParallel)
            sys.modules["lightning.pytorch.strategies.ddp"] = late
    assert _holders() == [torch_ddp] * 6  # ... and every name is torch's again after it
    assert late.DistributedDataParallel is torch_ddp


def test_use_restores_torchs_names_when_the_block_raises():
    torch_ddp = torch.nn.parallel.DistributedDataParallel
    with pytest.raises(KeyError), ddpkit.frameworks.use(ddpkit.NaiveDDP):
        raise KeyError("inside")
    assert torch.nn.parallel.DistributedDataParallel is torch_ddp
    assert torch.nn.parallel.distributed.DistributedDataParallel is torch_ddp


def test_use_refuses_what_cannot_stand_for_torchs_ddp():
    for wrapper, says in [(ddpkit.ZeRO1, "make_optimizer"), (ddpkit.FSDP, "fully_shard"),
                          (DistributedDataParallel, "NaiveDDP, BucketedDDP or OverlappedDDP")]:
        with pytest.raises(TypeError, match=says), ddpkit.frameworks.use(wrapper):
            pass
    with pytest.raises(TypeError, match="bucket_cap"), ddpkit.frameworks.use(ddpkit.BucketedDDP, bucket_cap=5):
        pass  # misspelt: refused on entry, not inside the framework
    with pytest.raises(RuntimeError, match="already inside"), ddpkit.frameworks.use(ddpkit.NaiveDDP):
        with ddpkit.frameworks.use(ddpkit.OverlappedDDP):
            pass
    assert torch.nn.parallel.DistributedDataParallel is DistributedDataParallel


def _built_as_torchs():
    """What a framework does inside the block: build torch's name with torch's arguments, recognise it."""
    module = build_model("mlp", seed=0, **SMALL_MLP)
    with ddpkit.frameworks.use(ddpkit.BucketedDDP, bucket_cap_mb=SMALL_CAP):
        # torch's positional order: (module, device_ids, output_device, dim, broadcast_buffers)
        model = torch.nn.parallel.DistributedDataParallel(module, None, None, 0, False, find_unused_parameters=True)
        recognised = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        with pytest.raises(ValueError, match=r"passes bucket_cap_mb=25 and the block bucket_cap_mb=0.001"):
            torch.nn.parallel.DistributedDataParallel(copy.deepcopy(module), bucket_cap_mb=25)
        with pytest.raises(TypeError, match="bucket_cap"):  # not an argument of torch's: torch's TypeError
            torch.nn.parallel.DistributedDataParallel(copy.deepcopy(module), bucket_cap=25)
    return (type(model).__name__, recognised, isinstance(model, DistributedDataParallel), len(model.buckets) > 1,
            model.find_unused_parameters, model._get_ddp_logging_data()["broadcast_buffers"])


def test_inside_use_torchs_name_builds_ours_with_torchs_arguments(cluster_of):
    assert cluster_of(2).run(_built_as_torchs) == [("BucketedDDP", True, False, True, True, 0)] * 2
