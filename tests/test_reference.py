"""TorchDDP and TorchFSDP (torch's own DDP and fully_shard) behind ddpkit's interface.

That both equal one process (``torch_ddp`` and ``torch_fsdp`` in the table of strategies, at 1, 2
and 4 ranks, MLP and TinyGPT, SGD and AdamW) is tested in ``test_equivalence.py``.
"""
from __future__ import annotations

import pytest
import torch.distributed as dist
from torch import nn

from ddpkit.experiment import local_batch, make_optimizer, max_abs_diff
from ddpkit.models import build_model, loss_fn
from ddpkit.strategies.table import fsdp_units
from ddpkit.strategies.reference import TorchDDP, TorchFSDP
from helpers import SMALL_CAP, SMALL_GPT, SMALL_MLP, TOL, reference_params, train_on_rank

BATCH = 24


def _interface(kind, model_name, model_kwargs):
    rank = dist.get_rank()
    module = build_model(model_name, seed=rank, **model_kwargs)
    model = TorchDDP(module, bucket_cap_mb=SMALL_CAP) if kind == "ddp" else TorchFSDP(module, units=fsdp_units(module))
    train_on_rank(model, module, make_optimizer(model.parameters(), "sgd"), 1, BATCH)
    model.finish_gradient_synchronization()  # a no-op, callable any time
    unique_bytes = sum(4 * p.numel() for p in module.parameters())  # tied weights once
    return model.module is module, model.comm_buffer_bytes(), unique_bytes


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize("model_name,model_kwargs", [("mlp", SMALL_MLP), ("gpt", SMALL_GPT)], ids=["mlp", "gpt"])
def test_module_and_comm_buffer_bytes(cluster_of, kind, model_name, model_kwargs):
    for same_module, comm, unique_bytes in cluster_of(2).run(_interface, kind, model_name, model_kwargs):
        assert same_module
        # TorchDDP: its buckets hold every trainable parameter once; fully_shard exposes none
        assert comm == (unique_bytes if kind == "ddp" else 0)


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
