"""NaiveDDP, BucketedDDP, OverlappedDDP: every rule of DDP kept.

Each test ships one job to a shared gloo Cluster (``cluster_of(n)``) and checks what the ranks
send back. The reference is always plain single-process training on the whole global batch;
that each wrapper equals it (1, 2 and 4 ranks, MLP and TinyGPT, SGD and AdamW, several
buckets) is tested for every strategy of the table in ``test_equivalence.py``.
"""
from __future__ import annotations

import contextlib
import math
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddpkit
from ddpkit.experiment import local_batch, make_optimizer, max_abs_diff, train_step
from ddpkit.models import build_model, loss_fn, make_batch
from ddpkit.strategies.common import unique_named_parameters
from ddpkit.strategies.buckets import assign_buckets, bucket_cap_bytes
from helpers import SMALL_CAP, SMALL_GPT, SMALL_MLP, TOL, CountingRecorder, reference_params, train_on_rank

STRATEGIES = ("naive", "bucketed", "overlapped")


def wrap(strategy, module, bucket_cap_mb=SMALL_CAP, recorder=None, **options):
    if strategy == "naive":
        return ddpkit.NaiveDDP(module, recorder=recorder, **options)
    cls = ddpkit.BucketedDDP if strategy == "bucketed" else ddpkit.OverlappedDDP
    return cls(module, bucket_cap_mb=bucket_cap_mb, recorder=recorder, **options)


def _one_bucket_run(bucket_cap_mb):
    rank = dist.get_rank()
    out = {}
    for strategy in ("bucketed", "overlapped"):
        module = build_model("mlp", seed=rank, **SMALL_MLP)
        model = wrap(strategy, module, bucket_cap_mb)
        train_on_rank(model, module, make_optimizer(model.parameters(), "sgd"), 5, 12)
        out[strategy] = (model.full_state_dict(), len(model.buckets))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_one_bucket_equals_one_process(cluster_of, world_size):
    # the matrix (test_equivalence.py) trains with several buckets; here the default cap holds them all
    reference = reference_params("mlp", "sgd", batch=12, **SMALL_MLP)
    for rank, out in enumerate(cluster_of(world_size).run(_one_bucket_run, 25.0)):
        for strategy, (params, n_buckets) in out.items():
            assert n_buckets == 1
            diff = max_abs_diff(params, reference)
            assert diff < TOL, f"{strategy} cap=25: rank {rank} off by {diff}"


def _first_bucket_run(first_bucket_mb):
    rank = dist.get_rank()
    out = {}
    for cls in (ddpkit.BucketedDDP, ddpkit.OverlappedDDP):
        module = build_model("mlp", seed=rank, **SMALL_MLP)
        model = cls(module, bucket_cap_mb=25.0, first_bucket_mb=first_bucket_mb)
        train_on_rank(model, module, make_optimizer(model.parameters(), "sgd"), 5, 12)
        out[cls.__name__] = (model.full_state_dict(), [b.nbytes for b in model.buckets])
    return out


def test_a_first_bucket_of_its_own_as_torch_ddp_lays_them_out_and_equals_one_process(cluster_of):
    # SMALL_MLP holds 5 KiB of gradients: a 1 KiB first bucket, the rest in one more (torch's default layout, scaled)
    reference = reference_params("mlp", "sgd", batch=12, **SMALL_MLP)
    for out in cluster_of(2).run(_first_bucket_run, 1 / 1024):
        for name, (params, sizes) in out.items():
            assert len(sizes) == 2 and 1024 <= sizes[0] < sum(sizes) / 2, (name, sizes)
            assert max_abs_diff(params, reference) < TOL, name
    with pytest.raises(ValueError, match="MiB"):
        ddpkit.OverlappedDDP(nn.Linear(2, 2), first_bucket_mb=-1)


def _views_run(strategy, set_to_none, micro=2, steps=4):
    """Train with gradient_as_bucket_view (micro-batches under no_sync() too); count the copies."""
    rank, world = dist.get_rank(), dist.get_world_size()
    module = build_model("mlp", seed=rank, **SMALL_MLP)
    cls = ddpkit.BucketedDDP if strategy == "bucketed" else ddpkit.OverlappedDDP
    model = cls(module, bucket_cap_mb=SMALL_CAP, gradient_as_bucket_view=True)
    opt = make_optimizer(model.parameters(), "sgd")
    copies = {"in": 0}
    mul = torch.mul

    def counting_mul(*args, **kwargs):  # Bucket.copy_in copies with torch.mul(grad, scale, out=slot)
        copies["in"] += "out" in kwargs
        return mul(*args, **kwargs)

    per_step = []
    for step in range(steps):
        x, y = local_batch(module, 12, step, rank, world)
        copies["in"] = 0
        torch.mul = counting_mul
        try:
            for k, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
                with contextlib.nullcontext() if k == micro - 1 else model.no_sync():
                    (loss_fn(model(xm), ym) / micro).backward()
            model.finish_gradient_synchronization()
        finally:
            torch.mul = mul
        views = all(b.is_slot(j) for b in model.buckets for j in range(len(b.params)))
        per_step.append((copies["in"], views, model.comm_buffer_bytes()))
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return model.full_state_dict(), per_step


