"""FSDP: ZeRO-3, every parameter sharded 1/N per rank and gathered just in time.

DDP keeps the whole model (parameters, gradients, optimizer state) on every rank; FSDP (Zhao et
al., 2023; ZeRO stage 3) keeps 1/N of each. The module is cut into *units* (``flat_param.plan_units``),
each one *flat parameter* padded to a multiple of N and split into N *shards*; rank r keeps shard r,
and ``fsdp.parameters()`` are the shards, so the optimizer only ever sees 1/N of the model.

- forward: before a unit runs, *unshard* it (all-gather its shards; the unit's parameters become
  views into the full flat parameter); after it ran, *reshard* (free it: ``reshard_after_forward``);
- backward: unshard it again when the gradient reaches its output (a Linear's backward needs its
  weight); once its gradients are ready, pack them into one flat gradient, divide by N and
  *reduce-scatter* it: rank r receives the sum of everyone's shard r, the gradient of its shard.

Bytes a rank sends a step: two all-gathers and a reduce-scatter, 3(N-1)/N S, 1.5x DDP's
(``reshard_after_forward=False``: 1x). Between steps the parameters view freed buffers: read them
with ``full_state_dict()``. A unit's flat parameter is ``flat_param.py``'s.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.nested import tensors
from ddpkit.rankside import device as rank_device
from ddpkit.strategies.common import clip_grad_norm_, forward_timed, nbytes, no_sync, prepare_module
from ddpkit.strategies.deferred_init import is_deferred, materialize_by_unit
from ddpkit.strategies.flat_layout import alloc_storage, free_storage, held_bytes
from ddpkit.strategies.flat_param import FlatParamUnit, cast_floats, plan_units
from ddpkit.torch_internals import all_gather_flat, queue_at_end_of_backward, reduce_scatter_flat
from ddpkit.trace.seam import recorder as rank_recorder


@dataclass
class PendingReduce:
    """A reduce-scatter in flight: the unit, its handle, the output shard and the input buffer."""

    unit: FlatParamUnit
    work: object
    out: torch.Tensor    # (ceil(T/N),) this rank's summed shard of the gradient, reduce_dtype
    flat: torch.Tensor   # (N * ceil(T/N),) the packed gradient sent in; kept alive until done


class FSDP(nn.Module):
    """ZeRO-3: each unit is one flat parameter sharded 1/N per rank, gathered just in time.

    The FSDP paper's switches (3.3-3.4, 4): ``backward_prefetch`` (on), ``forward_prefetch`` (off, as
    torch's), ``limit_all_gathers=L`` (a prefetch waits while L units are unsharded; True: torch's 2).
    A ``meta`` module is materialized unit by unit; ``replicate_group``: hybrid sharding's replicas.
    Frozen parameters stay whole, never reduced; buffers are broadcast from rank 0."""

    def __init__(self, module: nn.Module, units: Iterable[nn.Module | type] | None = None,
                 reshard_after_forward: bool = True, backward_prefetch: bool = True,
                 forward_prefetch: bool = False, limit_all_gathers: int | bool | None = None,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 param_init_fn=None, device=None, process_group=None, replicate_group=None,
                 recorder=None):
        super().__init__()
        self.limit_all_gathers = _check_limit(limit_all_gathers)  # before any communication
        for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(f"{type(self).__name__}: {name} takes a floating torch.dtype (e.g. torch.bfloat16) "
                                 f"or None (the parameters' own), got {dtype!r}")
        # checks, then rank 0's values everywhere (meta tensors: once materialized, below)
        prepare_module(type(self).__name__, module, None if replicate_group is not None else process_group)
        self.module = module
        self.process_group = process_group        # the ranks a unit is sharded over
        self.replicate_group = replicate_group    # hybrid sharding: the same shard on other nodes
        self.recorder = rank_recorder() if recorder is None else recorder  # None: the rank's
        self.reshard_after_forward = reshard_after_forward
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        # gradients are averaged over every rank: the shard group times its replicas
        self.replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1

        # --- plan: which unit owns which parameter (flat_param.plan_units; nothing changed yet)
        plan = plan_units(module, units)
        self.param_names: list[str] = plan.param_names  # canonical names, in named_parameters() order
        # --- build: materialize, flatten and shard the units one by one (_build_units, below)
        built = self._build_units(plan, device, param_init_fn)
        self.units: list[FlatParamUnit] = [built[unit.name] for unit in plan.units]  # the plan's order
        self.root_unit: FlatParamUnit | None = built.get("")
        # frozen parameters stay whole in the module, never reduced (real now, if deferred)
        self.frozen: dict[str, nn.Parameter] = {name: module.get_parameter(name) for name in plan.frozen}
        # fsdp.parameters() = these shards (+ frozen parameters still inside the module)
        self.flat_params = nn.ParameterList([u.shard for u in self.units])
        # --- hook: what drives communication (forward below, backward after it)
        for unit in self.units:
            if unit is not self.root_unit:  # the root is gathered by forward() itself
                unit.module.register_forward_pre_hook(self._make_pre_forward(unit))
                unit.module.register_forward_hook(self._make_post_forward(unit))

        self._require_sync = True  # False inside no_sync()
        self._in_backward = False
        self._forward_order: list[FlatParamUnit] = []
        self._last_forward_order: list[FlatParamUnit] = []  # forward prefetch follows it
        self._pending_reduce: list[PendingReduce] = []
        self._unsharded_bytes = 0

    def _build_units(self, plan, device, param_init_fn) -> dict[str, FlatParamUnit]:
        """``{unit name: FlatParamUnit}``, each sharded as soon as it is real (a meta module unit by unit)."""
        if is_deferred(self.module):
            group = None if self.replicate_group is not None else self.process_group
            ready = materialize_by_unit(self.module, plan.units, device or rank_device(), param_init_fn, group)
        else:
            ready = ((unit, unit.params) for unit in plan.units)
        built = {}
        for unit, params in ready:
            built[unit.name] = FlatParamUnit(unit.name, unit.module, params, self.rank, self.world_size,
                                             self.param_dtype, self.reduce_dtype)
            del params  # deferred init: nothing holds the unit's full parameters any more
        return built

    # ================================================================== forward: all-gather
    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            self.recorder.begin_forward()  # a training forward begins a step, unless the loop began it
        if self._forward_order:
            self._last_forward_order = self._forward_order
        self._forward_order = []
        if self.param_dtype is not None:
            args, kwargs = cast_floats(args, self.param_dtype), cast_floats(kwargs, self.param_dtype)
        if self.root_unit is not None:
            self._use_full_params(self.root_unit)  # stays gathered until the end of backward
        training = torch.is_grad_enabled()  # in a loop of its own, timed here (forward_timed)
        out = forward_timed(self.recorder, self.module, args, kwargs) if training else self.module(*args, **kwargs)
        if training:
            # the first hook to fire in backward: arrange for the end-of-backward work
            for t in tensors(out):
                if t.requires_grad:
                    t.register_hook(self._root_pre_backward)
        else:  # no backward will come: free everything (a forward prefetch too)
            for unit in self.units:
                self._reshard(unit)
        return out

    def _make_pre_forward(self, unit: FlatParamUnit):
        def pre_forward(module, args):
            unit.forward_index = len(self._forward_order)
            self._forward_order.append(unit)
            self._use_full_params(unit)  # all-gather (waits for it)
            if self.forward_prefetch:
                # the unit that ran after this one in the last forward: launch its all-gather now,
                # so it travels while this unit computes
                last = self._last_forward_order
                if unit in last and last.index(unit) + 1 < len(last):
                    self._prefetch(last[last.index(unit) + 1])
        return pre_forward

    def _prefetch(self, unit: FlatParamUnit) -> None:
        """Launch ``unit``'s all-gather early, unless gathered already or ``limit_all_gathers`` says wait."""
        in_flight = sum(u.unsharded for u in self.units if u is not self.root_unit)
        if not unit.unsharded and (self.limit_all_gathers is None or in_flight < self.limit_all_gathers):
            self._unshard(unit, async_op=True)

    def _use_full_params(self, unit: FlatParamUnit) -> None:
        """Unshard and point the original parameter names at views of the full flat parameter."""
        self._unshard(unit)
        if torch.is_grad_enabled():
            unit.set_views(_Unshard.apply(unit.shard, self, unit))  # its backward: reduce-scatter
        else:
            unit.set_views(unit.make_views())

    def _unshard(self, unit: FlatParamUnit, async_op: bool = False) -> None:
        """All-gather the unit's shards into its full flat parameter (N * ceil(T/N) elements)."""
        if unit.pending is not None and not async_op:
            unit.pending.wait()
            unit.pending = None
        if unit.unsharded:
            return
        alloc_storage(unit.gathered)
        with self.recorder.labels(unit=unit.name):
            work = all_gather_flat(unit.gathered, unit.all_gather_input(), group=self.process_group, async_op=True)
        unit.unsharded = True
        self._unsharded_bytes += unit.gathered_bytes
        if self.recorder.enabled:
            self.recorder.memory(unsharded_parameters=self._unsharded_bytes)
        if async_op:
            unit.pending = work
        else:
            work.wait()

    def _make_post_forward(self, unit: FlatParamUnit):
        def post_forward(module, args, output):
            if not torch.is_grad_enabled():
                self._reshard(unit)  # no backward will come
                return None
            if self.reshard_after_forward:
                self._reshard(unit)  # free now, all-gather again before this unit's backward
            for t in tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda grad, unit=unit: self._pre_backward(unit))
            return None
        return post_forward

    def _reshard(self, unit: FlatParamUnit) -> None:
        """Free the full flat parameter (the shard stays)."""
        if unit.pending is not None:  # prefetched but never used: finish it before freeing
            unit.pending.wait()
            unit.pending = None
        if not unit.unsharded:
            return
        unit.clear_views()
        free_storage(unit.gathered)
        unit.unsharded = False
        self._unsharded_bytes -= unit.gathered_bytes
        if self.recorder.enabled:
            self.recorder.memory(unsharded_parameters=self._unsharded_bytes)

    # ================================================================== backward: reduce-scatter
    def _root_pre_backward(self, grad):
        if not self._in_backward:
            self._in_backward = True
            queue_at_end_of_backward(self.finish_gradient_synchronization)
        return None

    def _pre_backward(self, unit: FlatParamUnit) -> None:
        """The gradient reached this unit's output: gather it (again) and prefetch the next."""
        self._root_pre_backward(None)
        self._unshard(unit)
        if self.backward_prefetch and unit.forward_index > 0:
            # backward runs the units in reverse forward order: launch the next one's
            # all-gather now, so it travels while this unit's backward computes
            self._prefetch(self._forward_order[unit.forward_index - 1])

    @torch.no_grad()
    def _post_backward(self, unit: FlatParamUnit, grads) -> None:
        """The unit's gradients are ready (``_Unshard.backward``): reduce-scatter them, or keep (no_sync)."""
        if not self._require_sync:
            # no_sync(): accumulate the full unsharded gradient locally (T elements per unit in
            # the parameters' dtype: the whole model's gradient, as much memory as DDP's grads)
            unit.accumulate_no_sync(grads)
            self._reshard(unit)
            return
        flat = unit.flat_gradient(grads)  # (N * ceil(T/N),) reduce_dtype, padding zeroed
        # divide by N before the SUM (ReduceOp.AVG is not on every backend, and dividing first
        # keeps a low-precision sum from overflowing); hybrid: by every rank, N x replicas
        if self.world_size * self.replicas > 1:
            flat.div_(self.world_size * self.replicas)
        out = torch.empty(unit.layout.shard_numel, dtype=unit.reduce_dtype, device=unit.shard.device)
        with self.recorder.labels(unit=unit.name):
            work = reduce_scatter_flat(out, flat, group=self.process_group, async_op=True)
        self._pending_reduce.append(PendingReduce(unit, work, out, flat))
        self._reshard(unit)

    def finish_gradient_synchronization(self) -> None:
        """Wait for the last reduce-scatters, write the shards' .grad, reshard everything."""
        if self._require_sync:  # a unit used under no_sync() but not in the last backward: reduce it now
            for unit in self.units:
                if unit.no_sync_grad is not None:
                    self._post_backward(unit, [None] * len(unit.names))
        pending, self._pending_reduce = self._pending_reduce, []
        if self.replicate_group is not None:
            # hybrid sharding: the shard's gradient summed inside the node, now across nodes
            # (every node holds the same shard r): all-reduce it in the replicate group
            for p in pending:
                p.work.wait()
                with self.recorder.labels(unit=p.unit.name):
                    p.work = dist.all_reduce(p.out, group=self.replicate_group, async_op=True)
        for p in pending:
            p.work.wait()
            grad = p.out if p.out.dtype == p.unit.shard.dtype else p.out.to(p.unit.shard.dtype)
            if p.unit.shard.grad is None:
                p.unit.shard.grad = grad
            else:
                p.unit.shard.grad += grad
        for unit in self.units:
            self._reshard(unit)
        self._in_backward = False

    # no_sync(): full gradients accumulate locally (the whole model's, as DDP holds) until the next
    # backward outside syncs them: accumulation trades FSDP's gradient memory for fewer reduce-scatters
    no_sync = no_sync

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """torch ``fully_shard``'s spelling of ``no_sync()``: False keeps gradients local and unsharded."""
        self._require_sync = bool(requires_gradient_sync)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Finish the sync, then clip by the whole gradient's norm, combined over the shard group."""
        self.finish_gradient_synchronization()
        return clip_grad_norm_([u.shard for u in self.units], max_norm, norm_type, sharded=True,
                               group=self.process_group, recorder=self.recorder)

    # ------------------------------------------------------------------ state and sizes
    def comm_buffer_bytes(self) -> int:
        """Bytes held now in gathered flat parameters, pending reduce buffers and no_sync grads."""
        total = sum(held_bytes(u.gathered) for u in self.units)
        total += sum(nbytes(p.out) + nbytes(p.flat) for p in self._pending_reduce)
        return total + sum(nbytes(u.no_sync_grad) for u in self.units if u.no_sync_grad is not None)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{original parameter name: full tensor}, on every rank (one all-gather per unit)."""
        full = {}
        for unit in self.units:
            flat = unit.layout.empty(unit.shard.dtype, unit.shard.device)
            with self.recorder.labels(unit=unit.name):
                all_gather_flat(flat, unit.shard.detach(), group=self.process_group)
            full.update({name: view.clone() for name, view in zip(unit.names, unit.layout.views(flat), strict=True)})
        for name, p in self.frozen.items():
            full[name] = p.detach().clone()
        return {name: full[name] for name in self.param_names}

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict) -> None:
        """Inverse of full_state_dict(): every rank passes the same full tensors, keeps its shard."""
        names = self.param_names
        if set(state_dict) != set(names):
            missing, extra = set(names) - set(state_dict), set(state_dict) - set(names)
            raise ValueError(f"state dict does not match the model: missing {sorted(missing)}, "
                             f"unexpected {sorted(extra)}")
        for unit in self.units:  # every shape checked before anything is loaded
            for name, shape in zip(unit.names, unit.layout.shapes, strict=True):
                if tuple(state_dict[name].shape) != tuple(shape):
                    raise ValueError(f"{name}: shape {list(state_dict[name].shape)} in the state "
                                     f"dict, {list(shape)} in the model")
        for unit in self.units:
            flat = unit.layout.pack([state_dict[name] for name in unit.names],
                                    unit.layout.empty(unit.shard.dtype, unit.shard.device))
            unit.shard.copy_(unit.layout.shard(flat))
        for name, p in self.frozen.items():
            p.copy_(state_dict[name])


class _Unshard(torch.autograd.Function):
    """Shard -> the unit's full parameters; backward hands their gradients to ``FSDP._post_backward``."""

    @staticmethod
    def forward(ctx, shard, fsdp, unit):
        ctx.fsdp, ctx.unit = fsdp, unit
        ctx.set_materialize_grads(False)  # an unused parameter's gradient arrives as None
        return tuple(unit.make_views())

    @staticmethod
    def backward(ctx, *grads):
        ctx.fsdp._post_backward(ctx.unit, grads)
        return None, None, None


def _check_limit(limit):
    """``limit_all_gathers``: None/False (no limit), True (torch's 2) or a whole number >= 1."""
    if limit is None or limit is False:
        return None
    if limit is True:
        return 2
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit_all_gathers must be a whole number >= 1 (at most that many units "
                         f"unsharded at once), True (2) or None (no limit), got {limit!r}")
    return limit
