"""A workload: what an experiment trains -- a model, its data and its loss, given as callables.

    wl = ddpkit.Workload(
        model=lambda: GPT2LMHeadModel(cfg),                # built on every rank
        batch=lambda step, size: ids[step % 100, :size],   # the GLOBAL batch of `step`, `size` samples
        loss=lambda model, batch: model(input_ids=batch, labels=batch).loss,   # a scalar tensor
        name="gpt2-tiny")
    ddpkit.Workload.builtin("mlp", depth=8)                # the course's models are workloads too

Every instrument takes one where it took a model name (``compare``, ``run_strategy``, the trace,
the cost model, ``--model NAME``: a built-in or ``package.module:function``, ``load``). The
callables travel by value (cloudpickle), so notebook lambdas work. Each rank builds the model under
the same seed (``build``) and keeps its contiguous slice of dim 0 of the global batch
(``local_batch``; any nesting torch's pytree walks); with a *mean* loss every strategy then equals
one process (``ddpkit.step``).
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ddpkit.nested import leaves, map_leaves, tensors


@dataclass(frozen=True)
class Workload:
    """A model, its data and its loss (see the module docstring); ``name``: how tables call it."""

    model: Callable[[], nn.Module]                  # () -> a freshly built nn.Module
    batch: Callable[[int, int], Any]                # (step, size) -> the global batch, `size` samples
    loss: Callable[[nn.Module, Any], torch.Tensor]  # (model, batch) -> a scalar tensor
    name: str = "workload"
    config: dict = field(default_factory=dict, compare=False)  # a built-in's keywords (width, ...)

    def __post_init__(self):
        if isinstance(self.model, nn.Module):
            raise TypeError(f"Workload model= must build the model (e.g. lambda: {type(self.model).__name__}(...)), "
                            "not be one: every rank builds its own")
        for what in ("model", "batch", "loss"):
            if not callable(getattr(self, what)):
                raise TypeError(f"Workload {what}= must be callable, got {type(getattr(self, what)).__name__}")

    @classmethod
    def builtin(cls, name: str = "mlp", seed: int = 0, **kwargs) -> Workload:
        """A course model (``models.MODELS``, ``kwargs`` its size) with its data (``seed``), mean cross-entropy."""
        from ddpkit import models

        config = models.model_config(name, **kwargs)  # ValueError/TypeError for a bad name or keyword
        return cls(model=functools.partial(models.MODELS[name], **kwargs),
                   batch=functools.partial(models.synthetic_batch, name, seed=seed, **config),
                   loss=models.supervised_loss, name=name, config=dict(kwargs))

    @classmethod
    def of(cls, spec="mlp", model_kwargs: dict | None = None, seed: int = 0) -> Workload:
        """A Workload from a Workload, a built-in's name (``model_kwargs``, ``seed``), or ``load``'s form."""
        if isinstance(spec, Workload):
            if model_kwargs:
                raise ValueError(f"model_kwargs {model_kwargs} size a built-in model; workload "
                                 f"{spec.name!r} builds its own")
            return spec
        if not isinstance(spec, str):
            raise TypeError(f"expected a ddpkit.Workload or a model name, got {type(spec).__name__}")
        if ":" in spec:
            if model_kwargs:
                raise ValueError(f"model_kwargs {model_kwargs} size a built-in model; {spec} builds its own")
            return load(spec)
        return cls.builtin(spec, seed=seed, **(model_kwargs or {}))

    # --------------------------------------------------------------------- inside a rank
    def build(self, seed: int = 0) -> nn.Module:
        """``model()`` under torch seed ``seed`` (the caller's random state kept): equal on every process."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = self.model()
        if not isinstance(module, nn.Module):
            raise TypeError(f"workload {self.name!r}: model() returned a {type(module).__name__}, not an nn.Module")
        return module

    def global_batch(self, step: int, size: int):
        """``batch(step, size)``, checked: tensors only, each with ``size`` samples on dim 0."""
        batch = self.batch(step, size)
        for where, t in leaves(batch):
            if not torch.is_tensor(t):
                raise TypeError(f"workload {self.name!r}: batch{where} is a {type(t).__name__}, not a tensor (a "
                                "batch is a tensor, or tuples, lists, dicts, named tuples or dataclasses of tensors)")
            if t.dim() == 0 or t.shape[0] != size:
                got = "a 0-d tensor" if t.dim() == 0 else f"{t.shape[0]} samples"
                raise ValueError(f"workload {self.name!r}: batch({step}, {size}){where} has {got} on "
                                 f"dim 0; it must hold the {size} samples asked for")
        return batch

    def local_batch(self, step: int, size: int, rank: int, world_size: int, device=None):
        """This rank's contiguous slice of global batch ``step`` (``size`` samples), on ``device``."""
        return to_device(shard_batch(self.global_batch(step, size), rank, world_size), device)

    def compute_loss(self, model, batch) -> torch.Tensor:
        """``loss(model, batch)``, checked to be a scalar tensor."""
        value = self.loss(model, batch)
        if not torch.is_tensor(value) or value.numel() != 1:
            what = f"a tensor of shape {list(value.shape)}" if torch.is_tensor(value) else f"a {type(value).__name__}"
            raise TypeError(f"workload {self.name!r}: loss() returned {what}; it must be a scalar tensor")
        return value


# ----------------------------------------------------------------------------- batches
def samples_per_rank(global_batch_size: int, world_size: int) -> int:
    """B/N, each rank's share of a global batch; ValueError unless B splits evenly (the one check)."""
    if global_batch_size % world_size:
        raise ValueError(f"a global batch of {global_batch_size} does not split evenly over {world_size} ranks")
    return global_batch_size // world_size


def shard_batch(batch, rank: int, world_size: int):
    """Rank ``rank``'s contiguous slice of dim 0 of every tensor in ``batch`` (B/N samples)."""
    sizes = {t.shape[0] for t in tensors(batch) if t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(f"a batch's tensors must share dim 0 (samples); found sizes {sorted(sizes) or 'none'}")
    per = samples_per_rank(sizes.pop(), world_size)
    return map_leaves(lambda t: t[rank * per:(rank + 1) * per], batch)


def to_device(batch, device):
    """Every tensor of ``batch`` on ``device`` (None: left where it is)."""
    return batch if device is None else map_leaves(lambda t: t.to(device) if torch.is_tensor(t) else t, batch)


# ----------------------------------------------------------------------------- by name
def load(spec: str) -> Workload:
    """``"package.module:function"`` -> ``function()``, a Workload, imported here: a mistake is a
    ValueError now, not a traceback from every rank."""
    module_name, _, fn_name = spec.partition(":")
    if not module_name or not fn_name:
        raise ValueError(f"workload {spec!r}: expected package.module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raised while importing
        raise ValueError(f"workload {spec!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc})") from exc
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"workload {spec!r}: {module_name} has no function {fn_name!r}")
    workload = fn()
    if not isinstance(workload, Workload):
        raise ValueError(f"workload {spec!r}: {fn_name}() returned a {type(workload).__name__}, "
                         "not a ddpkit.Workload")
    return workload


def named(name: str, width: int | None = None, depth: int | None = None, seed: int = 0) -> Workload:
    """The command line's ``--model NAME --width W --depth D``: a built-in sized in its own terms
    (``models.size_kwargs``), or ``package.module:function`` (``load``); ValueError otherwise."""
    from ddpkit.models import MODELS, size_kwargs

    if ":" in name:
        if width is not None or depth is not None:
            raise ValueError(f"--width/--depth size the built-in models ({', '.join(MODELS)}); "
                             f"{name} builds its own")
        return load(name)
    if name not in MODELS:
        raise ValueError(f"--model {name!r}: not a built-in model ({', '.join(MODELS)}) nor "
                         "package.module:function (a function returning a ddpkit.Workload)")
    return Workload.builtin(name, seed=seed, **size_kwargs(name, width, depth))


def resolve(workload=None, model=None, model_kwargs: dict | None = None, seed: int = 0) -> Workload:
    """What an instrument was asked to train: ``workload`` or the older ``model=``; neither: the MLP."""
    if workload is not None and model is not None:
        raise TypeError("give workload= or model=, not both (model= is the older name of workload=)")
    spec = workload if workload is not None else (model if model is not None else "mlp")
    return Workload.of(spec, model_kwargs, seed)


__all__ = ["Workload", "load", "named", "resolve", "samples_per_rank", "shard_batch", "to_device"]