@pytest.mark.parametrize("strategy", ["bucketed", "overlapped"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_as_bucket_views_equal_one_process_without_copies(cluster_of, strategy, set_to_none):
    # torch DDP's gradient_as_bucket_view: each .grad is its bucket slot after a sync, so the
    # buckets hold no second copy of the gradients; gradients that stay views (zeroed, not set
    # to None) accumulate into their slots and are never copied in; either way the same result
    reference = reference_params("mlp", "sgd", steps=4, batch=12, **SMALL_MLP)
    n_params = len(list(build_model("mlp", **SMALL_MLP).parameters()))
    for params, per_step in cluster_of(2).run(_views_run, strategy, set_to_none):
        assert max_abs_diff(params, reference) < TOL
        for step, (copied_in, views, buffer_bytes) in enumerate(per_step):
            assert views and buffer_bytes == 0, (step, views, buffer_bytes)
            assert copied_in == (n_params if set_to_none or step == 0 else 0), (step, copied_in)


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x):
        return self.bn(self.fc(x))


def _wrapped_state():
    rank = dist.get_rank()
    out = {}
    for strategy in STRATEGIES:
        torch.manual_seed(rank)  # different weights on every rank
        module = BatchNormNet()
        module.bn.running_mean.fill_(float(rank + 1))  # different buffers too
        module.bn.num_batches_tracked.fill_(rank + 7)
        before = {k: v.clone() for k, v in module.state_dict().items()}
        wrap(strategy, module)
        out[strategy] = (before, {k: v.clone() for k, v in module.state_dict().items()})
    return out


def test_wrapping_broadcasts_rank0_parameters_and_buffers(cluster_of):
    per_rank = cluster_of(3).run(_wrapped_state)
    for strategy in STRATEGIES:
        rank0_before = per_rank[0][strategy][0]
        assert max_abs_diff(per_rank[1][strategy][0], rank0_before) > 0  # they did start apart
        for rank in range(3):
            after = per_rank[rank][strategy][1]
            assert max_abs_diff(after, rank0_before) == 0, (strategy, rank)
            assert after["bn.running_mean"].eq(1.0).all()
            assert after["bn.num_batches_tracked"].item() == 7


def _frozen_run(strategy):
    rank, world = dist.get_rank(), dist.get_world_size()

    def build():
        module = build_model("mlp", seed=0, **SMALL_MLP)
        module.layers[1].requires_grad_(False)  # freeze one Linear: weight and bias
        return module

    reference = build()
    ref_opt = make_optimizer([p for p in reference.parameters() if p.requires_grad], "sgd")
    module = build()
    frozen_before = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    recorder = CountingRecorder()
    model = wrap(strategy, module, recorder=recorder)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], "sgd")
    for step in range(3):
        x, y = make_batch(reference, 12, step)
        loss_fn(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        train_step(model, opt, *local_batch(module, 12, step, rank, world))
    names_ready = {e[1] for e in recorder.ready()}
    buckets = [n for b in getattr(model, "buckets", []) for n in b.names]
    reduced_bytes = sum(e[1] for e in recorder.collectives())
    trainable_bytes = sum(p.numel() * 4 for p in module.parameters() if p.requires_grad)
    frozen_after = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    return dict(frozen=sorted(frozen_before), ready=names_ready, in_buckets=buckets,
                reduced_bytes=reduced_bytes, trainable_bytes=trainable_bytes,
                frozen_same=max_abs_diff(frozen_before, frozen_after),
                frozen_grads=[p.grad for p in module.parameters() if not p.requires_grad],
                diff=max_abs_diff(model.full_state_dict(),
                                  {n: p.detach() for n, p in reference.named_parameters()}))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_frozen_parameters_never_reduced(cluster_of, strategy):
    for r in cluster_of(2).run(_frozen_run, strategy):
        assert r["frozen"] == ["layers.1.0.bias", "layers.1.0.weight"]
        assert not set(r["frozen"]) & (r["ready"] | set(r["in_buckets"]))
        assert r["ready"]  # the recorder did see the trainable ones
        assert r["reduced_bytes"] == 3 * r["trainable_bytes"]  # 3 steps, trainable bytes only
        assert r["frozen_same"] == 0 and r["frozen_grads"] == [None, None]
        assert r["diff"] < TOL


def _tied_run(strategy):
    module = build_model("gpt", seed=0, **SMALL_GPT)
    recorder = CountingRecorder()
    model = wrap(strategy, module, recorder=recorder)
    rank, world = dist.get_rank(), dist.get_world_size()
    train_step(model, make_optimizer(model.parameters()), *local_batch(module, 12, 0, rank, world))
    unique_bytes = sum(p.numel() * 4 for p in module.parameters())  # parameters() lists tied once
    return dict(bytes=sum(e[1] for e in recorder.collectives()), unique_bytes=unique_bytes,
                ready=[e[1] for e in recorder.ready()],
                in_buckets=[n for b in getattr(model, "buckets", []) for n in b.names],
                same_object=module.head.weight is module.tok.weight)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tied_weights_reduced_once(cluster_of, strategy):
    for r in cluster_of(2).run(_tied_run, strategy):
        assert r["same_object"]
        assert r["bytes"] == r["unique_bytes"]
        assert r["ready"].count("tok.weight") == 1 and "head.weight" not in r["ready"]
        if strategy != "naive":
            assert r["in_buckets"].count("tok.weight") == 1 and "head.weight" not in r["in_buckets"]


def _no_sync_run(strategy, micro=3, steps=3):
    rank, world = dist.get_rank(), dist.get_world_size()
    module = build_model("mlp", seed=0, **SMALL_MLP)
    recorder = CountingRecorder()
    model = wrap(strategy, module, recorder=recorder)
    opt = make_optimizer(model.parameters(), "sgd")
    launched_inside = 0
    for step in range(steps):
        x, y = local_batch(module, 12, step, rank, world)
        for k, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            last = k == micro - 1
            with contextlib.nullcontext() if last else model.no_sync():
                before = len(recorder.collectives())
                (loss_fn(model(xm), ym) / micro).backward()  # equal chunks: mean of means
                if not last:
                    model.finish_gradient_synchronization()  # must not sync either
                    launched_inside += len(recorder.collectives()) - before
        model.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.full_state_dict(), launched_inside, len(recorder.collectives())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_sync_micro_batches_equal_one_large_batch(cluster_of, strategy):
    reference = reference_params("mlp", "sgd", steps=3, batch=12, **SMALL_MLP)
    n_tensors = len(list(build_model("mlp", **SMALL_MLP).parameters()))
    for params, launched_inside, total in cluster_of(2).run(_no_sync_run, strategy):
        assert max_abs_diff(params, reference) < TOL
        assert launched_inside == 0
        assert total > 0 and (strategy != "naive" or total == 3 * n_tensors)


def _count_run(strategy, bucket_cap_mb, steps=3):
    rank, world = dist.get_rank(), dist.get_world_size()
    module = build_model("mlp", seed=0, **SMALL_MLP)
    recorder = CountingRecorder()
    model = wrap(strategy, module, bucket_cap_mb, recorder=recorder)
    opt = make_optimizer(model.parameters())
    per_step = []
    for step in range(steps):
        before = len(recorder.collectives())
        train_step(model, opt, *local_batch(module, 12, step, rank, world))
        per_step.append(recorder.collectives()[before:])
    buckets = [(b.names, b.nbytes) for b in getattr(model, "buckets", [])]
    return per_step, buckets, model.comm_buffer_bytes()


@pytest.mark.parametrize("strategy,cap", [("naive", None), ("bucketed", SMALL_CAP), ("bucketed", 0),
                                          ("bucketed", 25.0), ("overlapped", SMALL_CAP)])
def test_collectives_per_step(cluster_of, strategy, cap):
    module = build_model("mlp", **SMALL_MLP)
    sizes = [p.numel() * 4 for p in module.parameters()]
    for per_step, buckets, buffer_bytes in cluster_of(2).run(_count_run, strategy, cap):
        for launched in per_step:
            if strategy == "naive":  # one all-reduce per tensor, registration order
                assert [(e[1], e[2]) for e in launched] == list(zip(sizes, range(len(sizes)), strict=True))
                assert buffer_bytes == 0
            else:  # one per bucket, in bucket order, each the bucket's bytes
                assert [(e[1], e[2]) for e in launched] == [(b[1], i) for i, b in enumerate(buckets)]
                assert buffer_bytes == sum(sizes)
            assert sum(e[1] for e in launched) == sum(sizes)
    expected = {None: len(sizes), 0: len(sizes), 25.0: 1, SMALL_CAP: 4}[cap]
    assert len(per_step) == 3 and all(len(launched) == expected for launched in per_step)


class Swapped(nn.Module):
    """Registration order a, b; forward runs b then a: a's gradients are ready first."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.a(torch.relu(self.b(x)))


def _overlap_run(model_kind):
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = Swapped() if model_kind == "swapped" else build_model("mlp", seed=0, **SMALL_MLP)
    recorder = CountingRecorder()
    cap = 0 if model_kind == "swapped" else SMALL_CAP
    model = ddpkit.OverlappedDDP(module, bucket_cap_mb=cap, recorder=recorder)
    width = 8 if model_kind == "swapped" else SMALL_MLP["width"]
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    recorder.mark("backward returned")
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    model.finish_gradient_synchronization()  # everything was done in backward: a no-op
    recorder.mark("finish returned")
    after = {n: p.grad.clone() for n, p in module.named_parameters()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, grads)
    return recorder.events, [b.names for b in model.buckets], grads, after, gathered


def expected_launches(events, buckets):
    """The rule, replayed: after each ready gradient, launch every complete bucket in order."""
    waiting, next_bucket, out = [len(b) for b in buckets], 0, []
    for e in events:
        if e[0] != "ready":
            continue
        out.append(e)
        waiting[e[2]] -= 1
        while next_bucket < len(buckets) and waiting[next_bucket] == 0:
            out.append(("all_reduce", next_bucket))
            next_bucket += 1
    return out


def as_observed(events):
    """Events up to the end of backward, collectives without their byte count."""
    end = events.index(("mark", "backward returned", None))
    return [e if e[0] == "ready" else (e[0], e[2]) for e in events[:end]]


def test_overlapped_launches_in_bucket_order_when_grads_arrive_out_of_order(cluster_of):
    for events, buckets, grads, after, gathered in cluster_of(2).run(_overlap_run, "swapped"):
        assert buckets == [["b.bias"], ["b.weight"], ["a.bias"], ["a.weight"]]
        ready_buckets = [e[2] for e in events if e[0] == "ready"]
        assert sorted(ready_buckets[:2]) == [2, 3]  # a's gradients arrive first...
        observed = as_observed(events)
        assert [e[1] for e in observed if e[0] == "all_reduce"] == [0, 1, 2, 3]  # ...yet 0 goes first
        assert observed.index(("all_reduce", 2)) > observed.index(("all_reduce", 1))
        assert observed == expected_launches(events, buckets)  # each launch exactly when due
        assert max_abs_diff(grads, after) == 0
        assert all(max_abs_diff(g, gathered[0]) == 0 for g in gathered)


def test_overlapped_launches_during_backward(cluster_of):
    for events, buckets, grads, after, gathered in cluster_of(2).run(_overlap_run, "mlp"):
        assert len(buckets) > 1
        observed = as_observed(events)
        assert observed == expected_launches(events, buckets)
        launches = [i for i, e in enumerate(observed) if e[0] == "all_reduce"]
        readies = [i for i, e in enumerate(observed) if e[0] == "ready"]
        assert launches[0] < readies[-1]  # bucket 0 is on the wire while backward still runs
        assert len(launches) == len(buckets)
        assert events[-2:] == [("mark", "backward returned", None), ("mark", "finish returned", None)]
        assert max_abs_diff(grads, after) == 0  # finish changed nothing: done in backward
        assert all(max_abs_diff(g, gathered[0]) == 0 for g in gathered)  # averaged in backward


def _finish_twice(strategy):
    rank, world = dist.get_rank(), dist.get_world_size()
    module = build_model("mlp", seed=0, **SMALL_MLP)
    recorder = CountingRecorder()
    model = wrap(strategy, module, recorder=recorder)
    model.finish_gradient_synchronization()  # nothing pending yet: no collective
    counts = [len(recorder.collectives())]
    x, y = local_batch(module, 12, 0, rank, world)
    loss_fn(model(x), y).backward()
    model.finish_gradient_synchronization()
    counts.append(len(recorder.collectives()))
    first = {n: p.grad.clone() for n, p in module.named_parameters()}
    model.finish_gradient_synchronization()
    counts.append(len(recorder.collectives()))
    with torch.no_grad():  # an eval forward must not re-arm the sync
        model(x)
    model.finish_gradient_synchronization()
    counts.append(len(recorder.collectives()))
    second = {n: p.grad.clone() for n, p in module.named_parameters()}
    return counts, max_abs_diff(first, second)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_finish_is_idempotent(cluster_of, strategy):
    for counts, diff in cluster_of(2).run(_finish_twice, strategy):
        assert counts[0] == 0 and counts[1] > 0 and counts[1] == counts[2] == counts[3]
        assert diff == 0


class PartlyUsed(nn.Module):
    """``extra`` is used on rank 0 only: the other ranks get no gradient for it."""

    def __init__(self):
        super().__init__()
        self.main = nn.Linear(4, 4)
        self.extra = nn.Linear(4, 4)

    def forward(self, x, use_extra):
        y = self.main(x)
        return y + self.extra(x) if use_extra else y


def _unused_run(strategy):
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = PartlyUsed()
    model = wrap(strategy, module, bucket_cap_mb=25.0)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    model(x, use_extra=(rank == 0)).sum().backward()
    model.finish_gradient_synchronization()
    local = module.extra.weight.grad.clone()
    # what rank 0 alone computes for extra: sum over its batch of x (d(sum y)/dW = 1 x^T)
    x0 = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    return local, torch.ones(3, 4).T @ x0 / dist.get_world_size()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parameter_unused_on_some_ranks_gets_the_average(cluster_of, strategy):
    for local, expected in cluster_of(2).run(_unused_run, strategy):
        assert torch.allclose(local, expected, atol=1e-6)


def _recording_hooks(strategy, enabled):
    rank, world = dist.get_rank(), dist.get_world_size()
    module = build_model("mlp", seed=0, **SMALL_MLP)
    recorder = CountingRecorder(enabled=enabled)
    model = wrap(strategy, module, recorder=recorder)
    train_step(model, make_optimizer(model.parameters()), *local_batch(module, 12, 0, rank, world))
    bucket_of = ({n: i for i, b in enumerate(model.buckets) for n in b.names} if strategy != "naive"
                 else {n: i for i, (n, _) in enumerate(module.named_parameters())})
    return recorder.ready(), bucket_of


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_grad_ready_reported_only_when_recording(cluster_of, strategy):
    ready, bucket_of = cluster_of(1).run(_recording_hooks, strategy, True)[0]
    assert sorted(e[1] for e in ready) == sorted(bucket_of)  # each gradient once
    assert all(e[2] == bucket_of[e[1]] for e in ready)
    assert ready[0][1].startswith("head.")  # backward: the last layer first
    ready, _ = cluster_of(1).run(_recording_hooks, strategy, False)[0]
    assert ready == []


# --------------------------------------------------------------------------- bucket assignment
F32 = 4  # bytes per fp32 element: sizes below are numbers of floats x F32


def test_assign_buckets_reverse_order_and_crossing_tensor_stays():
    # caps of 100 floats: p4 (40) + p3 (40) = 80 < 100, + p2 -> 120 >= 100: p2 stays, bucket closes
    assert assign_buckets([40 * F32] * 5, 100 * F32) == [[4, 3, 2], [1, 0]]
    # exactly reaching the cap closes the bucket too
    assert assign_buckets([50 * F32] * 3, 100 * F32) == [[2, 1], [0]]
    # one tensor bigger than the cap gets a bucket of its own, then the next starts
    assert assign_buckets([10 * F32, 500 * F32, 10 * F32], 100 * F32) == [[2, 1], [0]]


def test_assign_buckets_cap_zero_huge_and_counts():
    assert assign_buckets([3, 1, 2], 0) == [[2], [1], [0]]
    assert assign_buckets([3, 1, 2], bucket_cap_bytes(25.0)) == [[2, 1, 0]]
    assert assign_buckets([3, 1, 2], math.inf) == [[2, 1, 0]]
    assert assign_buckets([], 25.0) == []
    mlp = [p.numel() * F32 for _, p in unique_named_parameters(build_model("mlp", width=256, depth=32))]
    assert len(assign_buckets(mlp, bucket_cap_bytes(25.0))) == 1  # 8.4 MB
    assert len(assign_buckets(mlp, bucket_cap_bytes(1.0))) == 8  # 263,168 bytes per layer: 4 layers reach 1 MiB
    assert len(assign_buckets(mlp, 0)) == 66


def test_assign_buckets_first_cap_as_torch_ddp():
    # torch DDP caps the first bucket (of each dtype) at 1 MiB when bucket_cap_mb is its default
    assert assign_buckets([10] * 5, 1000, first_cap_bytes=15) == [[4, 3], [2, 1, 0]]
    assert assign_buckets([10] * 5, 25, first_cap_bytes=15) == [[4, 3], [2, 1, 0]]
    with pytest.raises(ValueError, match=">= 0"):
        assign_buckets([10], -1)


def test_assign_buckets_one_dtype_per_bucket():
    kinds = [torch.float32, torch.float64, torch.float32, torch.float64]
    assert assign_buckets([40, 80, 40, 80], 10**9, kinds) == [[3, 1], [2, 0]]
    assert assign_buckets([40, 80, 40, 80], 40, kinds) == [[3], [2], [1], [0]]


def test_assign_buckets_matches_torch_ddp():
    compute = getattr(dist, "_compute_bucket_assignment_by_size", None)
    if compute is None:
        pytest.skip("this torch has no _compute_bucket_assignment_by_size")
    rng = random.Random(0)
    for trial in range(50):
        dtypes = [rng.choice([torch.float32, torch.float64, torch.float16]) for _ in range(rng.randint(1, 30))]
        tensors = [torch.empty(rng.randint(0, 300), dtype=d) for d in dtypes]
        caps = rng.choice([[0], [1], [64], [500], [2000], [10**9], [100, 2000], [500, 10**9]])
        ours = assign_buckets([t.numel() * t.element_size() for t in tensors], caps[-1], dtypes,
                              first_cap_bytes=caps[0] if len(caps) > 1 else None)
        # torch takes the tensors already reversed and answers with indices into that list
        theirs, _ = compute(tensors[::-1], caps)
        assert ours == [[len(tensors) - 1 - i for i in b] for b in theirs], (trial, caps)


def test_a_cap_left_at_its_default_is_torch_ddps_layout():
    # None: 25 MiB with a 1 MiB first bucket, as torch DDP's default; a cap given is every bucket's
    from ddpkit.strategies.buckets import layout, make_buckets

    assert layout(None) == (25.0, 1.0) and layout(25.0) == (25.0, None) and layout(None, 4.0) == (25.0, 4.0)
    named = list(unique_named_parameters(build_model("mlp")))
    sizes = [[p.numel() * F32 for p in b.params] for b in make_buckets(named, None)]
    assert [sum(b) for b in sizes] == [1_062_952, 7_368_704]  # the MLP's 8.04 MiB as torch lays it out
    assert len(make_buckets(named, 25.0)) == 1
    compute = getattr(dist, "_compute_bucket_assignment_by_size", None)
    if compute is not None:  # torch's own assignment at its default limits
        tensors = [p.detach() for _, p in named]
        theirs, _ = compute(tensors[::-1], [2**20, 25 * 2**20])
        assert [len(b) for b in theirs] == [len(b) for b in sizes]


@pytest.mark.parametrize("cap", [-1, -0.5, float("nan"), "25", True])
def test_bad_bucket_cap_is_a_value_error(cap):
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        bucket_cap_bytes(cap)
    for cls in (ddpkit.BucketedDDP, ddpkit.OverlappedDDP):  # before any process group is needed
        with pytest.raises(ValueError, match="bucket_cap_mb"):
            cls(nn.Linear(2, 2), bucket_cap_mb=cap)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_built_before_process_group_is_a_clear_error(strategy):
    if dist.is_initialized():
        pytest.skip("this test process already joined a process group")
    with pytest.raises(RuntimeError, match="init_process_group"):
        wrap(strategy, nn.Linear(2, 2))


def _mismatched(strategy):
    width = 8 if dist.get_rank() == 0 else 9
    wrap(strategy, nn.Sequential(nn.Linear(4, 4), nn.Linear(4, width)))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parameter_shapes_differing_across_ranks_name_the_parameter(cluster_of, strategy):
    with pytest.raises(ddpkit.RankError) as info:
        cluster_of(2).run(_mismatched, strategy)
    assert info.value.ranks == [0, 1]
    assert "'1.weight'" in str(info.value) and "[8, 4]" in str(info.value)


def _bucket_data():
    module = build_model("mlp", seed=0, **SMALL_MLP)
    model = ddpkit.BucketedDDP(module, bucket_cap_mb=SMALL_CAP)
    named = list(unique_named_parameters(module))
    expected = [[named[i][0] for i in b] for b in
                assign_buckets([p.numel() * 4 for _, p in named], bucket_cap_bytes(SMALL_CAP))]
    views = all(s.data_ptr() == b.flat[off:].data_ptr() and s.shape == p.shape
                for b in model.buckets
                for s, p, off in zip(b.slots, b.params, [sum(b.layout.numels[:j]) for j in range(len(b.params))],
                                     strict=True))
    return ([(b.index, b.names, b.layout.numels, b.nbytes, b.flat.dtype) for b in model.buckets], expected,
            views, model.comm_buffer_bytes())


def test_buckets_own_a_flat_buffer_with_a_slot_per_gradient(cluster_of):
    buckets, expected, slots_are_views, buffer_bytes = cluster_of(1).run(_bucket_data)[0]
    assert [names for _, names, _, _, _ in buckets] == expected
    assert [index for index, *_ in buckets] == list(range(len(expected)))
    assert buckets[0][1][:2] == ["head.bias", "head.weight"]
    assert all(nbytes == 4 * sum(numels) and dtype == torch.float32 for _, _, numels, nbytes, dtype in buckets)
    assert slots_are_views
    assert sum(b[3] for b in buckets) == buffer_bytes == 1258 * 4


def _with_trace_recorder(strategy):
    from ddpkit.trace import Recorder

    rank, world = dist.get_rank(), dist.get_world_size()
    module = build_model("mlp", seed=0, **SMALL_MLP)
    recorder = Recorder()
    model = wrap(strategy, module, recorder=recorder)
    opt = make_optimizer(model.parameters())
    for step in range(2):
        recorder.next_step()
        train_step(model, opt, *local_batch(module, 12, step, rank, world), recorder=recorder)
    buckets = [b.names for b in model.buckets] if strategy != "naive" else None
    return recorder.records, buckets


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reports_through_the_trace_recorder(cluster_of, strategy):
    from ddpkit.trace import Trace, bucket_fill_order, collective_bytes, collective_counts, launch_order

    per_rank = cluster_of(2).run(_with_trace_recorder, strategy)
    trace = Trace.merge([records for records, _ in per_rank], world_size=2)
    buckets = per_rank[0][1]
    n_tensors, total = 10, 1258 * 4
    expected = n_tensors if strategy == "naive" else len(buckets)
    assert collective_counts(trace)[1] == {0: {"all_reduce": expected}, 1: {"all_reduce": expected}}
    assert collective_bytes(trace)[1] == {0: total, 1: total}
    for rank in (0, 1):
        assert [r.bucket for r in launch_order(trace, rank=rank, step=1)] == list(range(expected))
        fill = bucket_fill_order(trace, rank=rank, step=1)
        assert len(fill) == n_tensors
        if buckets is not None:
            assert all(name in buckets[bucket] for name, bucket, _ in fill)


class Checkpointed(nn.Module):
    """The small MLP with its hidden layers under (non-reentrant) activation checkpointing."""

    def __init__(self):
        super().__init__()
        self.mlp = build_model("mlp", seed=0, **SMALL_MLP)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.mlp.head(checkpoint(self.mlp.layers, x, use_reentrant=False))


def _checkpointed_run(strategy):
    module = Checkpointed()
    model = wrap(strategy, module)
    train_on_rank(model, module.mlp, make_optimizer(model.parameters()), 5, 12)
    return {n: p.detach() for n, p in module.mlp.named_parameters()}


@pytest.mark.parametrize("strategy", ["bucketed", "overlapped"])
def test_activation_checkpointing(cluster_of, strategy):
    reference = reference_params("mlp", "sgd", batch=12, **SMALL_MLP)
    for params in cluster_of(2).run(_checkpointed_run, strategy):
        assert max_abs_diff(params, reference) < TOL


def _twice_in_one_backward():
    from torch.utils.checkpoint import checkpoint

    class SharedTwice(nn.Module):  # `l` runs in two reentrant regions: two nested backwards
        def __init__(self):
            super().__init__()
            self.l, self.head = nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x):
            x = x.requires_grad_()
            return self.head(checkpoint(self.l, checkpoint(self.l, x, use_reentrant=True), use_reentrant=True))

    model = ddpkit.OverlappedDDP(SharedTwice())
    model(torch.randn(2, 4)).sum().backward()


def test_overlapped_refuses_a_gradient_that_arrives_twice(cluster_of):
    with pytest.raises(ddpkit.RankError, match="'l.(weight|bias)' became ready twice in one step"):
        cluster_of(1).run(_twice_in_one_backward)


# --------------------------------------------------------------------------- unused parameters
class WithSpare(nn.Module):
    """A model with a layer no forward ever uses (a spare head, a disabled branch)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 4)   # never used: one process leaves its .grad None
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.relu(self.body(x)))


