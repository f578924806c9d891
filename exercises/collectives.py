"""Collectives by hand: a ring all-reduce built from point-to-point sends and receives.

The ring (Patarasuk & Yuan's bandwidth-optimal all-reduce; the cost is in docs/papers.md): N ranks
stand in a circle, each sends only to its right neighbour (rank + 1) and receives only from its
left one (rank - 1). The flat tensor of S bytes is cut into N chunks of about S/N bytes.

Phase 1, reduce-scatter (N-1 steps): at step s, rank r sends chunk (r - s) mod N and adds the
chunk (r - s - 1) mod N that arrives into its own copy. A chunk travels once round the ring,
picking up one more rank's contribution per hop, so afterwards rank r holds the complete sum of
chunk (r + 1) mod N.
Phase 2, all-gather (N-1 steps): at step s, rank r sends chunk (r + 1 - s) mod N (complete) and
overwrites chunk (r - s) mod N with the complete one that arrives.

Each rank sends 2(N-1) chunks of S/N bytes, i.e. 2(N-1)/N * S: almost 2S however many ranks
there are. That is why all-reduce bandwidth cost does not grow with N.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _global_rank(group, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (send/recv address global ranks)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum a 1-D ``tensor`` over the ranks of ``group`` in place, by a ring of sends; return it.

    Use only point-to-point calls, no collective: each step, post the send to the right and the
    receive from the left together, ``dist.batch_isend_irecv([dist.P2POp(dist.isend, ...),
    dist.P2POp(dist.irecv, ...)])``, then wait on what it returns. Posted one by one, every rank
    blocking in ``send`` deadlocks, and on NCCL even ``isend`` then ``recv`` can hang (both queue
    on one GPU stream); a batch is posted as one group. Split with
    ``torch.tensor_split(tensor, N)`` (chunks may differ by one element, and are empty when
    ``tensor.numel() < N``: skip empty chunks on both sides, and post nothing when both are).
    Phase 1 reduce-scatter, phase 2 all-gather, N-1 steps each (see the module docstring).
    Check: equals ``dist.all_reduce`` (SUM) for any length and 2-4 ranks.
    """
    raise NotImplementedError("exercise: collectives.ring_all_reduce (see the docstring)")
