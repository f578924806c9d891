"""The ZeRO ladder's optimizer-sharding rungs.

ShardedOptimizer (the ``sharded_optimizer`` rung): works on top of every DDP wrapper, state 1/N per
rank, param groups and LR schedulers, consolidated state dicts loadable by a plain optimizer and back.
ZeRO1 and ZeRO2 (the ``zero1`` and ``zero2`` rungs): DDP's bytes, state per rank as the ZeRO
formulas say (fsdp < zero2 < zero1 < DDP), ZeRO-2's full gradients freed, no_sync, and a clear
error for an optimizer they cannot shard.

Every rung as the table of strategies builds it is proven equal to one process at 1, 2, 3 and 4
ranks, MLP and TinyGPT, SGD and AdamW, in ``test_equivalence.py``.
"""
from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddpkit
from ddpkit.experiment import local_batch, make_optimizer, max_abs_diff, optimizer_class, train_step
from ddpkit.models import build_model, loss_fn, make_batch
from ddpkit.strategies.sharded_optimizer import partition_by_size
from helpers import SMALL_CAP, SMALL_MLP, TOL, CountingRecorder, reference_params, train_on_rank

BATCH = 24


def _wrap(ddp, module):
    if ddp == "naive":
        return ddpkit.NaiveDDP(module)
    cls = ddpkit.BucketedDDP if ddp == "bucketed" else ddpkit.OverlappedDDP
    return cls(module, bucket_cap_mb=SMALL_CAP)  # several buckets on the small MLP


def _train(ddp, optimizer, steps=5):
    rank = dist.get_rank()
    module = build_model("mlp", seed=rank, **SMALL_MLP)  # ranks start different
    model = _wrap(ddp, module)
    cls, defaults = optimizer_class(optimizer)
    rec = CountingRecorder()
    opt = ddpkit.ShardedOptimizer(model.parameters(), cls, recorder=rec, **defaults)
    train_on_rank(model, module, opt, steps, BATCH)
    owned = [i for i, r in enumerate(opt.owner) if r == rank]
    return (model.full_state_dict(), owned, opt.local_state_bytes(), len(opt.local_optimizer.state),
            len(rec.collectives("all_gather")))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("ddp", ["naive", "bucketed", "overlapped"])
def test_over_every_ddp_wrapper(cluster_of, ddp, optimizer):
    # ZeRO-1 is an optimizer, not a wrapper: it must work over each DDP wrapper. 3 ranks: the
    # small MLP's 10 tensors are partitioned unevenly.
    world = 3
    per_rank = cluster_of(world).run(_train, ddp, optimizer)
    reference = reference_params("mlp", optimizer, batch=BATCH, **SMALL_MLP)
    owned_all = []
    for rank, (full, owned, _, n_state, all_gathers) in enumerate(per_rank):
        diff = max_abs_diff(full, reference)
        assert diff < TOL, f"{ddp} {optimizer}: rank {rank} off by {diff}"
        owned_all += owned
        assert n_state == len(owned)  # optimizer state exists only for this rank's parameters
        assert all_gathers == 5  # one all-gather per step (one dtype)
    assert sorted(owned_all) == list(range(len(reference)))  # every parameter owned exactly once
    if optimizer == "adamw":  # exp_avg + exp_avg_sq, 8 bytes per parameter, split over ranks
        total = sum(state_bytes for _, _, state_bytes, _, _ in per_rank)
        assert total == 8 * sum(t.numel() for t in reference.values())


def test_partition_is_greedy_largest_first_and_deterministic():
    assert partition_by_size([5, 4, 3, 3, 1], 2) == [0, 1, 1, 0, 1]  # loads 8 and 8
    sizes = [p.numel() for p in build_model("mlp").parameters()]
    owner = partition_by_size(sizes, 3)
    assert owner == partition_by_size(sizes, 3)
    loads = [sum(s for s, o in zip(sizes, owner, strict=True) if o == r) for r in range(3)]
    assert max(loads) - min(loads) <= max(sizes)
    assert partition_by_size([7], 4) == [0]  # ranks may own nothing


