"""BucketedDDP: pack gradients into a few flat buckets, one all-reduce per bucket.

One idea more than ``NaiveDDP``: a ring all-reduce of S bytes costs about 2(N-1) alpha +
2(N-1)/N S beta, so packing the gradients into a few flat buffers ("buckets") pays alpha once per
bucket, not once per tensor, for the same bytes: the default MLP fits one 25 MiB bucket, 1
collective per step instead of 66.

Buckets follow torch DDP (``buckets.assign_buckets``): parameters in *reverse* registration order
(the last layers' gradients are ready first, so bucket 0 fills first), a bucket closes once it
reaches ``bucket_cap_mb`` (the tensor that crosses the cap stays in it; ``0``: one per bucket), one
dtype and device per bucket; a cap left at None is 25 MiB with a 1 MiB first bucket
(``buckets.layout``). torch DDP also rebuilds the buckets in arrival order once; not here.

When: after backward, as ``NaiveDDP``. Copies, not views: each gradient is copied into its slot
(times 1/N), the bucket all-reduced, the average copied back into ``.grad``: one extra copy of the
gradients in memory (``comm_buffer_bytes()``), a copy in and out per step. torch DDP's
``gradient_as_bucket_view=True`` makes each ``.grad`` its slot instead; plain copies read simpler.
"""
from __future__ import annotations

import torch
from torch import nn

from ddpkit.strategies.ddp_compat import TorchDDPCompat
from ddpkit.strategies.ddp_module import DDPModule


class BucketedDDP(TorchDDPCompat, DDPModule):
    """Copy gradients into flat buckets after backward and all-reduce each bucket once."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = None, process_group=None,
                 recorder=None, find_unused_parameters: bool = False, first_bucket_mb: float | None = None,
                 gradient_as_bucket_view: bool = False, comm_hook=None, **torch_ddp):
        # comm_hook: how each bucket is reduced (a name in comm_hooks.COMM_HOOKS, or a function);
        # find_unused_parameters and torch_ddp (device_ids, broadcast_buffers, ...): torch DDP's
        super().__init__(module, process_group, recorder, bucketed=True, bucket_cap_mb=bucket_cap_mb,
                         first_bucket_mb=first_bucket_mb, gradient_as_bucket_view=gradient_as_bucket_view,
                         find_unused_parameters=find_unused_parameters, comm_hook=comm_hook, torch_ddp=torch_ddp)
        # a hook per gradient (_grad_ready_hook): records the bucket fill order and queues the reduction
        # at the end of backward (the buckets wait for it: launching them earlier is OverlappedDDP's idea)
        self._hook_every_gradient()

    @torch.no_grad()
    def _sync_gradients(self) -> None:
        has_grad = self._has_grad()
        scale = 1.0 / self.world_size  # gradients enter the buckets pre-averaged
        for bucket in self.buckets:
            for j in range(len(bucket.params)):
                bucket.copy_in(j, scale)
            # async: packing the next bucket overlaps this one's send (a comm hook, if
            # registered, does the reducing: register_comm_hook)
            bucket.all_reduce(self.process_group, self.recorder, self._comm_hook)
        for bucket in self.buckets:
            bucket.wait()
            bucket.copy_out()
        self._settle_unused(has_grad)  # find_unused_parameters: None back where no rank had one