def _spare_batches(steps=3, batch=8):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(batch, 4, generator=g), torch.randn(batch, 2, generator=g)) for _ in range(steps)]


def _spare_run(strategy, find_unused):
    import warnings

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    module = WithSpare()
    if strategy == "naive":
        model = ddpkit.NaiveDDP(module, find_unused_parameters=find_unused)
    else:
        cls = ddpkit.BucketedDDP if strategy == "bucketed" else ddpkit.OverlappedDDP
        model = cls(module, bucket_cap_mb=0, find_unused_parameters=find_unused)  # a bucket per tensor
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)  # moves any tensor with a .grad
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in _spare_batches():
            per = x.shape[0] // world
            (model(x[rank * per:(rank + 1) * per]) - y[rank * per:(rank + 1) * per]).square().mean().backward()
            model.finish_gradient_synchronization()
            spare_grad = module.spare.weight.grad
            opt.step()
            opt.zero_grad(set_to_none=True)
    return model.full_state_dict(), spare_grad, [str(w.message) for w in caught]


def _spare_reference():
    torch.manual_seed(0)
    ref = WithSpare()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    for x, y in _spare_batches():
        (ref(x) - y).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in ref.named_parameters()}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_find_unused_parameters_leaves_a_parameter_no_rank_used_untouched(cluster_of, strategy):
    """AdamW with weight decay moves every tensor that has a .grad, even a zero one: the spare
    layer must keep .grad None (as in one process) to stay where it started."""
    reference = _spare_reference()
    for full, spare_grad, warned in cluster_of(2).run(_spare_run, strategy, True):
        assert spare_grad is None and not warned
        assert max_abs_diff(full, reference) < TOL
    # the default: reduced as zeros (ranks stay matched), so weight decay moves it; a warning says so
    for full, spare_grad, warned in cluster_of(2).run(_spare_run, strategy, False):
        assert spare_grad is not None and not spare_grad.any()
        assert (full["spare.weight"] - reference["spare.weight"]).abs().max() > 1e-4
        assert max_abs_diff({k: v for k, v in full.items() if not k.startswith("spare")},
                            {k: v for k, v in reference.items() if not k.startswith("spare")}) < TOL
        assert len(warned) == 1 and "spare.weight" in warned[0] and "find_unused_parameters=True" in warned[0]


