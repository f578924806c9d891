"""ZeRO2: stage 2: gradients reduce-scattered in buckets *during* backward, full gradients freed.

One idea more than ``ZeRO1``: each rank only uses its shard's averaged gradient, so, as
``OverlappedDDP`` does, launch each bucket's reduce-scatter from the hooks once it is complete, and
free its full gradient once reduced: what stays is 1/N of the model's gradients.

    per parameter, when its gradient lands in .grad (the hook):
        copy it, scaled by 1/N, into its bucket's flat gradient; free .grad
        a bucket complete? launch its async reduce-scatter (buckets strictly in order)
        a reduce-scatter done? keep our shard of the sum (the average), free the flat gradient
    end of backward: launch what is left, wait for every bucket
    optimizer.step(): step our shards (1/N of the optimizer state), then all-gather the parameters

Gradient memory: 1/N of the model's plus the buckets in flight; ``.grad`` is None after backward.
Rules as ``OverlappedDDP``'s; inside ``no_sync()`` full gradients accumulate in ``.grad``. The
optimizer must be elementwise.
"""
from __future__ import annotations

import torch
from torch import nn

from ddpkit.strategies.buckets import InOrder
from ddpkit.strategies.zero_buckets import ZeroDDPModule


class ZeRO2(ZeroDDPModule):
    """Buckets reduce-scattered from gradient hooks, full gradients freed; the step as ZeRO-1's."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = None, process_group=None, recorder=None,
                 **torch_ddp):
        super().__init__(module, bucket_cap_mb, process_group, recorder, **torch_ddp)  # the sharded buckets
        for bucket in self.buckets:
            bucket.free_gradient()  # allocated when the bucket's first gradient arrives
        self._hook_every_gradient()  # _grad_ready_hook below

    def _start_step(self, sync: bool) -> None:
        super()._start_step(sync)
        # which bucket is launched next this step, in bucket order (as OverlappedDDP's: buckets.InOrder)
        self._in_order = InOrder(self.buckets)
        self._next_done = 0  # the next launched bucket whose reduce-scatter we collect

    # ------------------------------------------------------------------ backward: reduce-scatter
    def _grad_ready_hook(self, i: int, j: int) -> None:
        """Gradient j of bucket i is in ``.grad``: copy it in, free it, launch complete buckets."""
        super()._grad_ready_hook(i, j)  # recorded; in a backward that syncs, the end of backward queued
        if not self._sync_pending:  # inside no_sync(): the gradient accumulates in .grad
            return
        # .grad / N into the bucket's flat gradient, and .grad freed (ZeroBucket.copy_in)
        self._in_order.copy_in(self.buckets[i], j, 1.0 / self.world_size)
        with torch.no_grad():
            # every complete bucket, in bucket order from the next one due: async, so
            # autograd goes on computing earlier layers' gradients while this one travels
            for due in self._in_order.due():
                due.reduce_scatter(self.process_group, self.recorder)
            self._collect_finished(block=False)  # free what is already reduced

    def _collect_finished(self, block: bool) -> None:
        """Launched buckets, in order, whose reduce-scatter is done (all if ``block``): our shard kept as
        its gradient, the flat gradient freed."""
        while self._next_done < self._in_order.launched:
            bucket = self.buckets[self._next_done]
            if not block and not bucket.work.is_completed():
                return
            bucket.work.wait()
            if bucket.shard.grad is None:
                bucket.shard.grad = bucket.out
            else:  # a second synchronised backward without zero_grad(): accumulate, as torch does
                bucket.shard.grad += bucket.out
            bucket.free_gradient()
            bucket.out = None
            self._next_done += 1

    @torch.no_grad()
    def _sync_gradients(self) -> None:
        # the end of backward (queued by the first hook), or an explicit
        # finish_gradient_synchronization() when no hook fired at all: zeros, or what no_sync()
        # accumulated, for a gradient that never arrived; launch the rest; wait for every bucket
        self._in_order.complete_the_rest(1.0 / self.world_size)
        for due in self._in_order.due():
            due.reduce_scatter(self.process_group, self.recorder)
        self._collect_finished(block=True)

    def comm_buffer_bytes(self) -> int:
        """Bytes of flat gradients held right now (only while buckets are being reduced)."""
        return sum(b.gradient_bytes for b in self.buckets)
