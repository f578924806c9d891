"""DDPModule: what the DDP wrappers (naive, bucketed, overlapped; ZeRO-1 and ZeRO-2) share.

Construction (checks, rank 0's parameters and buffers broadcast, the list of gradients to
reduce, the buckets when bucketed), ``forward``, ``no_sync()`` and the "does this backward need
a sync?" flag. Each strategy file only adds how it reduces gradients. Besides, three things
torch's DDP has (``docs/papers.md``, DDP section), each small:

- ``find_unused_parameters`` (the DDP paper, section 3.2.3): which parameters got a gradient on
  *some* rank is one more all-reduce per step, of a bitmap; a parameter no rank has a gradient
  for keeps ``.grad`` None, as in one process (else momentum and weight decay would move it).
- uneven inputs: torch's ``Join`` protocol (``Joinable``), so that
  ``with torch.distributed.algorithms.Join([model]):`` lets a rank run out of batches early:
  it then shadows the others' collectives with zeros instead of leaving them waiting.
- ``register_comm_hook``: replace how a bucket is reduced (``comm_hooks.py``: fp16, bf16).
"""
from __future__ import annotations

import functools
import warnings
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms import Join, Joinable, JoinHook

from ddpkit.rankside import recorder as rank_recorder
from ddpkit.strategies._common import clip_grad_norm_, no_sync, prepare_module, unique_named_parameters
from ddpkit.strategies.buckets import Bucket, bucket_cap_bytes, layout, make_buckets


