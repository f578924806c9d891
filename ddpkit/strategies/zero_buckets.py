"""Sharded buckets and the sharded step: what ZeRO-1 and ZeRO-2 (``zero1.py``, ``zero2.py``) share.

A ZeRO bucket is a DDP bucket (``make_buckets``' rule) whose flat buffers are padded to a multiple
of N (``FlatLayout``), so one reduce-scatter or all-gather cuts them into N shards of s elements:

    flat_param  (N*s,)  the bucket's parameters end to end; the module's parameters view it, so an
                        all-gather into it updates the model.
    shard       (s,)    an ``nn.Parameter`` viewing flat_param[r*s:(r+1)*s]: what this rank steps.
    gradient    (N*s,)  the gradients times 1/N, reduce-scattered: rank r keeps its shard's average
                        (ZeRO-1 keeps it as the module's ``.grad``; ZeRO-2 frees it once reduced).

Slices of a flat buffer need an *elementwise* optimizer: ``check_elementwise`` refuses the others.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.strategies.common import clip_grad_norm_
from ddpkit.strategies.buckets import layout, make_buckets
from ddpkit.strategies.ddp_compat import TorchDDPCompat
from ddpkit.strategies.ddp_module import DDPModule
from ddpkit.strategies.flat_layout import FlatLayout, alloc_storage, free_storage, held_bytes, is_allocated
from ddpkit.torch_internals import all_gather_flat, reduce_scatter_flat

# Optimizers whose update of an element reads only its gradient and state, so stepping a slice of a
# flat buffer equals stepping the whole tensors (not: LBFGS, Adafactor, Muon, SparseAdam).
ELEMENTWISE_OPTIMIZERS = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adagrad", "Adamax", "Adadelta", "NAdam", "RAdam", "RMSprop", "Rprop", "ASGD"))


def check_elementwise(strategy: str, optimizer_cls) -> None:
    """ValueError unless ``optimizer_cls`` is (a subclass of) an elementwise torch optimizer."""
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, ELEMENTWISE_OPTIMIZERS)):
        name = getattr(optimizer_cls, "__name__", repr(optimizer_cls))
        raise ValueError(
            f"{strategy} cannot shard {name}: it steps slices of flat buffers (1/N of the elements "
            f"per rank), which only equals stepping whole tensors for an elementwise optimizer "
            f"({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}). For an optimizer that "
            "needs whole parameters use ddpkit.ShardedOptimizer (strategy 'sharded_optimizer').")


class ZeroBucket:
    """One bucket of parameters, flattened and padded to N shards; rank r owns shard r."""

    def __init__(self, index: int, named_params: list, rank: int, world_size: int):
        self.index = index
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        self.layout = FlatLayout.of(self.params, world_size, rank)  # offsets, padding, our shard
        first = self.params[0]
        self.flat_param = self.layout.pack(self.params, self.layout.empty(first.dtype, first.device))
        with torch.no_grad():
            for p, view in zip(self.params, self.layout.views(self.flat_param), strict=True):
                p.data = view  # the module now reads the flat buffer
        self.shard = nn.Parameter(self.layout.shard(self.flat_param))  # a view: stepping it updates p
        self.gradient = self.layout.zeros(first.dtype, first.device)
        self.reset()

    def reset(self) -> None:
        """A new step: every gradient missing, nothing launched."""
        self.ready = [False] * len(self.params)
        self.missing = len(self.params)
        self.work = self.out = None

    def slot(self, j: int) -> torch.Tensor:
        """Gradient j's place in the flat gradient, shaped like its parameter."""
        return self.layout.view(self.gradient, j)

    def copy_in(self, j: int, scale: float) -> None:
        """ZeRO-2: gradient j times ``scale`` into the flat gradient (allocated with the first), ``.grad`` freed."""
        self.alloc_gradient()
        p = self.params[j]
        if p.grad is not None:
            torch.mul(p.grad.detach(), scale, out=self.slot(j))
            p.grad = None
        self.ready[j] = True
        self.missing -= 1

    # ZeRO-2 holds the flat gradient only while the bucket is being reduced
    def alloc_gradient(self) -> None:
        if not is_allocated(self.gradient):
            alloc_storage(self.gradient)
            self.gradient.zero_()  # the padding, and the slots of parameters without a gradient

    def free_gradient(self) -> None:
        free_storage(self.gradient)

    @property
    def gradient_bytes(self) -> int:
        return held_bytes(self.gradient)

    def reduce_scatter(self, group, recorder) -> None:
        """Launch the async reduce-scatter (SUM) of the pre-scaled flat gradient: ``self.out`` is our average."""
        self.out = torch.empty(self.layout.shard_numel, dtype=self.gradient.dtype, device=self.gradient.device)
        with recorder.labels(bucket=self.index):
            self.work = reduce_scatter_flat(self.out, self.gradient, group=group, async_op=True)

    def all_gather(self, group, recorder):
        """Launch the async all-gather of every rank's stepped shard into flat_param, in place; the handle."""
        with recorder.labels(bucket=self.index):
            return all_gather_flat(self.flat_param, self.shard.detach(), group=group, async_op=True)