# --------------------------------------------------------------------------- uneven inputs: Join
def _uneven(strategy, find_unused=False):
    """Rank r trains on 3 + 2r batches inside Join; returns the final parameters, ours and torch's."""
    from torch.distributed.algorithms import Join

    from ddpkit.strategies.reference import TorchDDP

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for kind in (strategy, "torch"):
        module = build_model("mlp", seed=rank, **SMALL_MLP)
        if kind == "torch":
            model = TorchDDP(module, bucket_cap_mb=SMALL_CAP)
            joinable = model.ddp
        else:
            model = wrap(kind, module) if not find_unused else \
                (ddpkit.NaiveDDP(module, find_unused_parameters=True) if kind == "naive" else
                 (ddpkit.BucketedDDP if kind == "bucketed" else ddpkit.OverlappedDDP)(
                     module, bucket_cap_mb=SMALL_CAP, find_unused_parameters=True))
            joinable = model
        opt = make_optimizer(model.parameters(), "sgd")
        with Join([joinable]):
            for step in range(3 + 2 * rank):  # 3 batches on rank 0, 5 on rank 1
                train_step(model, opt, *local_batch(module, 12, step, rank, world))
        out[kind] = model.full_state_dict()
    return out[strategy], out["torch"]


@pytest.mark.parametrize("strategy,find_unused", [(s, False) for s in STRATEGIES] + [("overlapped", True)])
def test_uneven_inputs_join_finishes_and_equals_torch_ddp_with_join(cluster_of, strategy, find_unused):
    per_rank = cluster_of(2).run(_uneven, strategy, find_unused)
    for ours, torchs in per_rank:
        assert max_abs_diff(ours, torchs) < TOL
    assert max_abs_diff(per_rank[0][0], per_rank[1][0]) == 0  # the last rank's parameters everywhere


