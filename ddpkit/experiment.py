"""The one training step every notebook, test and benchmark shares, and its single-process twin.

``train_step`` never asks which strategy it runs: every wrapper has the same small interface
(``finish_gradient_synchronization()``), and the optimizer is whatever the caller built over
``model.parameters()`` (for FSDP: the local shards).

Equality with one process: rank r trains on its slice of the global batch with a *mean* loss.
Averaging the N ranks' gradients gives (1/N) sum_r mean_r = the mean over the whole batch,
which is exactly what one process computes on the whole batch.
"""
from __future__ import annotations

import torch

from ddpkit.models import build_model, loss_fn, make_batch, shard_batch
from ddpkit.strategies._common import NULL_RECORDER


def train_step(model, optimizer, inputs, targets, recorder=NULL_RECORDER):
    """Forward, backward, finish gradient sync, optimizer step; returns the local loss."""
    with recorder.span("forward", cat="compute"):
        loss = loss_fn(model(inputs), targets)
    with recorder.span("backward", cat="compute"):
        loss.backward()
    with recorder.span("sync", cat="compute"):
        model.finish_gradient_synchronization()  # a no-op where backward already finished it
    with recorder.span("step", cat="compute"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def make_optimizer(params, name: str = "sgd", lr: float | None = None):
    """SGD (lr 0.05, momentum 0.9) or AdamW (lr 1e-3): the two optimizers the tests use."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr or 0.05, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr or 1e-3)
    raise ValueError(f"unknown optimizer {name!r}; valid: sgd, adamw")


def optimizer_class(name: str):
    """(class, defaults) for an optimizer name, e.g. to build a ShardedOptimizer."""
    if name == "sgd":
        return torch.optim.SGD, dict(lr=0.05, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW, dict(lr=1e-3)
    raise ValueError(f"unknown optimizer {name!r}; valid: sgd, adamw")


def local_batch(module, global_batch_size: int, step: int, rank: int, world_size: int, seed: int = 0):
    """This rank's slice of global batch ``step`` (``module`` is the unwrapped model)."""
    return shard_batch(make_batch(module, global_batch_size, step, seed), rank, world_size)


def train_single_process(model_name: str = "mlp", optimizer: str = "sgd", steps: int = 5,
                         global_batch_size: int = 16, seed: int = 0, **model_kwargs) -> dict:
    """Train on the whole batch in this process: the reference every strategy must equal.

    Returns ``{parameter name: tensor}`` after ``steps`` steps.
    """
    model = build_model(model_name, seed=seed, **model_kwargs)
    opt = make_optimizer(model.parameters(), optimizer)
    for step in range(steps):
        x, y = make_batch(model, global_batch_size, step, seed)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_abs_diff(a: dict, b: dict) -> float:
    """Largest absolute difference between two {name: tensor} dicts with the same keys."""
    if a.keys() != b.keys():
        raise ValueError(f"different parameter names: {sorted(a.keys() ^ b.keys())}")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
