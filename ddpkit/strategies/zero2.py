"""ZeRO2: stage 2: gradients reduce-scattered in buckets *during* backward, full gradients freed.

One idea more than ``ZeRO1`` (the same buckets, shards and step): ZeRO-1 still holds every full
gradient until backward ends, although each rank only ever uses the averaged gradient of its own
1/N. So, as ``OverlappedDDP`` does with all-reduce, launch each bucket's reduce-scatter from the
gradient hooks as soon as the bucket is complete, and free the bucket's full gradient as soon as
its reduce-scatter is done: what stays is the gradient of this rank's shard, 1/N of the model's.

    per parameter, when its gradient lands in .grad (the hook):
        copy it, scaled by 1/N, into its bucket's flat gradient; free .grad
        a bucket complete? launch its async reduce-scatter (buckets strictly in order)
        a reduce-scatter done? keep our shard of the sum (the average), free the flat gradient
    end of backward: launch what is left, wait for every bucket
    optimizer.step(): step our shards (1/N of the optimizer state), then all-gather the parameters

Gradient memory per rank: 1/N of the model's (the shards' ``.grad``), plus the buckets in flight
during backward. Bytes: reduce-scatter + all-gather = DDP's all-reduce (ZeRO paper, section
7.2.1; ``docs/papers.md``). The module's ``.grad`` are None after backward.

Rules as in ``OverlappedDDP``: buckets are launched in bucket order; a parameter that got no
gradient contributes zeros (or what ``no_sync()`` accumulated) at the end of backward, and since
its elements share flat shards with others, momentum and weight decay still move it (as FSDP's
flat parameters do); inside ``no_sync()`` the hooks return at once and the full gradients
accumulate in ``.grad`` (DDP's gradient memory until the next synchronised backward); one
backward per forward. The optimizer must be elementwise (``zero_buckets.check_elementwise``).
"""
from __future__ import annotations

import torch
from torch import nn

from ddpkit.strategies.zero_buckets import ZeroBucket, ZeroDDPModule
from ddpkit.torch_internals import queue_at_end_of_backward


class ZeRO2(ZeroDDPModule):
    """Buckets reduce-scattered from gradient hooks, full gradients freed; the step as ZeRO-1's."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, process_group=None, recorder=None):
        super().__init__(module, bucket_cap_mb, process_group, recorder)  # the sharded buckets
        for bucket in self.buckets:
            bucket.free_gradient()  # allocated when the bucket's first gradient arrives
            for j, p in enumerate(bucket.params):
                p.register_post_accumulate_grad_hook(self._grad_ready_hook(bucket, j))
        self._next_bucket = 0     # the next bucket to launch, in bucket order
        self._next_done = 0       # the next launched bucket whose reduce-scatter we collect
        self._end_queued = False  # the end-of-backward callback is queued for this step

    def _start_step(self, sync: bool) -> None:
        super()._start_step(sync)
        for bucket in self.buckets:
            bucket.reset()
        self._next_bucket = self._next_done = 0
        self._end_queued = False

    # ------------------------------------------------------------------ backward: reduce-scatter
    def _grad_ready_hook(self, bucket: ZeroBucket, j: int):
        """The hook for gradient j of ``bucket``: copy it in, free it, launch complete buckets."""
        name = bucket.names[j]

        def hook(p: nn.Parameter) -> None:
            if self.recorder.enabled:
                self.recorder.grad_ready(name, bucket=bucket.index)
            if not self._sync_pending:  # inside no_sync(): keep accumulating in .grad
                return
            if bucket.ready[j]:
                raise RuntimeError(f"ZeRO2: the gradient of {name!r} became ready twice in one step; "
                                   "each gradient must arrive once per backward")
            if not self._end_queued:
                queue_at_end_of_backward(self.finish_gradient_synchronization)
                self._end_queued = True
            with torch.no_grad():
                self._copy_in(bucket, j)
                self._launch_complete_buckets()
                self._collect_finished(block=False)  # free what is already reduced

        return hook

    def _copy_in(self, bucket: ZeroBucket, j: int) -> None:
        """Gradient j (or zeros, if it has none) / N into its bucket's flat gradient; free .grad."""
        bucket.alloc_gradient()
        p = bucket.params[j]
        if p.grad is not None:
            torch.mul(p.grad.detach(), 1.0 / self.world_size, out=bucket.slot(j))
            p.grad = None  # the full gradient lives on only in the bucket, until it is reduced
        bucket.ready[j] = True
        bucket.missing -= 1

    def _launch_complete_buckets(self) -> None:
        # every complete bucket, in bucket order from the next one due: async, so autograd goes
        # on computing earlier layers' gradients while this one travels
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].missing == 0:
            self.buckets[self._next_bucket].reduce_scatter(self.process_group, self.recorder)
            self._next_bucket += 1

    def _collect_finished(self, block: bool) -> None:
        """Launched buckets, in order, whose reduce-scatter is done (all of them if ``block``):
        our shard of the sum becomes the shard's gradient, and the full flat gradient is freed."""
        while self._next_done < self._next_bucket:
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
        # finish_gradient_synchronization() when no hook fired at all
        for bucket in self.buckets[self._next_bucket:]:
            for j, ready in enumerate(bucket.ready):
                if not ready:  # no gradient in this backward: zeros, or what no_sync() accumulated
                    self._copy_in(bucket, j)
        self._launch_complete_buckets()
        self._collect_finished(block=True)

    def comm_buffer_bytes(self) -> int:
        """Bytes of flat gradients held right now (only while buckets are being reduced)."""
        return sum(b.gradient_bytes for b in self.buckets)
