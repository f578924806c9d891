"""ZeRO-1: each rank keeps and updates the optimizer state of only 1/N of the parameters.

Adam keeps two fp32 numbers per parameter (8 bytes, more than the 4-byte parameter itself).
ZeRO stage 1 (Rajbhandari et al. 2020, section 5.1) partitions the optimizer state: each
parameter gets an *owner* rank; only the owner holds its optimizer state and steps it, then
the owner broadcasts the updated parameter so every rank has the whole model again. The
gradients are still averaged over all ranks first (as in DDP); the communication per step
stays the same, the optimizer memory drops to 1/N.

ZeRO stage 2 (section 5.2) partitions the gradients too: each rank only needs the averaged gradient
of what it owns, so a bucket of gradients is *reduce-scattered* as soon as it is complete (1/N of it
lands on each rank) and the full gradients are freed. ``reduce_scatter_bucket`` is that step for one
bucket, with flat shards (as ``ddpkit.ZeRO2`` does) instead of whole owned parameters.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def partition_parameters(numels: list[int], world_size: int) -> list[int]:
    """The owner rank of each parameter, balancing the number of elements per rank.

    Go through the parameters in order and give each one to the rank that owns the fewest
    elements so far (the lowest rank on a tie). Returns ``owners`` with ``owners[i]`` in
    ``range(world_size)``. Check: the busiest and the idlest rank differ by at most the largest
    parameter, and the result depends only on the arguments (every rank computes the same).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    load = [0] * world_size
    owners = []
    for numel in numels:
        r = min(range(world_size), key=lambda k: (load[k], k))
        owners.append(r)
        load[r] += numel
    return owners


@torch.no_grad()
def sharded_step(params: list[torch.Tensor], owners: list[int], optimizer, group=None) -> None:
    """One ZeRO-1 step: step the parameters this rank owns, then broadcast each from its owner.

    The gradients are already averaged over the ranks. ``optimizer`` was built over only the
    parameters with ``owners[i] == dist.get_rank(group)``, so ``optimizer.step()`` updates just
    those. Then broadcast every parameter from its owner (``src`` is a *global* rank:
    ``dist.get_global_rank(group, owner)`` when a group is given). Check: training with it
    equals single-process training, and every rank ends with the same parameters.
    """
    optimizer.step()
    works = []
    for p, owner in zip(params, owners, strict=True):
        src = owner if group is None else dist.get_global_rank(group, owner)
        works.append(dist.broadcast(p.data, src=src, group=group, async_op=True))
    for w in works:
        w.wait()


@torch.no_grad()
def reduce_scatter_bucket(params: list[torch.Tensor], group=None) -> torch.Tensor:
    """ZeRO-2's step for one bucket: reduce-scatter the bucket's gradients, keep only this rank's shard.

    ``params`` are one bucket's parameters, each with its full local ``.grad``. Pack the gradients,
    divided by N (before the SUM, as DDP does), into one flat buffer of T elements (in the order
    given), padded with zeros to N * ceil(T / N); ONE reduce-scatter (SUM) of it gives this rank
    its ``ceil(T / N)`` elements of the average (``dist.reduce_scatter_tensor``, named
    ``reduce_scatter_single`` in newer torch). Then free the full gradients (``p.grad = None``):
    ZeRO-2 keeps only the shard, 1/N of the gradient memory. Return the shard. Check: it equals
    this rank's slice of the mean of every rank's packed gradients; each ``.grad`` is None after;
    exactly one collective ran.
    """
    n = dist.get_world_size(group)
    numel = sum(p.numel() for p in params)
    per_rank = -(-numel // n)  # ceil(T / N)
    flat = params[0].grad.new_zeros(per_rank * n)
    offset = 0
    for p in params:
        flat[offset:offset + p.numel()] = p.grad.reshape(-1) / n  # divide first: no overflow
        offset += p.numel()
        p.grad = None  # the full gradient lives on only in the bucket
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    shard = flat.new_empty(per_rank)
    fn(shard, flat, op=dist.ReduceOp.SUM, group=group)
    return shard
