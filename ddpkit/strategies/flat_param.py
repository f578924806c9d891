"""The flat parameter of one FSDP unit: its layout, this rank's shard, and the gathered buffer.

``FSDP`` (fsdp.py) decides *when* a unit is gathered and its gradient reduced; this file holds
*what* a unit is, so the story in fsdp.py stays about communication:

- ``FlatParamUnit``: the unit's parameters laid end to end in one flat tensor of T elements,
  padded to N * ceil(T/N); this rank's shard of ceil(T/N) elements (an ``nn.Parameter``, what
  the optimizer steps); the full gathered buffer whose storage is freed while resharded; and the
  views that put the original parameters back into the module while it is gathered.
- mixed precision: a unit may gather in ``param_dtype`` (e.g. bf16) and reduce gradients in
  ``reduce_dtype`` while its shard stays in the parameters' own dtype (fp32), as FSDP's
  ``MixedPrecision`` does; ``cast_floats`` casts a forward's floating-point inputs to match.
- state dicts: ``full_state_dict`` / ``load_full_state_dict`` of a whole FSDP wrapper.
"""
from __future__ import annotations

import torch
from torch import nn

from ddpkit.strategies._common import all_gather_flat


def free_storage(t: torch.Tensor) -> None:
    """Release a tensor's memory but keep the tensor (and every view of it) alive."""
    t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