def _zero_join(cls_name):
    from torch.distributed.algorithms import Join

    model = getattr(ddpkit, cls_name)(nn.Linear(4, 4))
    try:
        with Join([model]):
            pass
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("cls_name", ["ZeRO1", "ZeRO2"])
def test_join_on_zero_is_a_clear_error(cluster_of, cls_name):
    for msg in cluster_of(2).run(_zero_join, cls_name):
        assert "does not support Join" in msg


# --------------------------------------------------------------------------- communication hooks
def _hooked(strategy, hook_name, steps, by_name=False):
    """Train with a comm hook: registered as a function of comm_hooks.py (``hook_name``), or, with
    ``by_name``, given by its name in COMM_HOOKS to the constructor (``comm_hook=``)."""
    from ddpkit.strategies import comm_hooks

    module = build_model("mlp", seed=dist.get_rank(), **SMALL_MLP)
    rec = CountingRecorder()
    model = wrap(strategy, module, recorder=rec, **({"comm_hook": hook_name} if by_name else {}))
    if hook_name and not by_name:
        model.register_comm_hook(getattr(comm_hooks, hook_name))
    train_on_rank(model, module, make_optimizer(model.parameters(), "adamw"), steps, BATCH_HOOKS)
    sent = sum(b for name, b, _ in rec.collectives("all_reduce")) / steps
    return model.full_state_dict(), sent


