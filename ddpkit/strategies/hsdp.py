"""HSDP: hybrid sharding: FULL_SHARD inside a node, replicate across nodes.

FSDP shards every unit over all N ranks, so each of its three collectives per unit crosses the
slow links between nodes. The FSDP paper's hybrid sharding (section 3.2.2; ``docs/papers.md``)
lays the ranks out in 2-D, nodes x ranks per node (k = ``gpus_per_node``):

    rank = node * k + local                       e.g. N = 4, k = 2:
    shard group:     the k ranks of one node          nodes {0, 1} and {2, 3}
    replicate group: the N/k ranks with the same      {0, 2} and {1, 3}
                     ``local`` index, one per node

Inside its node a rank is plain FSDP (all-gathers and reduce-scatters among k ranks, over the fast
links); across nodes the N/k copies of each shard are replicas, kept equal the way DDP keeps
models equal: after a unit's reduce-scatter inside the node, its gradient shard is all-reduced in
the replicate group (``FSDP.finish_gradient_synchronization``, where ``replicate_group`` is set).
What crosses nodes per step is one all-reduce of 1/k of the model per rank, instead of FSDP's
three collectives of the whole model; the price is memory: state per rank is everything / k, not
everything / N.

This file only lays out the ranks and builds the process groups; the sharding is ``FSDP``'s.
"""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ddpkit.rankside import subgroup
from ddpkit.strategies.common import require_process_group
from ddpkit.strategies.fsdp import FSDP
from ddpkit.topology import Topology


def hybrid_layout(world_size: int, gpus_per_node: int) -> tuple[list[list[int]], list[list[int]]]:
    """(shard groups, replicate groups) as lists of ranks: node n's shard group is ranks
    [n*k, ..., n*k + k-1]; replicate group i is ranks [i, i+k, i+2k, ...]. ValueError unless
    ``gpus_per_node`` is a whole number >= 1 that divides ``world_size`` (``ddpkit.Topology``'s checks)."""
    topology = Topology(world_size, gpus_per_node)
    shard = [topology.node_ranks(node) for node in range(topology.nodes)]
    replicate = [topology.peer_ranks(local) for local in range(gpus_per_node)]
    return shard, replicate


def hybrid_groups(gpus_per_node: int):
    """This rank's (shard group, replicate group) over the default group; the replicate group is
    None on a single node (then it is plain FSDP). Every rank asks for every group, in the same
    order (``new_group`` is collective over the default group), after the layout was checked.
    A layout's groups are made once per process group and reused by every later HSDP
    (``rankside.subgroup``): each holds communicators (NCCL's: GPU memory) until the group ends."""
    require_process_group("HSDP")
    topology = Topology(dist.get_world_size(), gpus_per_node)  # ValueError before any collective
    shard_groups = [subgroup(topology.node_ranks(node)) for node in range(topology.nodes)]
    replicate_groups = [subgroup(topology.peer_ranks(local)) for local in range(gpus_per_node)]
    rank = dist.get_rank()
    return (shard_groups[topology.node_of(rank)],
            replicate_groups[topology.local_rank(rank)] if topology.nodes > 1 else None)


class HSDP(FSDP):
    """FSDP sharded inside each node of ``gpus_per_node`` ranks, replicated across nodes."""

    def __init__(self, module: nn.Module, gpus_per_node: int, units=None, process_group=None, **fsdp_kwargs):
        if process_group is not None:
            raise ValueError("HSDP lays out every rank of the default process group; it takes no "
                             "process_group (it builds its shard and replicate groups itself)")
        shard_group, replicate_group = hybrid_groups(gpus_per_node)
        super().__init__(module, units, process_group=shard_group, replicate_group=replicate_group,
                         **fsdp_kwargs)
        self.gpus_per_node = gpus_per_node
