"""OverlappedDDP: launch each bucket's all-reduce from autograd hooks, during backward.

One idea more than ``BucketedDDP`` (same buckets, same copies): don't wait for the end of
backward. Backward produces gradients from the last layer to the first, and buckets were
assigned in that order, so bucket 0 fills first. A hook on every parameter
(``register_post_accumulate_grad_hook``, run right after the gradient lands in ``.grad``)
copies the gradient into its bucket slot; when the last gradient of a bucket arrives, the
bucket's async all-reduce is launched at once, and the network works while autograd keeps
computing the earlier layers' gradients: the overlap of Li et al. (VLDB 2020).

Rules that keep every rank issuing identical collectives in identical order:
- buckets are launched strictly in bucket order: a bucket that is complete before an earlier
  one waits, and is launched right after that one;
- the end of backward (a callback queued on the autograd engine) launches what is left and
  waits for every bucket, so when ``loss.backward()`` returns all gradients are averaged and
  ``finish_gradient_synchronization()`` is a harmless no-op;
- a parameter that got no gradient in this backward (unused in the forward on this rank)
  never fires its hook. At the end of backward it is treated as ready: it contributes its
  locally accumulated ``.grad`` (from ``no_sync()`` steps) or zeros, and its ``.grad`` becomes
  the ranks' average (zeros if no rank used it; with ``find_unused_parameters=True`` one more
  all-reduce, of a bitmap, tells which no rank used, and those keep ``.grad`` None). This costs
  nothing when every parameter is used, but such a bucket can only launch at the end of
  backward, losing its overlap.

Inside ``no_sync()`` the hooks return at once: gradients accumulate in ``.grad`` and the
first backward after it syncs the sum.

One backward per forward: a second backward after the sync would add local, unsynchronised
gradients, so it is a RuntimeError (use ``no_sync()`` for all but the last). Activation checkpointing works with
``use_reentrant=False`` (torch's recommended mode). The reentrant mode is NOT supported: it
runs a nested backward per checkpointed region, and when the first gradient of a step
arrives inside one, the end-of-backward callback joins that nested pass and syncs too early.

Gradients are *copied* into the buckets (as in BucketedDDP): one extra copy of the
gradients in memory (``comm_buffer_bytes()``), a copy in (in the hook) and a copy out (at the
end of backward) in time; ``gradient_as_bucket_view=True`` makes each ``.grad`` its bucket slot
instead (see ``BucketedDDP``).
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