BATCH_HOOKS = 24
HOOK_STEPS = 5


@pytest.mark.parametrize("strategy", ["bucketed", "overlapped"])
def test_fp16_and_bf16_compression_halve_the_bytes_and_train_close_to_one_process(cluster_of, strategy):
    """The stated tolerance after 5 steps with AdamW (lr 1e-3): fp16 within 1e-4 of one process,
    bf16 within 2e-3. Measured (residual MLP width 16 x 4, 2 ranks, overlapped): fp16 2.9e-6 with
    AdamW and 2.6e-5 with SGD (lr 0.05, momentum); bf16 9.9e-4 and 2.7e-4. bf16 keeps 8 bits of
    mantissa, so a gradient's rounding is ~0.4% of it; AdamW divides each gradient by its running
    RMS, so a small gradient whose sign or size rounding changes moves its parameter by up to ~lr
    per step: 5 steps at most 5e-3."""
    reference = reference_params("mlp", "adamw", steps=HOOK_STEPS, batch=BATCH_HOOKS, **SMALL_MLP)
    cluster = cluster_of(2)
    plain = cluster.run(_hooked, strategy, "allreduce_hook", HOOK_STEPS)
    for full, _ in plain:
        assert max_abs_diff(full, reference) < TOL  # the default hook is exactly the all-reduce
    for hook, tol in [("fp16_compress_hook", 1e-4), ("bf16_compress_hook", 2e-3)]:
        for (full, sent), (_, sent_fp32) in zip(cluster.run(_hooked, strategy, hook, HOOK_STEPS), plain, strict=True):
            assert sent == sent_fp32 / 2
            assert max_abs_diff(full, reference) < tol, (hook, max_abs_diff(full, reference))


