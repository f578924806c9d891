"""OverlappedDDP: launch each bucket's all-reduce from autograd hooks, during backward.

One idea more than ``BucketedDDP`` (same buckets, same copies): don't wait for the end of
backward. A hook on every parameter (run right after its gradient lands in ``.grad``) copies it
into its bucket slot; when a bucket's last gradient arrives its async all-reduce launches at once,
and the network works while autograd computes the earlier layers: the overlap of Li et al. (VLDB
2020).

Every rank must issue the same collectives in the same order:
- buckets launch strictly in bucket order (a bucket complete early waits for the earlier one);
- the end of backward launches what is left and waits for every bucket, so ``loss.backward()``
  returns with all gradients averaged;
- a parameter unused in this forward never fires its hook: at the end of backward it goes in as
  its ``.grad`` holds it (``no_sync()``'s sum) or zeros (with ``find_unused_parameters=True`` a
  bitmap all-reduce tells which no rank used; they keep ``.grad`` None); its bucket loses overlap.

Inside ``no_sync()`` the hooks return at once. One backward per forward (a second is a
RuntimeError). Activation checkpointing works with ``use_reentrant=False``, not the reentrant
mode: its nested backward would run the end-of-backward callback, and the sync, too early.
"""
from __future__ import annotations

import torch

from ddpkit.strategies.bucketed import BucketedDDP
from ddpkit.strategies.buckets import InOrder


class OverlappedDDP(BucketedDDP):
    """Bucketed all-reduce launched from gradient hooks, overlapping backward (built as BucketedDDP)."""

    def _start_step(self, sync: bool) -> None:
        super()._start_step(sync)
        # which bucket is launched next this step, in bucket order (the rules above; buckets.InOrder)
        self._in_order = InOrder(self.buckets)

    def _grad_ready_hook(self, i: int, j: int) -> None:
        """Gradient j of bucket i is in ``.grad``: copy it in; launch the buckets now complete."""
        super()._grad_ready_hook(i, j)  # recorded; in a backward that syncs, the end of backward queued
        if not self._sync_pending:  # inside no_sync(): the gradient accumulates in .grad
            return
        bucket = self.buckets[i]
        self._in_order.copy_in(bucket, j, 1.0 / self.world_size)  # .grad / N into its bucket slot
        if bucket.missing == 0:
            # Launch every complete bucket in bucket order, starting from the next one due (only a
            # bucket just completed can make one due): async, so autograd goes on computing earlier
            # layers while the bytes travel.
            for due in self._in_order.due():
                due.all_reduce(self.process_group, self.recorder, self._comm_hook)

    @torch.no_grad()
    def _sync_gradients(self) -> None:
        # Runs at the end of backward (queued by the first hook), or from an explicit
        # finish_gradient_synchronization() when no hook fired at all.
        has_grad = self._has_grad()  # the hooks copy, they leave .grad alone
        self._in_order.complete_the_rest(1.0 / self.world_size)  # no gradient in this backward: see above
        for due in self._in_order.due():
            due.all_reduce(self.process_group, self.recorder, self._comm_hook)
        for bucket in self.buckets:
            bucket.wait()
            bucket.copy_out()  # the averaged bucket back into .grad
        self._settle_unused(has_grad)  # find_unused_parameters: None back where no rank had one
