"""The pieces every strategy shares (ddpkit/strategies/common.py) and the recorder seam they record through."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddpkit
from ddpkit.experiment import local_batch, make_optimizer, max_abs_diff, train_single_process, train_step
from ddpkit.models import build_model
from ddpkit.strategies.common import (
    broadcast_from_rank0, check_same_shapes, nbytes, prepare_module, require_process_group, unique_named_parameters,
)
from ddpkit.strategies.ddp_module import DDPModule
from ddpkit.trace.seam import NULL_RECORDER, NullRecorder


def test_null_recorder_is_off_and_accepts_the_four_calls():
    assert NULL_RECORDER.enabled is False and isinstance(NULL_RECORDER, NullRecorder)
    with NULL_RECORDER.span("forward", cat="compute", step=1) as inside:
        assert inside is None
    assert NULL_RECORDER.collective("all_reduce", None, nbytes=4, bucket=0) is None
    assert NULL_RECORDER.grad_ready("w", bucket=0) is None
    assert NULL_RECORDER.memory(parameters=1, gradients=2) is None


def test_nbytes():
    assert nbytes(torch.empty(3, 5)) == 60
    assert nbytes(torch.empty(7, dtype=torch.float16)) == 14
    assert nbytes(torch.empty(0)) == 0


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(3, 5, bias=False)
        self.out.weight = self.emb.weight


def test_unique_named_parameters_lists_tied_once_and_skips_frozen():
    m = Tied()
    assert [n for n, _ in unique_named_parameters(m)] == ["emb.weight"]
    assert [n for n, _ in unique_named_parameters(m, trainable_only=False)] == [
        "emb.weight", "frozen.weight", "frozen.bias"]


def test_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("this test process already joined a process group")
    with pytest.raises(RuntimeError, match="SomeDDP needs a process group.*init_process_group"):
        require_process_group("SomeDDP")
    with pytest.raises(TypeError, match="wraps an nn.Module, got dict"):
        prepare_module("SomeDDP", {})


def _shapes(kind):
    rank = dist.get_rank()
    if kind == "count":
        m = nn.Sequential(*[nn.Linear(2, 2) for _ in range(1 + rank)])
    elif kind == "dtype":
        m = nn.Linear(2, 2).to(torch.float64 if rank == 1 else torch.float32)
    else:  # same parameters, a buffer of a different shape
        m = nn.Linear(2, 2)
        m.register_buffer("stats", torch.zeros(3 if rank == 0 else 4))
    check_same_shapes(m)


@pytest.mark.parametrize("kind,message", [
    ("count", "rank 0 has 2 parameters and buffers, rank 1 has 4"),
    ("dtype", r"parameter 'weight' has shape \[2, 2\] \(torch.float32\) on rank 0 "
              r"but \[2, 2\] \(torch.float64\) on rank 1"),
    ("buffer", r"buffer 'stats' has shape \[3\] \(torch.float32\) on rank 0 but \[4\]"),
])
def test_check_same_shapes_names_what_differs(cluster_of, kind, message):
    with pytest.raises(ddpkit.RankError, match=message):
        cluster_of(2).run(_shapes, kind)


def _broadcast_in_subgroup():
    # ranks 1 and 2 form a group; its "rank 0" is global rank 1, which must be the source
    rank = dist.get_rank()
    group = dist.new_group([1, 2])
    t = torch.full((3,), float(rank))
    if rank in (1, 2):
        broadcast_from_rank0([t], group)
    dist.barrier()
    return t


def test_broadcast_from_rank0_of_an_explicit_group(cluster_of):
    out = cluster_of(3).run(_broadcast_in_subgroup)
    assert [t.tolist() for t in out] == [[0.0] * 3, [1.0] * 3, [1.0] * 3]


def _broadcast_coalesced(bucket_bytes):
    """Rank-dependent tensors of three dtypes (one of them a non-contiguous view) broadcast from
    rank 0; returns them and the broadcasts issued (dist.broadcast counted)."""
    from ddpkit.strategies import common

    rank = dist.get_rank()
    tensors = [torch.full((4, 3), rank + 0.5), torch.full((5,), rank, dtype=torch.int64),
               torch.full((2, 2), rank + 0.25, dtype=torch.float64), torch.full((6, 2), rank + 1.5).t(),
               torch.full((3,), rank + 2.5), torch.empty(7, device="meta")]
    calls = []
    real = dist.broadcast
    common.dist.broadcast = lambda t, *args, **kwargs: calls.append((t.dtype, t.numel())) or real(t, *args, **kwargs)
    try:
        broadcast_from_rank0(tensors, bucket_bytes=bucket_bytes)
    finally:
        common.dist.broadcast = real
    return [t for t in tensors if not t.is_meta], calls


@pytest.mark.parametrize("bucket_bytes, broadcasts", [
    (250 * 1024 * 1024, [(torch.float32, 27), (torch.int64, 5), (torch.float64, 4)]),
    (80, [(torch.float32, 12), (torch.float32, 15), (torch.int64, 5), (torch.float64, 4)]),
    (0, [(torch.float32, 12), (torch.float32, 12), (torch.float32, 3), (torch.int64, 5), (torch.float64, 4)]),
])
def test_broadcast_from_rank0_is_coalesced_by_dtype_within_the_cap(cluster_of, bucket_bytes, broadcasts):
    """torch DDP's construction: one flat broadcast per dtype (and device) of up to 250 MiB; a smaller
    cap cuts a kind's tensors into runs (a tensor over it alone); 0: one broadcast per tensor."""
    for rank, (tensors, calls) in enumerate(cluster_of(2).run(_broadcast_coalesced, bucket_bytes)):
        assert calls == broadcasts, rank  # meta tensors are left for deferred init
        assert [t.tolist() for t in tensors] == [t.tolist() for t in _broadcast_coalesced_expected()], rank