@pytest.mark.parametrize("strategy", ["bucketed", "overlapped"])
def test_a_comm_hook_chosen_by_name_is_the_hook_halves_the_bytes_and_trains_close(cluster_of, strategy):
    """``comm_hook="bf16_compress"`` at construction (the name compare, --comm-hook and the cost
    model take) runs the very hook ``register_comm_hook(bf16_compress_hook)`` does: half the bytes
    of the plain all-reduce (``"allreduce"`` by name, exact), within bf16's tolerance of one process."""
    reference = reference_params("mlp", "adamw", steps=HOOK_STEPS, batch=BATCH_HOOKS, **SMALL_MLP)
    cluster = cluster_of(2)
    plain = cluster.run(_hooked, strategy, "allreduce", HOOK_STEPS, True)
    by_name = cluster.run(_hooked, strategy, "bf16_compress", HOOK_STEPS, True)
    by_function = cluster.run(_hooked, strategy, "bf16_compress_hook", HOOK_STEPS)
    for (full, sent), (plain_full, plain_sent), (fn_full, fn_sent) in zip(by_name, plain, by_function, strict=True):
        assert max_abs_diff(plain_full, reference) < TOL
        assert sent == plain_sent / 2 == fn_sent
        assert max_abs_diff(full, fn_full) == 0.0
        assert max_abs_diff(full, reference) < 2e-3


