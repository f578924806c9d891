"""The one training step every notebook, test, benchmark and ``python -m ddpkit.train`` shares.

``train_batch`` never asks which strategy it runs (every wrapper has the same small interface; the
optimizer is over ``model.parameters()``, FSDP's shards). Equality with one process: with a *mean*
loss, the average of the ranks' gradients, (1/N) sum_r mean_r, is the mean over the whole batch.
"""
from __future__ import annotations

import contextlib

from ddpkit.models import supervised_loss
from ddpkit.strategies.common import BackwardSpans
from ddpkit.trace.seam import recorder as rank_recorder


def train_step(model, optimizer, inputs, targets, recorder=None, max_norm: float | None = None):
    """``train_batch`` on the course's ``(inputs, targets)`` batches (mean cross-entropy); the loss."""
    return train_batch(model, optimizer, (inputs, targets), supervised_loss, recorder, max_norm)


def train_batch(model, optimizer, batch, loss, recorder=None, max_norm: float | None = None):
    """Forward (``loss(model, batch)``), backward, finish the sync, clip (``max_norm``: the *whole*
    gradient's norm), optimizer step; returns the local loss. ``recorder`` (default the rank's):
    the spans "forward", "backward", "sync", "step", the loss, and when ``memory_due`` a memory
    sample after forward and after the step."""
    if recorder is None:
        recorder = rank_recorder()
    recorder.begin_step()  # a new step index, unless the caller just started one
    sample = recorder.memory_due()
    with recorder.span("forward", cat="compute"), _activations(sample, model) as saved:
        value = loss(model, batch)
    if sample:
        _memory_sample(recorder, model, optimizer, saved.peak_bytes)
    spans = BackwardSpans(recorder, value) if recorder.enabled and value.requires_grad else None
    value.backward()
    if spans is not None:
        spans.autograd_done()  # where the autograd engine has not already said so
    model.finish_gradient_synchronization()  # a no-op where backward already finished it
    if spans is not None:
        spans.close()
    with recorder.span("step", cat="compute"):
        if max_norm is not None:
            model.clip_grad_norm_(max_norm)
        optimizer.step()
    if sample:
        _memory_sample(recorder, model, optimizer, 0)  # backward freed the activations
    optimizer.zero_grad(set_to_none=True)
    value = value.detach()
    recorder.loss(value)
    return value


def _activations(sample: bool, model):
    """Count the bytes autograd saves in forward (``ActivationMeter``), when sampling memory."""
    if not sample:
        return contextlib.nullcontext()
    from ddpkit.memory import ActivationMeter

    return ActivationMeter(model)


def _memory_sample(recorder, model, optimizer, activations: int) -> None:
    """What this rank holds now, by category (``ddpkit.memory``), to the recorder."""
    from ddpkit.memory import memory_by_category

    recorder.memory(**memory_by_category(model, optimizer, activations))