class DDPModule(nn.Module, Joinable):
    """What every DDP-style wrapper shares: construction, forward, no_sync, full_state_dict.

    A subclass implements ``_sync_gradients()`` (average every gradient across ranks). With
    ``bucketed=True`` construction also builds ``self.buckets`` (``buckets.make_buckets``).

    When does a backward need a sync? As in torch DDP (``require_backward_grad_sync``), the
    *forward* decides: a forward run with gradients enabled outside ``no_sync()`` marks a sync
    as pending; ``finish_gradient_synchronization()`` does it once and clears the mark, so a
    second call is a no-op. A forward inside ``no_sync()`` leaves gradients to accumulate
    locally; the next forward outside it syncs the sum. So: run the forward through the
    wrapper (``model(x)``, not ``model.module(x)``), one backward per forward.

    A gradient missing on a rank (its parameter not used in this rank's forward) is reduced as
    zeros, so every rank still issues the same collectives (torch's DDP instead raises at the next
    step unless ``find_unused_parameters=True``). The average is then right for a parameter used
    on *some* rank. One used on *no* rank would get a zero ``.grad`` where one process has None:
    with ``find_unused_parameters=True`` it keeps None; without, a warning names it once.
    """

    def __init__(self, module: nn.Module, process_group=None, recorder=None, *, bucketed: bool = False,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 first_bucket_mb: float | None = None, gradient_as_bucket_view: bool = False):
        if bucketed:  # a bad cap fails before any communication
            bucket_cap_mb, first_bucket_mb = layout(bucket_cap_mb, first_bucket_mb)
            bucket_cap_bytes(bucket_cap_mb)
            if first_bucket_mb is not None:
                bucket_cap_bytes(first_bucket_mb)
        super().__init__()
        Joinable.__init__(self)
        prepare_module(type(self).__name__, module, process_group)
        self.module = module
        self.process_group = process_group
        self.recorder = rank_recorder() if recorder is None else recorder  # None: the rank's
        self.world_size = dist.get_world_size(process_group)
        # The gradients to reduce: trainable parameters, tied ones once, in registration order.
        self.named_grads = list(unique_named_parameters(module))
        self.find_unused_parameters = find_unused_parameters
        self._warned_unused = False
        self._require_sync = True   # False inside no_sync()
        self._sync_pending = False  # set by a forward that needs a sync, cleared when done
        self._comm_hook = None      # register_comm_hook: how a bucket is reduced
        if bucketed:  # the flat buckets, in the order they fill (buckets.py)
            self.bucket_cap_mb, self.first_bucket_mb = bucket_cap_mb, first_bucket_mb
            # gradient_as_bucket_view, torch DDP's option: each .grad becomes its bucket slot, so no
            # second copy of the gradients is held and nothing is copied out; with
            # zero_grad(set_to_none=False) (the gradients stay views) nothing is copied in either
            self.gradient_as_bucket_view = gradient_as_bucket_view
            self.buckets = make_buckets(self.named_grads, bucket_cap_mb, first_bucket_mb=first_bucket_mb,
                                        bucket=functools.partial(Bucket, grads_as_views=gradient_as_bucket_view))

    def _record_fill_order(self) -> None:
        """Hooks only to *record* when each gradient becomes ready (the bucket fill order), for a
        wrapper that reduces after backward (BucketedDDP, ZeRO1); recording off: no hooks."""
        if self.recorder.enabled:
            self._hook_every_gradient(self._note_ready)

    def _note_ready(self, bucket, j: int) -> None:
        self.recorder.grad_ready(bucket.names[j], bucket=bucket.index)

    def _hook_every_gradient(self, method) -> None:
        """Call ``method(bucket, j)`` each time gradient j of a bucket lands in ``.grad`` (a
        post-accumulate-grad hook on each parameter).

        The hooks reach this wrapper through a weak reference. torch keeps a parameter's hooks in
        its C++ autograd data, where Python's garbage collector cannot follow them: a hook holding
        the wrapper made wrapper -> model -> parameter -> hook -> wrapper a cycle nothing frees, so
        a Cluster's rank kept every run's model and buckets (on a GPU: the allocator's figures
        grew run by run). A hook whose wrapper is gone does nothing."""
        owner, name = weakref.ref(self), method.__name__
        for i, bucket in enumerate(self.buckets):
            for j, p in enumerate(bucket.params):
                p.register_post_accumulate_grad_hook(functools.partial(_call_owner, owner, name, i, j))

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():  # an eval forward under torch.no_grad() changes nothing
            self.recorder.begin_forward()  # a training forward begins a step, unless the loop began it
            if self._join_config.enable:
                self._tell_finished_ranks()
            self._start_step(sync=self._require_sync)
        return self.module(*args, **kwargs)

    def _start_step(self, sync: bool) -> None:
        """Called by each training forward; subclasses reset per-step state here."""
        self._sync_pending = sync

    def finish_gradient_synchronization(self) -> None:
        """Block until every gradient is averaged across ranks; a no-op if already done."""
        if self._sync_pending:
            self._sync_gradients()
            self._sync_pending = False

    def _sync_gradients(self) -> None:
        raise NotImplementedError

    no_sync = no_sync

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Finish the gradients' sync, then clip them to ``max_norm`` as one process would (every
        rank holds the whole averaged gradient); returns the total norm."""
        self.finish_gradient_synchronization()
        return clip_grad_norm_(self.module.parameters(), max_norm, norm_type)

    def full_state_dict(self) -> dict:
        """{parameter name: tensor}: every rank holds the full model, so just detached clones."""
        return {name: p.detach().clone() for name, p in self.module.named_parameters()}

    buckets: tuple = ()  # bucketed wrappers set their list of ``buckets.Bucket``

    def comm_buffer_bytes(self) -> int:
        """Bytes of communication buffers this wrapper holds: its flat buckets, if any, less the
        slots that are gradients now (``gradient_as_bucket_view``: counted as gradients)."""
        return sum(b.buffer_bytes() for b in self.buckets)

    # ------------------------------------------------------------------ unused parameters
    def _has_grad(self) -> list[bool]:
        """Which gradients this rank has now (before a sync fills the missing ones with zeros)."""
        return [p.grad is not None for _, p in self.named_grads]

    @torch.no_grad()
    def _settle_unused(self, has_grad: list[bool]) -> None:
        """After the gradients were reduced. With ``find_unused_parameters``: one all-reduce of the
        bitmap ``has_grad`` (int32, one per gradient), and a parameter no rank had a gradient for
        gets ``.grad`` None back, as one process leaves it. Without: warn once if some is missing."""
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
    def register_comm_hook(self, hook) -> None:
        """Reduce each bucket with ``hook(bucket, process_group, recorder) -> Future`` instead of
        an all-reduce (``comm_hooks.py``: e.g. ``fp16_compress_hook``). Once, before training."""
        if not self.buckets:
            raise TypeError(f"{type(self).__name__} has no buckets to hook; use BucketedDDP or OverlappedDDP")
        if not callable(hook):
            raise TypeError(f"a comm hook must be callable, got {type(hook).__name__}")
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once (as torch's)")
        self._comm_hook = hook

    # ------------------------------------------------------------------ uneven inputs: Join
    # torch's protocol (torch.distributed.algorithms.Join): every step, a rank still training
    # all-reduces a 1 (``notify_join_context``), which the finished ranks' Join loop matches with
    # a 0 and so learns that a step is coming; then ``main_hook`` below repeats that step's
    # collectives with zeros on the finished ranks. The gradients are therefore summed over the
    # ranks still training and divided by the *initial* world size, as torch's DDP does by default.
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

    def __init__(self, ddp: DDPModule):
        self.ddp = ddp

    def main_hook(self) -> None:
        """One step of the others: learn whether it syncs, then the same collectives, with zeros."""
        ddp = self.ddp
        flag = torch.zeros(1, dtype=torch.int64, device=ddp.join_device)
        dist.all_reduce(flag, group=ddp.process_group)
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
        """Every rank has finished. The ones that finished early stopped stepping: copy the
        parameters and buffers of the last rank to finish (agreed with one all-reduce MAX)."""
        ddp = self.ddp
        rank = dist.get_rank(ddp.process_group)
        last = torch.tensor([rank if is_last_joiner else -1], device=ddp.join_device)
        dist.all_reduce(last, op=dist.ReduceOp.MAX, group=ddp.process_group)
        src = int(last.item())
        src = dist.get_global_rank(ddp.process_group, src) if ddp.process_group is not None else src
        with torch.no_grad():
            for t in list(ddp.module.parameters()) + list(ddp.module.buffers()):
                dist.broadcast(t.data, src=src, group=ddp.process_group)


def _call_owner(owner, method: str, i: int, j: int, _param) -> None:
    """A gradient hook of ``DDPModule._hook_every_gradient``: ``method`` of the wrapper, if it lives."""
    wrapper = owner()
    if wrapper is not None:
        getattr(wrapper, method)(wrapper.buckets[i], j)