def _hook_by_name_on(cls_name, hook):
    try:
        getattr(ddpkit, cls_name)(nn.Linear(2, 2), comm_hook=hook)
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "accepted"


@pytest.mark.parametrize("cls_name, hook, message", [
    ("BucketedDDP", "bf16_compress", "accepted"), ("OverlappedDDP", "fp16_compress", "accepted"),
    ("NaiveDDP", "bf16_compress", "TypeError: NaiveDDP has no buckets"),
    ("ZeRO2", "bf16_compress", "TypeError: ZeRO2 reduce-scatters"),
    ("BucketedDDP", "int8", "ValueError: unknown comm hook 'int8'; valid: allreduce, fp16_compress, bf16_compress")])
def test_a_comm_hook_by_name_at_construction_or_a_clear_error(cluster_of, cls_name, hook, message):
    assert cluster_of(1).run(_hook_by_name_on, cls_name, hook)[0].startswith(message)


def _a_hook_returning_none(cls_name):
    def forgot_to_return(bucket, process_group, recorder):
        bucket.flat.add_(0)  # reduces nothing, returns nothing

    model = getattr(ddpkit, cls_name)(nn.Linear(2, 2), comm_hook=forgot_to_return)
    try:
        model(torch.ones(3, 2)).sum().backward()
    except TypeError as e:
        return str(e)
    return "accepted"


@pytest.mark.parametrize("cls_name", ["BucketedDDP", "OverlappedDDP"])
def test_a_comm_hook_that_returns_no_future_is_named_where_it_is_called(cluster_of, cls_name):
    message = cluster_of(1).run(_a_hook_returning_none, cls_name)[0]
    assert message.startswith("comm hook _a_hook_returning_none.<locals>.forgot_to_return returned NoneType for "
                              "bucket 0: a hook must return a torch.futures.Future of the reduced buffer"), message


def _hook_on(cls):
    from ddpkit.strategies.comm_hooks import fp16_compress_hook

    try:
        cls(nn.Linear(2, 2)).register_comm_hook(fp16_compress_hook)
    except TypeError as e:
        return str(e)
    return "accepted"


@pytest.mark.parametrize("cls, message", [(ddpkit.NaiveDDP, "no buckets"), (ddpkit.ZeRO1, "reduce-scatters"),
                                          (ddpkit.ZeRO2, "reduce-scatters")])
def test_a_comm_hook_is_refused_where_no_bucket_is_all_reduced(cluster_of, cls, message):
    assert message in cluster_of(1).run(_hook_on, cls)[0]
