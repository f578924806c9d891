"""ZeRO1: the ZeRO paper's stage 1: reduce-scatter the gradients, step 1/N, all-gather the parameters.

One idea more than ``BucketedDDP``: an all-reduce is a reduce-scatter then an all-gather, and after
the reduce-scatter rank r holds the *averaged* gradient of its 1/N. Keep optimizer state for those
elements only, step them there, and all-gather the updated *parameters* instead:

    DDP:    all-reduce grads  (2(N-1)/N * S)                  -> every rank steps everything
    ZeRO-1: reduce-scatter grads ((N-1)/N * S) -> rank r steps its 1/N -> all-gather parameters ((N-1)/N * S)

DDP's bytes (ZeRO paper 7.2.1), optimizer state 1/N per rank. The buffers are ``zero_buckets.py``'s;
a step post-hook all-gathers the flat parameters, which *are* the module's. ``.grad`` views the
buckets (only this rank's shard holds the average); accumulate with ``no_sync()``. A parameter no
rank used gets a zero gradient, so momentum still moves it, as FSDP's.
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
        """0: the flat gradients are the module's ``.grad``; the reduce-scatter's output is transient."""
        return 0
