"""BucketedDDP: pack gradients into a few flat buckets, one all-reduce per bucket.

One idea more than ``NaiveDDP``: a ring all-reduce of S bytes over N ranks costs about
2(N-1) alpha + 2(N-1)/N S beta. Per-parameter all-reduces pay the latency alpha once per
tensor; packing the gradients into a few large flat buffers ("buckets") pays it once per
bucket and moves the same bytes. The default MLP (66 tensors, 8.04 MiB of fp32 gradients)
fits one 25 MiB bucket: 1 collective per step instead of 66.

Bucket assignment follows torch DDP (``buckets.assign_buckets``):
- parameters in *reverse* registration order: the last layers' gradients are ready first in
  backward, so the first bucket is the first to fill (``OverlappedDDP`` relies on this);
- a bucket closes once it reaches ``bucket_cap_mb`` MiB, so the tensor that crosses the cap
  stays in it; ``0`` means one parameter per bucket; a negative cap is a ``ValueError``;
- a bucket holds one dtype on one device (it is a single flat tensor);
- frozen parameters are left out, tied parameters are in once.
- as torch DDP, a cap left at its default (``bucket_cap_mb=None``) is 25 MiB with the first
  bucket capped at 1 MiB, so the first gradients start travelling early; a cap given applies to
  every bucket, so a cap sweep shows both ends of the trade-off (the course's MLP in one bucket
  at 25 MiB); ``first_bucket_mb`` sets the first bucket's cap (``buckets.layout``).
(torch DDP also rebuilds the buckets once in the order gradients actually arrived. No rebuild here.)

When: after backward, as ``NaiveDDP`` (the first gradient queues the sync on the autograd engine's
end of backward, so ``loss.backward()`` returns with the gradients averaged, as with torch's DDP).

Copies, not views: after backward each gradient is copied into its bucket slot (scaled by
1/N on the way), the bucket is all-reduced, and the averaged values are copied back into
``.grad``. Cost: memory, one extra copy of all gradients (the buckets, ``comm_buffer_bytes()``,
8.04 MiB for the default MLP); time, one copy in and one copy out per step (cheap next to the
network). ``gradient_as_bucket_view=True`` (torch DDP's option, off by default as there) points
each ``.grad`` at its bucket slot instead: no extra memory and no copy out, and with
``zero_grad(set_to_none=False)`` no copy in either; plain copies are simpler to follow.
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
