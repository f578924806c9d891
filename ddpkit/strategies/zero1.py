"""ZeRO1: the ZeRO paper's stage 1: reduce-scatter the gradients, step 1/N, all-gather the parameters.

One idea more than ``BucketedDDP``: an all-reduce is a reduce-scatter followed by an all-gather,
and after the reduce-scatter rank r already holds the *averaged* gradient of its 1/N of the
elements. If rank r keeps optimizer state only for those elements, it can step them right there,
and the all-gather then shares the updated *parameters* instead of the gradients:

    DDP:    all-reduce grads  (2(N-1)/N * S)                  -> every rank steps everything
    ZeRO-1: reduce-scatter grads ((N-1)/N * S) -> rank r steps its 1/N -> all-gather parameters ((N-1)/N * S)

Same bytes as DDP (the ZeRO paper, section 7.2.1: P_os "incurs no additional communication"), and
the optimizer state is 1/N per rank. Compare ``sharded_optimizer`` (ShardedOptimizer over DDP),
which keeps DDP's all-reduce and adds the all-gather: 1.5x the bytes for the same memory.

How (``zero_buckets.py`` has the buffers): the gradients are packed into DDP-style buckets, each
one flat buffer padded to a multiple of N; the module's parameters are re-pointed into a flat
parameter buffer of the same layout. After backward (as in ``BucketedDDP``) each bucket's flat
gradient is scaled by 1/N and reduce-scattered; rank r's result is the gradient of its shard, which
the optimizer (``make_optimizer``) steps; a step post-hook then all-gathers every bucket's flat
parameter, which *is* the module's parameters.

Gradients stay whole (stage 1 shards only the optimizer state): the module's ``.grad`` are views
into the buckets' flat gradients (as torch DDP's ``gradient_as_bucket_view``: no extra copy, no
extra memory). After the reduce-scatter only this rank's shard of that buffer holds the average
(``shard.grad``, a view of it); the rest still holds this rank's own gradients / N. The first
forward after a synchronised backward starts the gradients from zero (the step has used them);
accumulate over micro-batches with ``no_sync()``.

A parameter no rank used in a step gets a zero gradient here (its elements share flat shards with
the others), so momentum or weight decay still move it, unlike one process; FSDP's flat parameters
do the same. The DDP wrappers' ``find_unused_parameters=True`` leaves it untouched.
"""
from __future__ import annotations

import torch
from torch import nn

from ddpkit.strategies.zero_buckets import ZeroDDPModule


class ZeRO1(ZeroDDPModule):
    """Buckets reduce-scattered after backward; the optimizer steps 1/N; parameters all-gathered."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = None, process_group=None, recorder=None,
                 **torch_ddp):
        super().__init__(module, bucket_cap_mb, process_group, recorder, **torch_ddp)  # the sharded buckets
        self._reduced = False  # a synchronised backward has used the gradients
        self._hook_every_gradient()  # as BucketedDDP: fill order recorded, reduced at the end of backward

    def _start_step(self, sync: bool) -> None:
        super()._start_step(sync)
        if self._reduced:  # the last step's gradients are used up: start again from zero
            for bucket in self.buckets:
                bucket.gradient.zero_()
            self._reduced = False

    # ------------------------------------------------------------------ gradients: reduce-scatter
    @torch.no_grad()
    def _sync_gradients(self) -> None:
        for bucket in self.buckets:
            for j, p in enumerate(bucket.params):
                slot = bucket.slot(j)
                if p.grad is None:  # unused in this step: zeros (see the docstring)
                    slot.zero_()
                elif p.grad.data_ptr() != slot.data_ptr():  # the first step, or after zero_grad()
                    slot.copy_(p.grad)
                p.grad = slot       # from now on backward accumulates straight into the bucket
            bucket.gradient.mul_(1.0 / self.world_size)  # divide before the SUM, as DDP does
            bucket.reduce_scatter(self.process_group, self.recorder)  # async: the next bucket
        for bucket in self.buckets:                                   # is packed meanwhile
            bucket.work.wait()
            mine = bucket.layout.shard(bucket.gradient)
            mine.copy_(bucket.out)  # our shard of the flat gradient now holds the average
            bucket.shard.grad = mine
            bucket.out = None
        self._reduced = True

    def comm_buffer_bytes(self) -> int:
        """0: the flat gradients are the module's ``.grad`` (counted as gradients), and the
        reduce-scatter's output lives only during the synchronisation."""
        return 0
