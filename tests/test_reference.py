"""TorchDDP and TorchFSDP (torch's own DDP and fully_shard) equal one process, behind ddpkit's interface."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddpkit.models import fsdp_units
from ddpkit.experiment import local_batch, make_optimizer, max_abs_diff, train_step
from ddpkit.models import build_model, loss_fn
from ddpkit.strategies.reference import TorchDDP, TorchFSDP
from helpers import SMALL_GPT, SMALL_MLP, TOL, reference_params

BATCH = 24


def _train(kind, model_name, model_kwargs, steps=5):
    rank, world = dist.get_rank(), dist.get_world_size()
    module = build_model(model_name, seed=rank, **model_kwargs)  # ranks start different
    model = TorchDDP(module, bucket_cap_mb=0.001) if kind == "ddp" else TorchFSDP(module, units=fsdp_units(module))
    opt = make_optimizer(model.parameters(), "sgd")
    for step in range(steps):
        train_step(model, opt, *local_batch(module, BATCH, step, rank, world))
    model.finish_gradient_synchronization()  # a no-op, callable any time
    return model.full_state_dict(), model.module is module, model.comm_buffer_bytes()


def _train_all(cases):
    return [_train(*c) for c in cases]


CASES = [(k, m, kw) for k in ("ddp", "fsdp") for m, kw in (("mlp", SMALL_MLP), ("gpt", SMALL_GPT))]


def test_torch_wrappers_equal_one_process(cluster_of):
    per_rank = cluster_of(2).run(_train_all, CASES)
    for i, (kind, model_name, kwargs) in enumerate(CASES):
        reference = reference_params(model_name, "sgd", batch=BATCH, **kwargs)
        for rank, results in enumerate(per_rank):
            full, same_module, comm = results[i]
            assert list(full) == list(reference)
            assert max_abs_diff(full, reference) < TOL, (kind, model_name, rank)
            assert same_module
            # TorchDDP: its buckets hold every trainable parameter once; fully_shard exposes none
            assert comm == (sum(4 * t.numel() for t in reference.values()) if kind == "ddp" else 0)


def _no_sync(kind):
    rank, world = dist.get_rank(), dist.get_world_size()
    module = build_model("mlp", seed=rank, **SMALL_MLP)
    model = TorchDDP(module) if kind == "ddp" else TorchFSDP(module, units=fsdp_units(module))
    opt = make_optimizer(model.parameters(), "sgd")
    for step in range(2):
        x, y = local_batch(module, BATCH, step, rank, world)
        with model.no_sync():
            (loss_fn(model(x[:6]), y[:6]) / 2).backward()
        (loss_fn(model(x[6:]), y[6:]) / 2).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.full_state_dict()


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_no_sync_equals_one_large_batch(cluster_of, kind):
    reference = reference_params("mlp", "sgd", steps=2, batch=BATCH, **SMALL_MLP)
    for full in cluster_of(2).run(_no_sync, kind):
        assert max_abs_diff(full, reference) < TOL


def test_built_before_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    for cls in (TorchDDP, TorchFSDP):
        with pytest.raises(RuntimeError, match="process group"):
            cls(nn.Linear(2, 2))
