"""NaiveDDP: after backward, all-reduce every gradient, one collective per parameter.

The whole idea of data parallelism in one loop. Every rank holds the full model and runs forward
and backward on its own slice of the batch; then, for each parameter, the ranks average their
gradients with an all-reduce, so every rank takes the same step and the replicas stay equal.

Why this is slow: P parameter tensors pay P collectives per step, each with a fixed latency (2(N-1)
alpha for a ring all-reduce), however small the tensor: the default MLP's 66. ``BucketedDDP``
(next file) packs gradients into a few large buffers to pay it a few times instead.

When: after backward, all at once (the first gradient queues ``finish_gradient_synchronization()``
at the end of backward, so ``loss.backward()`` returns with the gradients averaged, as with torch's
DDP); communicating while backward computes is ``OverlappedDDP``'s idea. The shared core
(construction, forward, ``no_sync()``, the hooks) is ``ddp_module.DDPModule``; torch DDP's extras
are ``ddp_compat.TorchDDPCompat``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.strategies.ddp_compat import TorchDDPCompat
from ddpkit.strategies.ddp_module import DDPModule


class NaiveDDP(TorchDDPCompat, DDPModule):
    """All-reduce each gradient separately, after backward (in finish_gradient_synchronization)."""

    def __init__(self, module: nn.Module, process_group=None, recorder=None, find_unused_parameters: bool = False,
                 bucket_cap_mb: float | None = None, gradient_as_bucket_view: bool = False, **torch_ddp):
        """``find_unused_parameters`` and ``torch_ddp`` (``device_ids``, ``broadcast_buffers``, ...):
        torch DDP's, with torch's meaning. ``gradient_as_bucket_view`` is accepted: each ``.grad`` is
        reduced in place, there is no bucket to copy it to."""
        if bucket_cap_mb is not None:
            raise ValueError("NaiveDDP all-reduces every gradient on its own: it has no buckets, so "
                             f"bucket_cap_mb={bucket_cap_mb!r} does not apply (BucketedDDP has buckets)")
        super().__init__(module, process_group, recorder, find_unused_parameters=find_unused_parameters,
                         torch_ddp=torch_ddp)
        # a hook per gradient (DDPModule._grad_ready_hook): records when it became ready (the fill-order
        # plot, one "bucket" per parameter) and queues the sync at the end of backward
        self._hook_every_gradient()

    @torch.no_grad()
    def _sync_gradients(self) -> None:
        has_grad = self._has_grad()
        for i, (_, p) in enumerate(self.named_grads):
            if p.grad is None:
                # Not used in this step's forward on this rank: contribute zeros, so every
                # rank still calls the same collectives in the same order (else: a hang).
                p.grad = torch.zeros_like(p)
            # Divide by N *before* the SUM: ReduceOp.AVG is not on every backend, and a sum
            # of already-divided values cannot overflow in low precision.
            p.grad.div_(self.world_size)
            with self.recorder.labels(bucket=i):
                work = dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True)
            work.wait()  # naive: one at a time, nothing overlaps
        self._settle_unused(has_grad)  # find_unused_parameters: None back where no rank had one
