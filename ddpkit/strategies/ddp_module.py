"""DDPModule: what the three DDP wrappers (naive, bucketed, overlapped) share.

Construction (checks, rank 0's parameters and buffers broadcast, the list of gradients to
reduce, the buckets when bucketed), ``forward``, ``no_sync()`` and the "does this backward need
a sync?" flag. Each strategy file only adds how it reduces gradients.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.rankside import recorder as rank_recorder
from ddpkit.strategies._common import no_sync, prepare_module, unique_named_parameters
from ddpkit.strategies.buckets import bucket_cap_bytes, make_buckets


class DDPModule(nn.Module):
    """What every DDP-style wrapper shares: construction, forward, no_sync, full_state_dict.

    A subclass implements ``_sync_gradients()`` (average every gradient across ranks). With
    ``bucketed=True`` construction also builds ``self.buckets`` (``buckets.make_buckets``).

    When does a backward need a sync? As in torch DDP (``require_backward_grad_sync``), the
    *forward* decides: a forward run with gradients enabled outside ``no_sync()`` marks a sync
    as pending; ``finish_gradient_synchronization()`` does it once and clears the mark, so a
    second call is a no-op. A forward inside ``no_sync()`` leaves gradients to accumulate
    locally; the next forward outside it syncs the sum. So: run the forward through the
    wrapper (``model(x)``, not ``model.module(x)``), one backward per forward.
    """

    def __init__(self, module: nn.Module, process_group=None, recorder=None, *, bucketed: bool = False,
                 bucket_cap_mb: float = 25.0):
        if bucketed:
            bucket_cap_bytes(bucket_cap_mb)  # a bad cap fails before any communication
        super().__init__()
        prepare_module(type(self).__name__, module, process_group)
        self.module = module
        self.process_group = process_group
        self.recorder = rank_recorder() if recorder is None else recorder  # None: the rank's
        self.world_size = dist.get_world_size(process_group)
        # The gradients to reduce: trainable parameters, tied ones once, in registration order.
        self.named_grads = list(unique_named_parameters(module))
        self._require_sync = True   # False inside no_sync()
        self._sync_pending = False  # set by a forward that needs a sync, cleared when done
        if bucketed:  # the flat buckets, in the order they fill (buckets.py)
            self.bucket_cap_mb = bucket_cap_mb
            self.buckets = make_buckets(self.named_grads, bucket_cap_mb)

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():  # an eval forward under torch.no_grad() changes nothing
            self._start_step(sync=self._require_sync)
        return self.module(*args, **kwargs)

    def _start_step(self, sync: bool) -> None:
        """Called by each training forward; subclasses reset per-step state here."""
        self._sync_pending = sync

    def finish_gradient_synchronization(self) -> None:
        """Block until every gradient is averaged across ranks; a no-op if already done."""
        if self._sync_pending:
            self._sync_gradients()
            self._sync_pending = False

    def _sync_gradients(self) -> None:
        raise NotImplementedError

    no_sync = no_sync

    def full_state_dict(self) -> dict:
        """{parameter name: tensor}: every rank holds the full model, so just detached clones."""
        return {name: p.detach().clone() for name, p in self.module.named_parameters()}

    buckets: tuple = ()  # bucketed wrappers set their list of ``buckets.Bucket``

    def comm_buffer_bytes(self) -> int:
        """Bytes of communication buffers this wrapper holds: its flat buckets, if any."""
        return sum(b.nbytes for b in self.buckets)
