"""DDPModule: the core every DDP wrapper shares (naive, bucketed, overlapped; ZeRO-1 and ZeRO-2).

Top to bottom: construction (rank 0's state broadcast, the gradients, the buckets), the forward,
the "does this backward sync?" flag, and a hook on every gradient that queues the sync at the end
of backward. A strategy adds ``_sync_gradients`` (and overlapped its hook); torch DDP's extras are
``ddp_compat.TorchDDPCompat``, not needed for a step.
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.strategies.buckets import Bucket, layout, make_buckets
from ddpkit.strategies.common import clip_grad_norm_, forward_timed, no_sync, prepare_module, unique_named_parameters
from ddpkit.torch_internals import queue_at_end_of_backward
from ddpkit.trace.seam import recorder as rank_recorder


class DDPModule(nn.Module):
    """Construction, forward, ``no_sync()``, and the sync at the end of every backward that needs one.

    As in torch's DDP the *forward* decides: one with gradients enabled outside ``no_sync()`` marks
    a sync pending, which the first gradient of its backward queues at the end of backward. So: the
    forward through the wrapper, one backward per forward, micro-batches but the last in ``no_sync()``.
    """

    buckets: tuple = ()  # a bucketed wrapper's ``buckets.Bucket`` list, in the order they fill

    def __init__(self, module: nn.Module, process_group=None, recorder=None, *, bucketed: bool = False,
                 bucket_cap_mb: float | None = None, first_bucket_mb: float | None = None,
                 gradient_as_bucket_view: bool = False, broadcast: tuple[bool, bool] = (True, True)):
        if bucketed:  # a bad cap fails before any communication
            bucket_cap_mb, first_bucket_mb = layout(bucket_cap_mb, first_bucket_mb)
        super().__init__()
        # checks, then rank 0's (parameters, buffers) to every rank: the replicas start equal
        prepare_module(type(self).__name__, module, process_group, *broadcast)
        self.module, self.process_group = module, process_group
        self.recorder = rank_recorder() if recorder is None else recorder  # None: the rank's (off unless recording)
        self.world_size = dist.get_world_size(process_group)
        # the gradients to reduce: trainable parameters, tied ones once, in registration order
        self.named_grads = list(unique_named_parameters(module))
        self._require_sync = True   # False inside no_sync()
        self._sync_pending = False  # set by a forward that needs a sync, cleared when it is done
        self._synced = False        # this step's sync is done (a gradient arriving now is an error)
        self._end_queued = False    # this step's sync is queued at the end of its backward
        if bucketed:  # the flat buckets, in the order they fill (buckets.py)
            self.bucket_cap_mb, self.first_bucket_mb = bucket_cap_mb, first_bucket_mb
            # gradient_as_bucket_view (torch's option): each .grad becomes its bucket slot, no second copy
            self.gradient_as_bucket_view = gradient_as_bucket_view
            self.buckets = make_buckets(self.named_grads, bucket_cap_mb, first_bucket_mb=first_bucket_mb,
                                        bucket=functools.partial(Bucket, grads_as_views=gradient_as_bucket_view))

    # ------------------------------------------------------------------ forward: is a sync pending?
    def forward(self, *args, **kwargs):
        training = torch.is_grad_enabled()  # an eval forward (under torch.no_grad()) syncs no gradient
        if training:
            self.recorder.begin_forward()  # a training forward begins a step, unless the loop began it
            self._start_step(sync=self._require_sync)
        args, kwargs = self._before_forward(training, args, kwargs)
        if not training:
            return self.module(*args, **kwargs)
        return forward_timed(self.recorder, self.module, args, kwargs)  # a loop of its own: timed here

    def _before_forward(self, training: bool, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """What torch's DDP also does before the module's forward (Join, buffers, ``device_ids``:
        ``TorchDDPCompat``); nothing in the core."""
        return args, kwargs

    def _start_step(self, sync: bool) -> None:
        """Each training forward: does its backward sync? Subclasses reset their per-step state here."""
        self._sync_pending = sync
        self._synced = False       # this step's sync has not run yet
        self._end_queued = False   # nor been queued at the end of its backward

    no_sync = no_sync  # gradients of forwards inside it accumulate locally (common.no_sync)

    # ------------------------------------------------------------------ backward: the hooks, the end
    def _hook_every_gradient(self) -> None:
        """``self._grad_ready_hook(i, j)`` each time gradient j of bucket i (``(k,)`` without buckets)
        lands in ``.grad``, through a weak reference: torch keeps hooks in C++, where the garbage
        collector cannot see the cycle wrapper -> parameter -> hook -> wrapper."""
        owner = weakref.ref(self)
        if self.buckets:
            places = [(p, (i, j)) for i, bucket in enumerate(self.buckets) for j, p in enumerate(bucket.params)]
        else:
            places = [(p, (k,)) for k, (_, p) in enumerate(self.named_grads)]
        for p, where in places:
            p.register_post_accumulate_grad_hook(functools.partial(_call_owner, owner, where))

    def _grad_ready_hook(self, i: int, j: int | None = None) -> None:
        """A gradient landed: record it (the fill order); in a backward that syncs, queue
        ``finish_gradient_synchronization`` at its end, once (all naive, bucketed, ZeRO-1 need)."""
        if self.recorder.enabled:
            self.recorder.grad_ready(self._grad_name(i, j), bucket=i)  # naive: its "bucket" is the parameter
        if self._synced:
            self._refuse_late_gradient(self._grad_name(i, j))
        if self._sync_pending and not self._end_queued:
            self._end_queued = queue_at_end_of_backward(self.finish_gradient_synchronization)

    def _grad_name(self, i: int, j: int | None) -> str:
        return self.buckets[i].names[j] if self.buckets else self.named_grads[i][0]

    def _refuse_late_gradient(self, name: str) -> None:
        """A gradient after this step's sync would stay local on this rank (torch's DDP refuses it too)."""
        raise RuntimeError(
            f"{type(self).__name__}: the gradient of {name!r} arrived after this step's gradients were "
            "already averaged across ranks: a second backward after one forward, or a backward through a "
            "forward that bypassed the wrapper (model.module(x)). Run each backward on its own forward "
            "through the wrapper; to accumulate micro-batches, run all but the last inside no_sync().")

    def finish_gradient_synchronization(self) -> None:
        """Block until every gradient is averaged across ranks; a no-op if already done."""
        if self._sync_pending:
            self._sync_gradients()
            self._sync_pending = False
            self._synced = True

    def _sync_gradients(self) -> None:
        raise NotImplementedError  # each strategy's: average every gradient across the ranks

    # ------------------------------------------------------------------ what instruments ask of every wrapper
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Finish the sync, then clip as one process would (every rank holds the whole averaged
        gradient); returns the total norm."""
        self.finish_gradient_synchronization()
        return clip_grad_norm_(self.module.parameters(), max_norm, norm_type)

    def full_state_dict(self) -> dict:
        """{parameter name: tensor}: every rank holds the full model, so just detached clones."""
        return {name: p.detach().clone() for name, p in self.module.named_parameters()}

    def comm_buffer_bytes(self) -> int:
        """Bytes of the flat buckets, less the slots that are gradients now (``gradient_as_bucket_view``)."""
        return sum(b.buffer_bytes() for b in self.buckets)


def _call_owner(owner, where: tuple, _param) -> None:
    """A gradient hook of ``DDPModule._hook_every_gradient``: the wrapper's hook, if the wrapper lives."""
    wrapper = owner()
    if wrapper is not None:
        wrapper._grad_ready_hook(*where)