class ZeroDDPModule(TorchDDPCompat, DDPModule):
    """What ZeRO-1 and ZeRO-2 share: sharded buckets, the optimizer over the shards, the all-gather after
    each step; they differ in when gradients are reduce-scattered."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = None, process_group=None, recorder=None,
                 **torch_ddp):
        # torch_ddp: torch DDP's placement and buffer arguments (device_ids, broadcast_buffers, ...)
        for name in ("find_unused_parameters", "gradient_as_bucket_view"):
            if torch_ddp.pop(name, False):
                raise ValueError(f"{type(self).__name__}: {name}=True is not an option here: the gradients always "
                                 "live in the flat buckets, and an unused parameter's elements are reduced as zeros")
        super().__init__(module, process_group, recorder, torch_ddp=torch_ddp)  # checks, rank 0's values everywhere
        self.rank = dist.get_rank(process_group)
        self.bucket_cap_mb, self.first_bucket_mb = layout(bucket_cap_mb)
        # DDP's buckets (the same rule), each a ZeroBucket: padded to N shards, ours is shard r
        self.buckets = make_buckets(self.named_grads, bucket_cap_mb,
                                    lambda i, params: ZeroBucket(i, params, self.rank, self.world_size))

    def join_hook(self, **kwargs):
        """Refused: a finished rank would also have to step and all-gather its shard."""
        raise ValueError(f"{type(self).__name__} does not support Join (uneven inputs): give every rank "
                         "the same number of batches, or use BucketedDDP/OverlappedDDP (+ ShardedOptimizer)")

    def _register_hook(self, hook) -> None:
        """Not here: the buckets are reduce-scattered, and a hook reduces a bucket (all-reduce)."""
        raise TypeError(f"{type(self).__name__} reduce-scatters its buckets; a comm hook replaces an all-reduce: "
                        "use BucketedDDP or OverlappedDDP")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Finish the sync, then clip by the whole gradient's norm, combined across the ranks' shards."""
        self.finish_gradient_synchronization()
        return clip_grad_norm_([b.shard for b in self.buckets], max_norm, norm_type, sharded=True,
                               group=self.process_group, recorder=self.recorder)

    # ------------------------------------------------------------------ the step: 1/N, then all-gather
    def make_optimizer(self, optimizer_cls, **defaults) -> torch.optim.Optimizer:
        """``optimizer_cls`` over this rank's shards (elementwise only), all-gathering after each ``step()``."""
        check_elementwise(type(self).__name__, optimizer_cls)
        optimizer = optimizer_cls([b.shard for b in self.buckets], **defaults)
        optimizer.register_step_post_hook(lambda *_: self._all_gather_parameters())
        return optimizer

    @torch.no_grad()
    def _all_gather_parameters(self) -> None:
        # every rank's updated shard into the flat parameters in place, all buckets launched first
        works = [bucket.all_gather(self.process_group, self.recorder) for bucket in self.buckets]
        for work in works:
            work.wait()
