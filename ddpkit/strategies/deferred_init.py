"""Deferred initialization: a model built on the ``meta`` device, materialized one FSDP unit at a time.

A model too large for one device cannot be built whole and then sharded. The FSDP paper (3.1)
builds it on the ``meta`` device (shapes, no storage), then replays the initialization unit by
unit: allocate a unit, initialize it, keep this rank's shard, free the rest. The peak is the shards
so far plus one unit (and the root's own parameters).

Replaying goes module by module in registration order: each module with meta tensors of its own
gets them allocated and runs ``param_init_fn(module)`` (default ``reset_parameters()``), so a model
initialized in registration order from the global RNG gets the eager values on the same device (a
GPU's generator differs from the CPU's). A tied parameter is initialized by its first module. Each
module's values are broadcast from rank 0.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
from torch import nn

from ddpkit.strategies.common import broadcast_from_rank0


def is_deferred(module: nn.Module) -> bool:
    """True when ``module`` has parameters or buffers on the meta device (not materialized yet)."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def _reset_parameters(module: nn.Module) -> None:
    if not callable(getattr(module, "reset_parameters", None)):
        raise ValueError(f"deferred initialization: {type(module).__name__} has parameters on the meta "
                         "device but no reset_parameters() to initialize them; pass param_init_fn")
    module.reset_parameters()


@torch.no_grad()
def materialize_by_unit(module: nn.Module, units: list, device, param_init_fn: Callable | None = None,
                        group=None) -> Iterator[tuple]:
    """Materialize ``module`` module by module, yielding ``(unit, params)`` (``plan_units``' units,
    their ``UnitParam``s now real) once a unit is all real, the root last. Nothing is kept once
    yielded, so each unit is freed before the next; frozen parameters end up real in the module."""
    init = param_init_fn or _reset_parameters
    unit_of = {id(q.param): unit for unit in units for q in unit.params}
    remaining = {unit.name: len(unit.params) for unit in units}
    aliases = {}  # id(meta parameter) -> every (submodule, attribute) holding it
    for mod in module.modules():
        for attr, p in mod._parameters.items():
            if p is not None:
                aliases.setdefault(id(p), []).append((mod, attr))
    real: dict[int, nn.Parameter] = {}  # id(meta parameter) -> its real parameter, until handed over
    for _, m in module.named_modules():
        fresh = []
        for p in list(m._parameters.values()):
            if p is None or not p.is_meta:  # real already (or tied to one materialized earlier)
                continue
            new = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
            for mod, a in aliases[id(p)]:  # every name it is reachable under
                mod._parameters[a] = new
            if id(p) in unit_of:
                real[id(p)] = new
            fresh.append((p, new))
        for attr, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[attr] = torch.empty_like(b, device=device)
                fresh.append((None, m._buffers[attr]))
        if not fresh:
            continue
        init(m)  # this module's own parameters and buffers, as its constructor did
        broadcast_from_rank0([t for _, t in fresh], group, bucket_bytes=0)  # a tensor at a time: no flat copy
        for meta, _ in fresh:
            unit = unit_of.get(id(meta)) if meta is not None else None
            if unit is None:
                continue
            remaining[unit.name] -= 1
            if remaining[unit.name] == 0 and unit.name != "":
                yield unit, _hand_over(unit, real)
    # the root last (its own modules come first in named_modules(), but it stays gathered through
    # the whole step anyway), and any unit whose parameters were not all on the meta device
    for unit in units:
        if unit.name == "" or remaining[unit.name] > 0:
            yield unit, _hand_over(unit, real)


def _hand_over(unit, real: dict) -> list:
    """The unit's parameters, real now, forgotten here (so they can be freed once flattened)."""
    return [replace(q, param=real.pop(id(q.param), q.param)) for q in unit.params]
