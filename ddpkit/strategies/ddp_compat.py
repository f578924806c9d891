"""TorchDDPCompat: what torch's DistributedDataParallel has besides the core, composed onto it.

Every public DDP wrapper is ``class NaiveDDP(TorchDDPCompat, DDPModule)``: the core averages the
gradients; this layer lets it drop into a script written for torch's DDP: torch's arguments
(``torch_ddp_args.py``), rank 0's buffers before a forward after a synchronising one,
``require_backward_grad_sync``, ``find_unused_parameters`` (DDP paper 3.2.3), comm hooks, and
uneven inputs through torch's ``Join`` (a rank out of batches shadows the others' collectives).
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms import Join, Joinable, JoinHook

from ddpkit.strategies.comm_hooks import comm_hook as comm_hook_by_name
from ddpkit.strategies.ddp_module import DDPModule
from ddpkit.strategies.torch_ddp_args import TorchDDPArgs, group_of
from ddpkit.strategies.torch_ddp_surface import TorchDDPSurface
from ddpkit.torch_internals import tensors_to


class TorchDDPCompat(TorchDDPSurface, DDPModule, Joinable):
    """torch DDP's arguments, buffers, unused parameters, comm hooks and Join, on the core."""

    def __init__(self, module: nn.Module, process_group=None, recorder=None, *, find_unused_parameters: bool = False,
                 comm_hook=None, torch_ddp: dict | None = None, **core):
        """``torch_ddp``: torch DDP's other keywords as given; ``core``: ``DDPModule``'s own."""
        strategy = type(self).__name__
        if not isinstance(module, nn.Module):
            raise TypeError(f"{strategy} wraps an nn.Module, got {type(module).__name__}")
        torch_ddp = dict(torch_ddp or {})
        comm_hook = torch_ddp.pop("comm_hook", comm_hook)  # a wrapper without the argument: refused below
        group = group_of(strategy, process_group, torch_ddp.pop("device_mesh", None))
        args = TorchDDPArgs.parse(strategy, module, **torch_ddp)  # every refusal before any communication
        super().__init__(module, group, recorder, broadcast=(args.init_sync, args.init_sync and args.init_sync_buffers),
                         **core)
        Joinable.__init__(self)
        self.torch_args = args
        self.find_unused_parameters = find_unused_parameters
        self._warned_unused = False
        # broadcast before a forward that follows a synchronising one (torch's forward_sync_buffers)
        self._forward_buffers = list(module.buffers()) if args.forward_sync_buffers else []
        self._sync_buffers_next = True
        self._comm_hook = None  # how a bucket is reduced (register_comm_hook); None: an all-reduce
        if comm_hook is not None:  # a name in comm_hooks.COMM_HOOKS, or a hook function
            self._register_hook(comm_hook)

    def _before_forward(self, training: bool, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Join's notice to the ranks that finished, rank 0's buffers, the inputs to ``device_ids[0]``."""
        if training and self._join_config.enable:
            self._tell_finished_ranks()
        # buffers: under Join only in a training forward, the one the finished ranks shadow (_ShadowSteps)
        if self._sync_buffers_next and self._forward_buffers and (training or not self._join_config.enable):
            self._broadcast_buffers()
        self._sync_buffers_next = training and self._require_sync
        if self.torch_args.device is not None:  # device_ids: the inputs go to the module's GPU
            args, kwargs = tensors_to((args, kwargs), self.torch_args.device)
        return args, kwargs

    @torch.no_grad()
    def _broadcast_buffers(self, joined: bool = False) -> None:
        """Every buffer from rank 0, or under Join from the highest rank still training (one all-reduce MAX)."""
        src = 0
        if self._join_config.enable:
            mine = torch.tensor([-1 if joined else dist.get_rank(self.process_group)], device=self.join_device)
            dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.process_group)
            src = int(mine.item())
        if self.process_group is not None:
            src = dist.get_global_rank(self.process_group, src)
        with self.recorder.labels():
            for b in self._forward_buffers:
                dist.broadcast(b, src=src, group=self.process_group)

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag for the next forward: False accumulates locally (nanoGPT sets it by hand)."""
        return self._require_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._require_sync = bool(value)

    # ------------------------------------------------------------------ unused parameters
    def _has_grad(self) -> list[bool]:
        """Which gradients this rank has now (before a sync fills the missing ones with zeros)."""
        return [p.grad is not None for _, p in self.named_grads]

    @torch.no_grad()
    def _settle_unused(self, has_grad: list[bool]) -> None:
        """After the reduction: with ``find_unused_parameters`` a bitmap all-reduce sets ``.grad`` None
        where no rank had one; without, warn once if some is missing."""
        if not self.find_unused_parameters:
            if not all(has_grad) and not self._warned_unused:
                self._warned_unused = True
                missing = [name for (name, _), has in zip(self.named_grads, has_grad, strict=True) if not has]
                warnings.warn(f"{type(self).__name__}: {', '.join(missing[:5])} got no gradient on rank "
                              f"{dist.get_rank()}; reduced as zeros. If no rank uses it, its .grad becomes "
                              "zeros (one process leaves it None): pass find_unused_parameters=True", stacklevel=3)
            return
        device = self.named_grads[0][1].device if self.named_grads else None
        used = torch.tensor(has_grad, dtype=torch.int32, device=device)
        with self.recorder.labels():  # no bucket: recorded into this wrapper's recorder, unlabelled
            dist.all_reduce(used, group=self.process_group)
        for (_, p), count in zip(self.named_grads, used.tolist(), strict=True):
            if count == 0:
                p.grad = None

    # ------------------------------------------------------------------ communication hooks
    def _register_hook(self, hook) -> None:
        """Reduce each bucket with ``hook(bucket, process_group, recorder) -> Future`` (or its name in
        ``comm_hooks.COMM_HOOKS``) instead of an all-reduce; once, before training."""
        if not self.buckets:
            raise TypeError(f"{type(self).__name__} has no buckets to hook; use BucketedDDP or OverlappedDDP")
        if isinstance(hook, str):
            hook = comm_hook_by_name(hook)
        if not callable(hook):
            raise TypeError(f"a comm hook must be callable, got {type(hook).__name__}")
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once (as torch's)")
        self._comm_hook = hook

    # ------------------------------------------------------------------ uneven inputs: Join
    # torch's protocol: every step a rank still training all-reduces a 1 (``notify_join_context``),
    # which the finished ranks match with a 0; then ``main_hook`` repeats the step's collectives with
    # zeros there, so gradients are summed over the ranks training, divided by the initial N.
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """torch DDP's ``model.join()``: ranks may run out of batches; gradients summed over those still
        training, divided by the initial world size (torch's default; the other is refused)."""
        if not divide_by_initial_world_size:
            raise ValueError(f"{type(self).__name__}.join: only divide_by_initial_world_size=True (torch's "
                             "default): the gradients are pre-divided by the initial world size")
        return Join([self], enable=enable, throw_on_early_termination=throw_on_early_termination)

    def _tell_finished_ranks(self) -> None:
        work = Join.notify_join_context(self)
        if work is not None:
            work.wait()
        # ... and whether this step synchronises (inside no_sync() it does not): finished ranks add 0
        flag = torch.tensor([1 if self._require_sync else 0], device=self.join_device)
        dist.all_reduce(flag, group=self.process_group)

    def join_hook(self, **kwargs) -> JoinHook:
        return _ShadowSteps(self)

    @property
    def join_device(self) -> torch.device:
        return self.named_grads[0][1].device if self.named_grads else torch.device("cpu")

    @property
    def join_process_group(self):
        return self.process_group if self.process_group is not None else dist.group.WORLD


class _ShadowSteps(JoinHook):
    """What a rank that ran out of inputs does while the others still train (torch's Join)."""

    def __init__(self, ddp: TorchDDPCompat):
        self.ddp = ddp

    def main_hook(self) -> None:
        """One step of the others: learn whether it syncs, then the same collectives, with zeros."""
        ddp = self.ddp
        flag = torch.zeros(1, dtype=torch.int64, device=ddp.join_device)
        dist.all_reduce(flag, group=ddp.process_group)
        if ddp._sync_buffers_next and ddp._forward_buffers:
            ddp._broadcast_buffers(joined=True)  # the others' forward broadcasts their buffers
        ddp._sync_buffers_next = bool(flag.item())  # ... again next step, if this one synchronises
        if flag.item() == 0:  # the others are inside no_sync(): no gradient collectives
            return
        for _, p in ddp.named_grads:
            p.grad = None     # no gradient here: the sync contributes zeros (and "unused" bits)
        ddp._warned_unused = True  # ... which is expected here, not worth a warning
        ddp._start_step(sync=True)
        ddp.finish_gradient_synchronization()
        for _, p in ddp.named_grads:
            p.grad = None

    def post_hook(self, is_last_joiner: bool) -> None:
        """All finished: copy the last rank's parameters and buffers to the ones that stopped early."""
        ddp = self.ddp
        rank = dist.get_rank(ddp.process_group)
        last = torch.tensor([rank if is_last_joiner else -1], device=ddp.join_device)
        dist.all_reduce(last, op=dist.ReduceOp.MAX, group=ddp.process_group)
        src = int(last.item())
        src = dist.get_global_rank(ddp.process_group, src) if ddp.process_group is not None else src
        with torch.no_grad():
            for t in list(ddp.module.parameters()) + list(ddp.module.buffers()):
                dist.broadcast(t.data, src=src, group=ddp.process_group)