def _broadcast_coalesced_expected():
    return [torch.full((4, 3), 0.5), torch.full((5,), 0, dtype=torch.int64),
            torch.full((2, 2), 0.25, dtype=torch.float64), torch.full((6, 2), 1.5).t(), torch.full((3,), 2.5)]


def _train_in_subgroup(strategy):
    # Ranks 1 and 2 train as a world of 2 over their own group; rank 0 is not involved.
    rank = dist.get_rank()
    group = dist.new_group([1, 2])
    if rank == 0:
        return None
    grank, gsize = dist.get_rank(group), dist.get_world_size(group)
    module = build_model("mlp", seed=grank, width=8, depth=2)  # group rank 1 starts apart
    cls = {"naive": ddpkit.NaiveDDP, "bucketed": ddpkit.BucketedDDP, "overlapped": ddpkit.OverlappedDDP}[strategy]
    kwargs = {} if strategy == "naive" else dict(bucket_cap_mb=0)
    model = cls(module, process_group=group, **kwargs)
    opt = make_optimizer(model.parameters())
    for step in range(5):
        train_step(model, opt, *local_batch(module, 8, step, grank, gsize))
    return model.full_state_dict()


@pytest.mark.parametrize("strategy", ["naive", "bucketed", "overlapped"])
def test_strategies_use_the_process_group_they_are_given(cluster_of, strategy):
    out = cluster_of(3).run(_train_in_subgroup, strategy)
    reference = train_single_process("mlp", "sgd", steps=5, global_batch_size=8, width=8, depth=2)
    assert out[0] is None
    for params in out[1:]:
        assert max_abs_diff(params, reference) < 1e-5


class Echo(DDPModule):
    """The smallest DDPModule: counts syncs instead of communicating."""

    def __init__(self, module):
        super().__init__(module)
        self.syncs = 0

    def _sync_gradients(self):
        self.syncs += 1


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))

    def forward(self, x, scale=1.0):
        return self.w * x * scale


def _ddp_module_contract():
    m = Echo(TwoInputs())
    out = {"forward": m(torch.ones(2), scale=3.0).tolist()}  # args and kwargs pass through
    m.finish_gradient_synchronization()
    m.finish_gradient_synchronization()
    out["after_forward"] = m.syncs  # one sync for one forward, however often finish is called
    with m.no_sync():
        m(torch.ones(2))
        m.finish_gradient_synchronization()
    out["in_no_sync"] = m.syncs
    try:
        with m.no_sync():
            raise KeyError
    except KeyError:
        pass
    m(torch.ones(2))  # no_sync was left by an exception: syncing is back on
    m.finish_gradient_synchronization()
    out["after_exception"] = m.syncs
    with torch.no_grad():
        m(torch.ones(2))
    m.finish_gradient_synchronization()
    out["after_eval_forward"] = m.syncs
    state = m.full_state_dict()
    state["w"].add_(1)  # a clone: the model is untouched
    out["state"] = (list(state), m.module.w.tolist())
    out["buffers"] = m.comm_buffer_bytes()
    out["world_size"] = m.world_size
    return out


def test_ddp_module_forward_no_sync_finish_and_state(cluster_of):
    out = cluster_of(1).run(_ddp_module_contract)[0]
    assert out["forward"] == [3.0, 3.0]
    assert out["after_forward"] == 1
    assert out["in_no_sync"] == 1
    assert out["after_exception"] == 2
    assert out["after_eval_forward"] == 2
    assert out["state"] == (["w"], [1.0, 1.0])
    assert out["buffers"] == 0 and out["world_size"] == 1


def _built_inside_recording():
    from ddpkit.trace.seam import recorder, recording
    from ddpkit.strategies.table import NAMES
    from ddpkit.trace import Recorder

    rec = Recorder()
    taken = {}
    with recording(rec):
        assert recorder() is rec
        for name in NAMES:
            model, opt = ddpkit.experiment.wrap(name, build_model("mlp", seed=0, width=8, depth=2))
            taken[name] = model.recorder is rec if hasattr(model, "recorder") else None
    outside = ddpkit.experiment.wrap("naive", build_model("mlp", seed=0, width=8, depth=2))[0].recorder
    # (not `is NULL_RECORDER`: this test file travels to the ranks by value, with a copy of it)
    return taken, outside.enabled is False, recorder().enabled is False


def test_strategies_built_while_recording_take_the_ranks_recorder(cluster_of):
    taken, outside_is_null, restored = cluster_of(2).run(_built_inside_recording)[0]
    assert taken and all(taken.values()), taken
    assert outside_is_null and restored
