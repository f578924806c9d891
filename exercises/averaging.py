"""Averaging gradients: the whole of naive data parallelism is this one loop after backward.

Rank r computes the gradient of the *mean* loss over its slice of the global batch. The mean of
the N ranks' gradients is then the gradient of the mean loss over the whole batch, which is
what a single process would compute: data-parallel training equals single-process training.
"""
from __future__ import annotations

import torch.distributed as dist
from torch import nn


def average_gradients(module: nn.Module, group=None) -> None:
    """After ``loss.backward()``: replace every ``p.grad`` of ``module`` by its mean over the ranks.

    Skip parameters whose ``.grad`` is None (frozen or unused: the same on every rank). Divide
    each gradient by the world size *before* a SUM ``dist.all_reduce`` (``ReduceOp.AVG`` is not
    on every backend, and dividing first keeps fp16/bf16 sums from overflowing). Tied
    parameters appear once in ``module.parameters()``, so they are reduced once.
    Check: after it, every rank's gradients equal one process's gradients on the whole batch.
    """
    raise NotImplementedError("exercise: averaging.average_gradients (see the docstring)")
