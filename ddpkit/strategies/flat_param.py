"""FSDP's units: which unit owns which parameter (the plan), and what a unit holds (its flat parameter).

``FSDP`` (fsdp.py) decides *when* a unit is gathered and reduced; this file holds *what* it is:
``plan_units`` (which unit owns which parameter, every place each is used; nothing changed),
``FlatParamUnit`` (the parameters end to end, padded to N * ceil(T/N); this rank's shard, what the
optimizer steps; the gathered buffer, freed while resharded; the views put back into the module),
and mixed precision (gather in ``param_dtype``, reduce in ``reduce_dtype``, the shard in its own
dtype, as torch's ``MixedPrecision``; ``cast_floats`` casts a forward's inputs).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ddpkit.nested import map_leaves
from ddpkit.strategies.common import default_units, resolve_units
from ddpkit.strategies.flat_layout import FlatLayout, free_storage


# ----------------------------------------------------------------------------- the plan
@dataclass
class UnitParam:
    """One parameter a unit will flatten: its name, the tensor, and every place the module holds it."""

    name: str            # canonical: the first name module.named_parameters() gives it
    param: torch.Tensor  # on the meta device until deferred initialization makes it real
    places: list         # [(submodule, attribute)]: every place it is used (a tied one has several)


@dataclass
class UnitPlan:
    """One unit to build: its module and the parameters it will flatten, in order."""

    name: str                # the module's qualified name; "" is the root
    module: nn.Module
    params: list[UnitParam]


@dataclass
class Plan:
    """The units (in order, the root last), the frozen parameters' names, every original name in order."""

    units: list[UnitPlan]
    frozen: list[str]
    param_names: list[str]   # canonical names, in module.named_parameters() order


def plan_units(module: nn.Module, units: Iterable | None = None) -> Plan:
    """The units of ``module`` (``units`` via ``resolve_units``, else ``default_units``); the root
    keeps what no unit claims. Each trainable parameter goes to the innermost unit holding *every*
    use of it (tied ones), so no unit reshards a tensor another needs. Works on the meta device."""
    module_names = {id(m): name for name, m in module.named_modules()}
    units = default_units(module) if units is None else resolve_units(module, units)
    unit_modules: dict[str, nn.Module] = {module_names[id(u)]: u for u in units}
    unit_modules[""] = module  # the root, keeps whatever no unit claims

    # every name each parameter is reachable under (tied parameters have several)
    places: dict[int, list] = {}
    for full_name, p in module.named_parameters(remove_duplicate=False):
        places.setdefault(id(p), [p, []])[1].append(full_name)
    owned: dict[str, list] = {name: [] for name in unit_modules}
    frozen, param_names = [], []
    by_depth = sorted(unit_modules, key=len, reverse=True)
    for p, names in places.values():
        param_names.append(names[0])
        if not p.requires_grad:
            frozen.append(names[0])
            continue
        # the innermost unit whose subtree contains every use of p
        owner = next(u for u in by_depth if all(n.startswith(u + ".") or u == "" for n in names))
        places = []
        for n in names:
            mod_name, _, attr = n.rpartition(".")
            places.append((module.get_submodule(mod_name), attr))
        owned[owner].append(UnitParam(names[0], p, places))
    return Plan([UnitPlan(name, unit_modules[name], params) for name, params in owned.items() if params],
                frozen, param_names)


# ----------------------------------------------------------------------------- a unit
class FlatParamUnit:
    """One unit: its flat parameter's layout, the local shard, and the gathered buffer."""

    def __init__(self, name: str, module: nn.Module, params: list[UnitParam], rank: int, world_size: int,
                 param_dtype=None, reduce_dtype=None):
        self.name, self.module = name or "(root)", module
        dtypes = {q.param.dtype for q in params}
        if len(dtypes) != 1:
            raise ValueError(f"unit {self.name} mixes parameter dtypes {sorted(map(str, dtypes))}; "
                             "FSDP flattens a unit into one tensor of one dtype")
        self.names = [q.name for q in params]
        self.aliases = [q.places for q in params]
        tensors = [q.param for q in params]
        # T elements end to end, padded to N * ceil(T/N) (padding <= N-1); shard r of ceil(T/N)
        self.layout = FlatLayout.of(tensors, world_size, rank)
        device = tensors[0].device
        flat = self.layout.pack(tensors, self.layout.empty(tensors[0].dtype, device))
        # this rank's shard, in the parameters' own dtype: what the optimizer steps
        self.shard = nn.Parameter(self.layout.shard(flat).clone())
        del flat
        # the originals out of the module: from here on they exist only as views into the gathered
        # buffer, set while the unit is unsharded (deferred init: nothing else holds them now)
        for places in self.aliases:
            for mod, attr in places:
                mod._parameters.pop(attr, None)
        self.param_dtype = param_dtype or self.shard.dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        # The full flat parameter, in param_dtype: its storage freed while resharded, the tensor kept,
        # so views autograd saved in forward see the data again once backward's all-gather refills it.
        self.gathered = self.layout.empty(self.param_dtype, device)
        free_storage(self.gathered)
        self.unsharded = False
        self.pending = None        # an all-gather launched early (prefetch), not waited yet
        self.no_sync_grad = None   # padded full gradient (parameters' dtype) accumulated under no_sync()
        self.views_set = False
        self.forward_index = -1    # position in the last forward's order (backward prefetch)

    @property
    def gathered_bytes(self) -> int:
        return self.layout.padded_numel * self.gathered.element_size()

    def all_gather_input(self) -> torch.Tensor:
        """This rank's shard cast to ``param_dtype`` into its own slot of the output: an in-place all-gather."""
        if self.param_dtype == self.shard.dtype:
            return self.shard.detach()
        send = self.layout.shard(self.gathered)
        send.copy_(self.shard.detach())
        return send

    def flat_gradient(self, grads) -> torch.Tensor:
        """The unit's gradients (and ``no_sync()``'s sum; a missing one zeros), padded, in ``reduce_dtype``."""
        flat = self.layout.pack(grads, self.layout.empty(self.reduce_dtype, self.shard.device))
        if self.no_sync_grad is not None:
            flat.add_(self.no_sync_grad)
            self.no_sync_grad = None
        return flat

    def accumulate_no_sync(self, grads) -> None:
        """Add this backward's gradients to the full local gradient kept under ``no_sync()``."""
        if self.no_sync_grad is None:
            self.no_sync_grad = self.layout.zeros(self.shard.dtype, self.shard.device)
        for g, view in zip(grads, self.layout.views(self.no_sync_grad), strict=True):
            if g is not None:
                view.add_(g)

    def make_views(self) -> list[torch.Tensor]:
        # .data: a tensor on the same storage with its *own* version counter, so the all-gather
        # writing into self.gathered before backward does not look like an in-place change of
        # the tensors autograd saved in forward.
        return self.layout.views(self.gathered.data)

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
    return map_leaves(lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t, obj)
