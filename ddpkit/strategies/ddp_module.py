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
- a communication hook: replace how a bucket is reduced (``comm_hooks.py``: fp16, bf16), given by
  name at construction (``comm_hook="bf16_compress"``) or registered as torch's (``register_comm_hook``).
"""
from __future__ import annotations

import functools
import warnings
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms import Join, Joinable, JoinHook

from ddpkit.strategies.common import (clip_grad_norm_, forward_timed, no_sync, prepare_module,
                                     unique_named_parameters)
from ddpkit.strategies.buckets import Bucket, bucket_cap_bytes, layout, make_buckets
from ddpkit.strategies.comm_hooks import comm_hook as comm_hook_by_name
from ddpkit.strategies.torch_ddp_args import TorchDDPArgs, group_of
from ddpkit.torch_internals import queue_at_end_of_backward, tensors_to
from ddpkit.trace.seam import recorder as rank_recorder


class DDPModule(nn.Module, Joinable):
    """What every DDP-style wrapper shares: construction, forward, no_sync, full_state_dict.

    A subclass implements ``_sync_gradients()`` (average every gradient across ranks). With
    ``bucketed=True`` construction also builds ``self.buckets`` (``buckets.make_buckets``).

    When does a backward need a sync? As in torch DDP (``require_backward_grad_sync``), the
    *forward* decides: a forward run with gradients enabled outside ``no_sync()`` marks a sync
    as pending; ``finish_gradient_synchronization()`` does it once and clears the mark, so a
    second call is a no-op. Every wrapper makes that call itself at the end of a backward that
    needs it (a callback queued on the autograd engine, as torch's DDP does), so no backward's
    sync is ever skipped, whether or not the training loop calls it. A forward inside
    ``no_sync()`` leaves gradients to accumulate locally; the next forward outside it syncs the
    sum. So: run the forward through the wrapper (``model(x)``, not ``model.module(x)``), one
    backward per forward (a gradient that arrives after the step's sync is a RuntimeError).

    A gradient missing on a rank (its parameter not used in this rank's forward) is reduced as
    zeros, so every rank still issues the same collectives (torch's DDP instead raises at the next
    step unless ``find_unused_parameters=True``). The average is then right for a parameter used
    on *some* rank. One used on *no* rank would get a zero ``.grad`` where one process has None:
    with ``find_unused_parameters=True`` it keeps None; without, a warning names it once.
    """

    def __init__(self, module: nn.Module, process_group=None, recorder=None, *, bucketed: bool = False,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 first_bucket_mb: float | None = None, gradient_as_bucket_view: bool = False,
                 device_mesh=None, comm_hook=None, **torch_ddp):
        strategy = type(self).__name__
        if bucketed:  # a bad cap fails before any communication
            bucket_cap_mb, first_bucket_mb = layout(bucket_cap_mb, first_bucket_mb)
            bucket_cap_bytes(bucket_cap_mb)
            if first_bucket_mb is not None:
                bucket_cap_bytes(first_bucket_mb)
        if not isinstance(module, nn.Module):
            raise TypeError(f"{strategy} wraps an nn.Module, got {type(module).__name__}")
        # torch DDP's other arguments (device_ids, broadcast_buffers, ...), with torch's meaning
        self.torch_args = TorchDDPArgs.parse(strategy, module, **torch_ddp)
        process_group = group_of(strategy, process_group, device_mesh)
        super().__init__()
        Joinable.__init__(self)
        prepare_module(strategy, module, process_group, params=self.torch_args.init_sync,
                       buffers=self.torch_args.init_sync and self.torch_args.init_sync_buffers)
        self.module = module
        self.process_group = process_group
        # broadcast before a forward that follows a synchronising one (torch's forward_sync_buffers)
        self._forward_buffers = list(module.buffers()) if self.torch_args.forward_sync_buffers else []
        self._sync_buffers_next = True
        self.recorder = rank_recorder() if recorder is None else recorder  # None: the rank's
        self.world_size = dist.get_world_size(process_group)
        # The gradients to reduce: trainable parameters, tied ones once, in registration order.
        self.named_grads = list(unique_named_parameters(module))
        self.find_unused_parameters = find_unused_parameters
        self._warned_unused = False
        self._require_sync = True   # False inside no_sync()
        self._sync_pending = False  # set by a forward that needs a sync, cleared when done
        self._synced = False        # the sync of this step is done (a later gradient is an error)
        self._end_queued = False    # the sync is queued at the end of this backward
        self._comm_hook = None      # register_comm_hook: how a bucket is reduced
        if bucketed:  # the flat buckets, in the order they fill (buckets.py)
            self.bucket_cap_mb, self.first_bucket_mb = bucket_cap_mb, first_bucket_mb
            # gradient_as_bucket_view, torch DDP's option: each .grad becomes its bucket slot, so no
            # second copy of the gradients is held and nothing is copied out; with
            # zero_grad(set_to_none=False) (the gradients stay views) nothing is copied in either
            self.gradient_as_bucket_view = gradient_as_bucket_view
            self.buckets = make_buckets(self.named_grads, bucket_cap_mb, first_bucket_mb=first_bucket_mb,
                                        bucket=functools.partial(Bucket, grads_as_views=gradient_as_bucket_view))
        if comm_hook is not None:  # a name in comm_hooks.COMM_HOOKS, or a hook function
            self.register_comm_hook(comm_hook)

    def _sync_at_end_of_backward(self) -> None:
        """For a wrapper that reduces after backward (NaiveDDP, BucketedDDP, ZeRO1): a hook on every
        gradient that records when it became ready (the bucket fill order, when recording) and, in a
        backward that syncs, queues ``finish_gradient_synchronization`` once at the end of backward.

        So ``loss.backward()`` returns with the gradients averaged, as torch's DDP does, and a script
        written for torch's (which never calls ``finish_gradient_synchronization()``) trains the same:
        no rank ever steps on its own gradients. The communication still starts only once autograd is
        done with every gradient; the explicit call stays, and finds nothing left to do."""
        self._hook_every_gradient(self._after_backward_hook)

    def _after_backward_hook(self, i: int, j: int | None = None) -> None:
        if self.recorder.enabled:
            self.recorder.grad_ready(self._grad_name(i, j), bucket=i)  # naive: its "bucket" is the parameter
        if self._synced:
            self._refuse_late_gradient(self._grad_name(i, j))
        if self._sync_pending and not self._end_queued:
            self._end_queued = queue_at_end_of_backward(self.finish_gradient_synchronization)

    def _grad_name(self, i: int, j: int | None) -> str:
        """The name of gradient j of bucket i (gradient i of ``named_grads`` without buckets)."""
        return self.buckets[i].names[j] if self.buckets else self.named_grads[i][0]

    def _refuse_late_gradient(self, name: str) -> None:
        """A gradient arriving after this step's sync (``_synced``) would stay local on this rank: a
        second backward without a forward through the wrapper in between. torch's DDP refuses it too."""
        raise RuntimeError(
            f"{type(self).__name__}: the gradient of {name!r} arrived after this step's gradients were "
            "already averaged across ranks: a second backward after one forward, or a backward through a "
            "forward that bypassed the wrapper (model.module(x)). Run each backward on its own forward "
            "through the wrapper; to accumulate micro-batches, run all but the last inside no_sync().")

    def _hook_every_gradient(self, method) -> None:
        """Call ``method(i, j)`` each time gradient j of bucket i lands in ``.grad`` (``method(k)``
        for gradient k of ``named_grads`` in a wrapper without buckets): a post-accumulate-grad hook
        on each parameter.

        The hooks reach this wrapper through a weak reference, and name buckets by index. torch keeps
        a parameter's hooks in its C++ autograd data, where Python's garbage collector cannot follow
        them: a hook holding the wrapper (or a bucket) made wrapper -> model -> parameter -> hook ->
        wrapper a cycle nothing frees, so a Cluster's rank kept every run's model and buckets (on a
        GPU: the allocator's figures grew run by run). A hook whose wrapper is gone does nothing."""
        owner, name = weakref.ref(self), method.__name__
        if self.buckets:
            places = [(p, (i, j)) for i, bucket in enumerate(self.buckets) for j, p in enumerate(bucket.params)]
        else:
            places = [(p, (k,)) for k, (_, p) in enumerate(self.named_grads)]
        for p, where in places:
            p.register_post_accumulate_grad_hook(functools.partial(_call_owner, owner, name, where))

    def forward(self, *args, **kwargs):
        training = torch.is_grad_enabled()  # an eval forward under torch.no_grad() syncs no gradient
        if training:
            self.recorder.begin_forward()  # a training forward begins a step, unless the loop began it
            if self._join_config.enable:
                self._tell_finished_ranks()
            self._start_step(sync=self._require_sync)
        # rank 0's buffers (BatchNorm's running statistics), as torch's DDP; under Join only in a
        # training forward, the one the ranks that ran out of batches shadow (_ShadowSteps)
        if self._sync_buffers_next and self._forward_buffers and (training or not self._join_config.enable):
            self._broadcast_buffers()
        self._sync_buffers_next = training and self._require_sync
        if self.torch_args.device is not None:  # device_ids: the inputs go to the module's GPU
            args, kwargs = tensors_to((args, kwargs), self.torch_args.device)
        if not training:
            return self.module(*args, **kwargs)
        return forward_timed(self.recorder, self.module, args, kwargs)  # a loop of its own: timed here

    @torch.no_grad()
    def _broadcast_buffers(self, joined: bool = False) -> None:
        """Every buffer from rank 0, or under Join from the highest rank still training (agreed with
        one all-reduce MAX, as torch's DDP: rank 0 may have stopped with stale statistics)."""
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
        """torch DDP's flag, read by the next forward: False lets that step's gradients accumulate
        locally (what ``no_sync()`` sets; nanoGPT sets it by hand on all but the last micro-batch)."""
        return self._require_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._require_sync = bool(value)

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """torch DDP's ``model.join()``: ``with model.join(): ...`` lets ranks run out of batches at
        different steps (the Join protocol below). Gradients are summed over the ranks still training
        and divided by the initial world size, as torch's default; the other division is not here."""
        if not divide_by_initial_world_size:
            raise ValueError(f"{type(self).__name__}.join: only divide_by_initial_world_size=True (torch's "
                             "default): the gradients are pre-divided by the initial world size")
        return Join([self], enable=enable, throw_on_early_termination=throw_on_early_termination)

    def _start_step(self, sync: bool) -> None:
        """Called by each training forward; subclasses reset per-step state here."""
        self._sync_pending = sync
        self._synced = False       # this step's sync has not run yet
        self._end_queued = False   # nor been queued at the end of its backward

    def finish_gradient_synchronization(self) -> None:
        """Block until every gradient is averaged across ranks; a no-op if already done."""
        if self._sync_pending:
            self._sync_gradients()
            self._sync_pending = False
            self._synced = True

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
    def register_comm_hook(self, hook, *torch_form) -> None:
        """Reduce each bucket with ``hook(bucket, process_group, recorder) -> Future`` instead of
        an all-reduce (``comm_hooks.py``: e.g. ``fp16_compress_hook``, or its name in
        ``COMM_HOOKS``, ``"fp16_compress"``). Once, before training. torch's two-argument form,
        ``(state, hook)`` with hook(state, GradBucket), is refused."""
        if torch_form:
            raise TypeError(f"{type(self).__name__}.register_comm_hook takes one ddpkit hook, hook(bucket, group, "
                            "recorder) (ddpkit.strategies.comm_hooks: fp16_compress_hook, bf16_compress_hook), not "
                            "torch's (state, hook) pair")
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


def _call_owner(owner, method: str, where: tuple, _param) -> None:
    """A gradient hook of ``DDPModule._hook_every_gradient``: ``method`` of the wrapper, if it lives."""
    wrapper = owner()
    if wrapper is not None:
        getattr(wrapper, method)(*where)