class FlatParamUnit:
    """One unit: its flat parameter's layout, the local shard, and the gathered buffer."""

    def __init__(self, name: str, module: nn.Module, params: list, rank: int, world_size: int,
                 param_dtype=None, reduce_dtype=None):
        self.name, self.module = name or "(root)", module
        self.world_size, self.rank = world_size, rank
        # params: [(canonical name, parameter, [(submodule, attribute)] every place it is used)]
        dtypes = {p.dtype for _, p, _ in params}
        if len(dtypes) != 1:
            raise ValueError(f"unit {self.name} mixes parameter dtypes {sorted(map(str, dtypes))}; "
                             "FSDP flattens a unit into one tensor of one dtype")
        self.names = [n for n, _, _ in params]
        self.shapes = [p.shape for _, p, _ in params]
        self.numels = [p.numel() for _, p, _ in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.aliases = [a for _, _, a in params]
        self.numel = sum(self.numels)                       # T
        self.shard_numel = -(-self.numel // world_size)     # ceil(T / N)
        self.padded_numel = self.shard_numel * world_size   # N * ceil(T / N), padding <= N-1
        device = params[0][1].device
        with torch.no_grad():
            flat = torch.zeros(self.padded_numel, dtype=params[0][1].dtype, device=device)
            for (_, p, _), off, n in zip(params, self.offsets, self.numels, strict=True):
                flat[off:off + n].copy_(p.reshape(-1))
            own = flat[rank * self.shard_numel:(rank + 1) * self.shard_numel]
        self.shard = nn.Parameter(own.clone())  # the parameters' own dtype, what the optimizer steps
        self.param_dtype = param_dtype or self.shard.dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        # The full flat parameter, in param_dtype. Its storage is freed while resharded; the
        # tensor object lives on, so views saved by autograd in forward see the data again
        # once the backward all-gather refills the same storage.
        self.gathered = torch.empty(self.padded_numel, dtype=self.param_dtype, device=device)
        free_storage(self.gathered)
        self.unsharded = False
        self.pending = None        # an all-gather launched early (prefetch), not waited yet
        self.no_sync_grad = None   # padded full gradient (parameters' dtype) accumulated under no_sync()
        self.views_set = False
        self.forward_index = -1    # position in the last forward's order (backward prefetch)

    @property
    def gathered_bytes(self) -> int:
        return self.padded_numel * self.gathered.element_size()

    def all_gather_input(self) -> torch.Tensor:
        """What this rank sends in the all-gather: its shard, cast to ``param_dtype`` if needed.

        With mixed precision the cast lands in our own slot of the output buffer, so the
        all-gather runs in place (no extra send buffer). Call with the storage allocated.
        """
        if self.param_dtype == self.shard.dtype:
            return self.shard.detach()
        s = self.shard_numel
        send = self.gathered[self.rank * s:(self.rank + 1) * s]
        send.copy_(self.shard.detach())
        return send

    def flat_gradient(self, grads) -> torch.Tensor:
        """The unit's gradients packed into one padded flat buffer (N * ceil(T/N), ``reduce_dtype``),
        plus what ``no_sync()`` accumulated; a missing gradient (unused parameter) counts as zeros."""
        flat = torch.empty(self.padded_numel, dtype=self.reduce_dtype, device=self.shard.device)
        for g, off, n in zip(grads, self.offsets, self.numels, strict=True):
            if g is None:
                flat[off:off + n].zero_()
            else:
                flat[off:off + n].copy_(g.reshape(-1))
        flat[self.numel:].zero_()
        if self.no_sync_grad is not None:
            flat.add_(self.no_sync_grad)
            self.no_sync_grad = None
        return flat

    def accumulate_no_sync(self, grads) -> None:
        """Add this backward's gradients to the full local gradient kept under ``no_sync()``."""
        if self.no_sync_grad is None:
            self.no_sync_grad = torch.zeros(self.padded_numel, dtype=self.shard.dtype, device=self.shard.device)
        for g, off, n in zip(grads, self.offsets, self.numels, strict=True):
            if g is not None:
                self.no_sync_grad[off:off + n].add_(g.reshape(-1))

    def make_views(self) -> list[torch.Tensor]:
        # .data: a tensor on the same storage with its *own* version counter, so the all-gather
        # writing into self.gathered before backward does not look like an in-place change of
        # the tensors autograd saved in forward.
        base = self.gathered.data
        return [base[o:o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes, strict=True)]

    def set_views(self, views) -> None:
        for view, places in zip(views, self.aliases, strict=True):
            for mod, attr in places:
                setattr(mod, attr, view)
        self.views_set = True

    def clear_views(self) -> None:
        if self.views_set:
            for places in self.aliases:
                for mod, attr in places:
                    delattr(mod, attr)
            self.views_set = False


def cast_floats(obj, dtype):
    """Floating-point tensors in (nested) args/kwargs cast to the compute dtype (mixed precision)."""
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: cast_floats(v, dtype) for k, v in obj.items()}
    return obj


# ----------------------------------------------------------------------------- state dicts
@torch.no_grad()
def full_state_dict(fsdp) -> dict[str, torch.Tensor]:
    """{original parameter name: full tensor}, on every rank (one all-gather per unit)."""
    full = {}
    for unit in fsdp.units:
        flat = torch.empty(unit.padded_numel, dtype=unit.shard.dtype, device=unit.shard.device)
        with fsdp.recorder.labels(unit=unit.name):
            all_gather_flat(flat, unit.shard.detach(), group=fsdp.process_group)
        for name, off, n, shape in zip(unit.names, unit.offsets, unit.numels, unit.shapes, strict=True):
            full[name] = flat[off:off + n].view(shape).clone()
    for name, p in fsdp.frozen.items():
        full[name] = p.detach().clone()
    return {name: full[name] for name in fsdp.param_names}


@torch.no_grad()
def load_full_state_dict(fsdp, state_dict: dict) -> None:
    """Inverse of ``full_state_dict``: every rank passes the same full tensors, keeps its shard."""
    names = fsdp.param_names
    if set(state_dict) != set(names):
        missing, extra = set(names) - set(state_dict), set(state_dict) - set(names)
        raise ValueError(f"state dict does not match the model: missing {sorted(missing)}, "
                         f"unexpected {sorted(extra)}")
    for unit in fsdp.units:
        flat = torch.zeros(unit.padded_numel, dtype=unit.shard.dtype, device=unit.shard.device)
        for name, off, n, shape in zip(unit.names, unit.offsets, unit.numels, unit.shapes, strict=True):
            if tuple(state_dict[name].shape) != tuple(shape):
                raise ValueError(f"{name}: shape {list(state_dict[name].shape)} in the state "
                                 f"dict, {list(shape)} in the model")
            flat[off:off + n].copy_(state_dict[name].reshape(-1))
        s = unit.shard_numel
        unit.shard.copy_(flat[unit.rank * s:(unit.rank + 1) * s])
    for name, p in fsdp.frozen.items():
        p.copy_(state_dict[name])
