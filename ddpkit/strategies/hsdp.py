"""HSDP: hybrid sharding: FULL_SHARD inside a node, replicate across nodes.

FSDP shards every unit over all N ranks, so each of its three collectives per unit crosses the
slow links between nodes. The FSDP paper's hybrid sharding (section 3.2.2; ``docs/papers.md``)
lays the ranks out in 2-D, nodes x ranks per node (k = ``gpus_per_node``):

    rank = node * k + local                       e.g. N = 4, k = 2:
    shard group:     the k ranks of one node          nodes {0, 1} and {2, 3}
    replicate group: the N/k ranks with the same      {0, 2} and {1, 3}
                     ``local`` index, one per node

Inside its node a rank is plain FSDP over k ranks; each gradient shard is then all-reduced in the
replicate group, so across nodes goes one all-reduce of 1/k of the model instead of FSDP's three
collectives of all of it. This file lays out the ranks; the sharding is ``FSDP``'s.
"""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ddpkit.rankside import subgroup
from ddpkit.strategies.common import require_process_group
from ddpkit.strategies.fsdp import FSDP
from ddpkit.topology import Topology


def hybrid_layout(world_size: int, gpus_per_node: int) -> tuple[list[list[int]], list[list[int]]]:
    """(shard groups, replicate groups): node n's ranks [n*k, ..., n*k + k-1], replicate group i's
    [i, i+k, ...]; ValueError unless ``gpus_per_node`` divides ``world_size`` (``Topology``'s checks)."""
    topology = Topology(world_size, gpus_per_node)
    shard = [topology.node_ranks(node) for node in range(topology.nodes)]
    replicate = [topology.peer_ranks(local) for local in range(gpus_per_node)]
    return shard, replicate


def hybrid_groups(gpus_per_node: int):
    """This rank's (shard group, replicate group; None on one node), made alike on every rank, once."""
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
