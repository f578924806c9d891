"""Sharding a flat parameter: the data movement under ZeRO-3 and FSDP.

FSDP (Zhao et al. 2023, section 3.2) flattens a unit's parameters into one flat parameter of
``numel`` elements, pads it to a multiple of the world size N (at most N-1 elements) and keeps
one chunk of ``ceil(numel / N)`` elements per rank: the *shard*. Before the unit computes, an
all-gather rebuilds the full flat parameter (*unshard*); afterwards it is freed (*reshard*).
Gradients go the other way: a reduce-scatter sums the full gradients and leaves each rank only
the sum over its own chunk.

Hybrid sharding (FSDP paper, section 3.2.2) shards only inside a node and keeps one copy of the
model per node: ``hybrid_layout`` says which ranks shard together and which hold the same shard.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


# torch 2.13 renamed the tensor-in, tensor-out collectives (all_gather_into_tensor ->
# all_gather_single, reduce_scatter_tensor -> reduce_scatter_single); older torch has only the
# old names. Looked up at each call, so a test can watch the calls.
def _all_gather_single(output, input, group=None, async_op=False):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def _reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)


def shard_flat(flat: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the 1-D ``flat``: ``ceil(numel / world_size)`` elements, a copy.

    Pad ``flat`` with zeros at the end to a multiple of ``world_size``, cut it into
    ``world_size`` equal chunks, and return chunk ``rank`` as a new tensor (not a view, so the
    full tensor can be freed). Check: concatenating every rank's shard gives ``flat`` plus at
    most ``world_size - 1`` zeros.
    """
    raise NotImplementedError("exercise: sharding.shard_flat (see the docstring)")


def unshard_flat(shard: torch.Tensor, numel: int, group=None) -> torch.Tensor:
    """All-gather every rank's ``shard`` into the full flat tensor of ``numel`` elements.

    The output of the all-gather holds N * shard.numel() elements in rank order (use
    ``dist.all_gather_into_tensor``, named ``all_gather_single`` in newer torch); drop the
    padding at the end. Check: ``unshard_flat(shard_flat(x, r, N), x.numel())`` is ``x`` on
    every rank.
    """
    raise NotImplementedError("exercise: sharding.unshard_flat (see the docstring)")


def reduce_scatter_grad(flat_grad: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's shard of the gradient averaged over ranks, by ONE reduce-scatter.

    ``flat_grad`` is this rank's full 1-D gradient (numel elements). Pad it with zeros to a
    multiple of N, divide by N (before the SUM, as in DDP), reduce-scatter (SUM) into a shard of
    ``ceil(numel / N)`` elements (``dist.reduce_scatter_tensor``, named
    ``reduce_scatter_single`` in newer torch). Check: it equals
    ``shard_flat(mean of every rank's flat_grad, rank, N)``.
    """
    raise NotImplementedError("exercise: sharding.reduce_scatter_grad (see the docstring)")


def hybrid_layout(world_size: int, gpus_per_node: int) -> tuple[list[list[int]], list[list[int]]]:
    """Hybrid sharding's 2-D layout of ``world_size`` ranks into nodes of ``gpus_per_node``.

    Rank ``node * k + local`` (k = ``gpus_per_node``) is GPU ``local`` of node ``node``. Return
    ``(shard_groups, replicate_groups)``, lists of lists of ranks: shard group ``node`` holds the
    k ranks of that node, ``[node*k, ..., node*k + k-1]`` (FULL_SHARD runs inside it); replicate
    group ``local`` holds the ranks with that local index, one per node, ``[local, local+k,
    local+2k, ...]`` (the copies of one shard, whose gradients are all-reduced across nodes).
    Raise ``ValueError`` if ``gpus_per_node`` is not a whole number >= 1 or does not divide
    ``world_size`` (before any rank creates a group). Check: 4 ranks as 2 x 2 give
    ``([[0, 1], [2, 3]], [[0, 2], [1, 3]])``; every rank is in exactly one group of each kind.
    """
    raise NotImplementedError("exercise: sharding.hybrid_layout (see the docstring)")