def _groups_and_scheduler(steps=5):
    rank, world = dist.get_rank(), dist.get_world_size()

    def groups(module):
        weights = [p for n, p in module.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in module.named_parameters() if n.endswith("bias")]
        return [{"params": weights}, {"params": biases, "lr": 0.1}]

    reference = build_model("mlp", seed=0, **SMALL_MLP)
    ref_opt = torch.optim.SGD(groups(reference), lr=0.05, momentum=0.9)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    module = build_model("mlp", seed=rank, **SMALL_MLP)
    model = ddpkit.BucketedDDP(module)
    opt = ddpkit.ShardedOptimizer(groups(model), torch.optim.SGD, lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(steps):
        train_step(model, opt, *local_batch(module, BATCH, step, rank, world))
        sched.step()
        x, y = make_batch(reference, BATCH, step)
        loss_fn(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_sched.step()
    ref = {n: p.detach() for n, p in reference.named_parameters()}
    lrs = [g["lr"] for g in opt.local_optimizer.param_groups]
    grads_none = all(p.grad is None for p in module.parameters())
    return max_abs_diff(model.full_state_dict(), ref), lrs, grads_none


def test_param_groups_and_lr_scheduler(cluster_of):
    for diff, lrs, grads_none in cluster_of(3).run(_groups_and_scheduler):
        assert diff < TOL
        assert lrs == pytest.approx([0.05 / 4, 0.1 / 4])  # the scheduler reached the local optimizer
        assert grads_none  # zero_grad(set_to_none=True) over all parameters, not just owned ones


def _state_dicts(k, m, to):
    rank, world = dist.get_rank(), dist.get_world_size()
    module = build_model("mlp", seed=rank, **SMALL_MLP)
    model = ddpkit.OverlappedDDP(module)
    opt = ddpkit.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    train_on_rank(model, module, opt, k, BATCH)
    shard = opt.state_dict()  # without consolidating: this rank's own parameters only
    owned = sorted(i for i, r in enumerate(opt.owner) if r == rank)
    shard_ok = sorted(shard["state"]) == owned and shard["zero1_shard"] == {"rank": rank, "world_size": world}
    opt.consolidate_state_dict(to=to)
    full = None
    plain_ok = None
    if rank == to:
        full = opt.state_dict()
        # a plain optimizer takes it, and gives back the same
        plain = torch.optim.AdamW(build_model("mlp", **SMALL_MLP).parameters(), lr=1e-3)
        plain.load_state_dict(full)
        plain_ok = plain.state_dict()
    # checkpoint = full params + full optimizer state, written by rank `to`, read by everyone
    buf = [None]
    if rank == to:
        b = io.BytesIO()
        torch.save({"model": model.full_state_dict(), "optim": plain_ok}, b)
        buf[0] = b.getvalue()
    dist.broadcast_object_list(buf, src=to)
    ckpt = torch.load(io.BytesIO(buf[0]))
    module = build_model("mlp", seed=50 + rank, **SMALL_MLP)
    module.load_state_dict(ckpt["model"])
    model = ddpkit.OverlappedDDP(module)
    opt = ddpkit.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    opt.load_state_dict(ckpt["optim"])
    train_on_rank(model, module, opt, m, BATCH, first_step=k)
    return shard_ok, full, model.full_state_dict()


def _plain_state_after(k):
    model = build_model("mlp", seed=0, **SMALL_MLP)
    opt = make_optimizer(model.parameters(), "adamw")
    for step in range(k):
        x, y = make_batch(model, BATCH, step)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt.state_dict()


def test_consolidated_state_dict_is_torch_format_and_resumes(cluster_of):
    per_rank = cluster_of(3).run(_state_dicts, 3, 2, 1)
    expected = _plain_state_after(3)
    for rank, (shard_ok, full, after) in enumerate(per_rank):
        assert shard_ok  # the unconsolidated state dict is this rank's shard
        assert max_abs_diff(after, reference_params("mlp", "adamw", batch=BATCH, **SMALL_MLP)) < TOL  # k + m
        if rank != 1:
            assert full is None
            continue
        assert full["param_groups"] == expected["param_groups"]
        assert full["state"].keys() == expected["state"].keys()
        for i, s in expected["state"].items():
            assert full["state"][i].keys() == s.keys()
            for key, v in s.items():
                assert torch.allclose(full["state"][i][key].float(), v.float(), atol=TOL), (i, key)


def _owns_nothing():
    rank = dist.get_rank()
    torch.manual_seed(rank)
    module = nn.Linear(3, 2)  # 2 parameters over 4 ranks: two ranks own nothing
    model = ddpkit.NaiveDDP(module)
    opt = ddpkit.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01)
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        model(x[2 * rank:2 * rank + 2]).square().mean().backward()
        model.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
    torch.manual_seed(0)
    ref = nn.Linear(3, 2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    for _ in range(3):
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return max_abs_diff(model.full_state_dict(), {n: p.detach() for n, p in ref.named_parameters()}), \
        len(opt.local_optimizer.state)


def test_ranks_that_own_nothing(cluster_of):
    per_rank = cluster_of(4).run(_owns_nothing)
    assert sorted(n for _, n in per_rank) == [0, 0, 1, 1]
    for diff, _ in per_rank:
        assert diff < TOL


def _empty():
    try:
        ddpkit.ShardedOptimizer([], torch.optim.SGD, lr=0.1)
    except ValueError as e:
        return str(e)


def test_bad_input(cluster_of):
    assert "empty" in cluster_of(2).run(_empty)[0]
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="process group"):
        ddpkit.ShardedOptimizer(nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1)


def _shard_resume(k, m):
    """Each rank saves its own shard of the optimizer state (as ddpkit.train does) and resumes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    module = build_model("mlp", seed=rank, **SMALL_MLP)
    model = ddpkit.BucketedDDP(module)
    opt = ddpkit.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    train_on_rank(model, module, opt, k, BATCH)
    b = io.BytesIO()
    torch.save({"model": model.full_state_dict(), "optim": opt.state_dict()}, b)
    ckpt = torch.load(io.BytesIO(b.getvalue()))
    shards = [None] * world
    dist.all_gather_object(shards, ckpt["optim"])
    module = build_model("mlp", seed=9 + rank, **SMALL_MLP)
    module.load_state_dict(ckpt["model"])
    model = ddpkit.BucketedDDP(module)
    opt = ddpkit.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    try:
        opt.load_state_dict(shards[(rank + 1) % world])  # someone else's shard: refused
        refused = False
    except ValueError as e:
        refused = "shard" in str(e)
    opt.load_state_dict(ckpt["optim"])
    train_on_rank(model, module, opt, m, BATCH, first_step=k)
    return model.full_state_dict(), refused


def test_per_rank_shard_checkpoint_resumes(cluster_of):
    reference = reference_params("mlp", "adamw", batch=BATCH, **SMALL_MLP)
    for full, refused in cluster_of(2).run(_shard_resume, 3, 2):
        assert refused
        assert max_abs_diff(full, reference) < TOL


# ----------------------------------------------------------------------------- ZeRO-1 and ZeRO-2
LADDER = ["overlapped", "sharded_optimizer", "zero1", "zero2", "fsdp"]
MEDIUM_MLP = dict(width=32, depth=4)  # 4 Linear(32, 32) + a head: 4554 parameters


def test_bytes_and_state_per_rank_down_the_ladder(cluster_of):
    """The recorder's collective records: zero1 and zero2 move DDP's bytes (within 2%: padding),
    sharded_optimizer and fsdp 1.5x (1.4-1.6). Model state per rank with AdamW at 2 ranks, measured:
    fsdp < zero2 < zero1 < DDP, each within 5% of its ZeRO formula."""
    from ddpkit.experiment import run_strategy
    from ddpkit.memory_formulas import predicted_model_state

    world = 2
    psi = sum(p.numel() for p in build_model("mlp", **MEDIUM_MLP).parameters())
    got = {}
    for s in LADDER:
        results = cluster_of(world).run(run_strategy, s, steps=1, warmup=1, global_batch_size=8,
                                        optimizer="adamw", record=True, bucket_cap_mb=0.01,
                                        model_kwargs=MEDIUM_MLP, report_progress=False)
        got[s] = (max(r.comm_bytes_per_step for r in results), max(r.model_state_bytes for r in results))
    ddp_bytes, ddp_state = got["overlapped"]
    assert ddp_bytes == pytest.approx(2 * (world - 1) / world * 4 * psi)
    for s in ("zero1", "zero2"):
        assert got[s][0] / ddp_bytes == pytest.approx(1.0, abs=0.02), (s, got[s][0] / ddp_bytes)
    for s in ("sharded_optimizer", "fsdp"):
        assert 1.4 <= got[s][0] / ddp_bytes <= 1.6, (s, got[s][0] / ddp_bytes)
    state = {s: got[s][1] for s in LADDER}
    assert state["fsdp"] < state["zero2"] < state["zero1"] < state["overlapped"], state
    for s in LADDER:
        predicted = predicted_model_state(s, psi, world)["total"]
        assert state[s] == pytest.approx(predicted, rel=0.05), (s, state[s], predicted)


def _zero2_frees_full_gradients():
    rank, world = dist.get_rank(), dist.get_world_size()
    module = build_model("mlp", seed=rank, **SMALL_MLP)
    model = ddpkit.ZeRO2(module, bucket_cap_mb=SMALL_CAP)
    opt = model.make_optimizer(torch.optim.AdamW, lr=1e-3)
    x, y = local_batch(module, BATCH, 0, rank, world)
    loss_fn(model(x), y).backward()  # backward itself finishes the synchronisation
    full_grads = [p.grad for p in module.parameters()]
    shard_grad_numel = sum(p.grad.numel() for g in opt.param_groups for p in g["params"])
    held = model.comm_buffer_bytes()
    opt.step()
    return full_grads, shard_grad_numel, held, len(model.buckets)


def test_zero2_keeps_only_its_shard_of_the_gradients(cluster_of):
    n = sum(p.numel() for p in build_model("mlp", **SMALL_MLP).parameters())
    for full_grads, shard_numel, held, buckets in cluster_of(2).run(_zero2_frees_full_gradients):
        assert buckets > 1 and all(g is None for g in full_grads)  # freed once their bucket was reduced
        assert n / 2 <= shard_numel <= n / 2 + buckets  # 1/N of the gradients (+ padding)
        assert held == 0  # no flat gradient left once backward has returned


def _zero_buckets_layout(cls_name):
    module = build_model("mlp", seed=0, **SMALL_MLP)
    model = getattr(ddpkit, cls_name)(module, bucket_cap_mb=SMALL_CAP)
    out = []
    for b in model.buckets:
        lay = b.layout
        views = lay.views(b.flat_param)
        out.append(dict(
            numel=lay.numel, padded=lay.padded_numel, shard=b.shard.numel(), world=lay.world_size, rank=lay.rank,
            own_shard=b.shard.data_ptr() == lay.shard(b.flat_param).data_ptr(),  # rank r's shard r
            params_are_views=all(p.data_ptr() == v.data_ptr() and p.shape == v.shape
                                 for p, v in zip(b.params, views, strict=True)),
            padding_zero=bool(b.flat_param[lay.numel:].eq(0).all()),
            sizes=sum(p.numel() for p in b.params)))
    return out, dist.get_rank()


@pytest.mark.parametrize("cls_name", ["ZeRO1", "ZeRO2"])
def test_zero_buckets_are_flat_layouts_padded_to_n_shards(cluster_of, cls_name):
    """The module's parameters view the bucket's flat parameter at the FlatLayout's offsets, the
    shard this rank steps is the layout's shard r, and the padding (< N zeros) holds zeros."""
    for buckets, rank in cluster_of(3).run(_zero_buckets_layout, cls_name):
        assert len(buckets) > 1
        assert any(b["padded"] > b["numel"] for b in buckets)  # 3 ranks: some bucket needs padding
        for b in buckets:
            assert (b["world"], b["rank"]) == (3, rank) and b["numel"] == b["sizes"]
            assert b["padded"] == 3 * b["shard"] and 0 <= b["padded"] - b["numel"] < 3
            assert b["own_shard"] and b["params_are_views"] and b["padding_zero"]


def _zero_no_sync(cls_name):
    rank, world = dist.get_rank(), dist.get_world_size()
    module = build_model("mlp", seed=rank, **SMALL_MLP)
    model = getattr(ddpkit, cls_name)(module, bucket_cap_mb=SMALL_CAP)
    opt = model.make_optimizer(torch.optim.AdamW, lr=1e-3)
    for step in range(3):  # each global batch of 24 in two micro-batches of 12, one under no_sync
        x, y = local_batch(module, BATCH, step, rank, world)
        half = x.shape[0] // 2
        with model.no_sync():
            (loss_fn(model(x[:half]), y[:half]) / 2).backward()
        (loss_fn(model(x[half:]), y[half:]) / 2).backward()
        model.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.full_state_dict()


@pytest.mark.parametrize("cls_name", ["ZeRO1", "ZeRO2"])
def test_zero_no_sync_micro_batches_equal_one_large_batch(cluster_of, cls_name):
    reference = reference_params("mlp", "adamw", steps=3, batch=BATCH, **SMALL_MLP)
    for full in cluster_of(2).run(_zero_no_sync, cls_name):
        assert max_abs_diff(full, reference) < TOL


def _zero_refuses(cls_name, optimizer_cls):
    model = getattr(ddpkit, cls_name)(nn.Linear(4, 4))
    try:
        model.make_optimizer(optimizer_cls, lr=0.1)
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("cls_name", ["ZeRO1", "ZeRO2"])
def test_an_optimizer_that_cannot_be_sharded_is_a_clear_error(cluster_of, cls_name):
    for msg in cluster_of(2).run(_zero_refuses, cls_name, torch.optim.LBFGS):
        assert f"{cls_name} cannot shard LBFGS" in msg and "elementwise" in msg and "sharded_optimizer" in msg
