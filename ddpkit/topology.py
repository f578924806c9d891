"""The rank layout: how many ranks, how many of them share a node, and which node a rank is on.

    Topology(world_size=8, ranks_per_node=4)            # 2 nodes x 4 ranks, checked here
    Topology.from_network(cluster.network, 4)           # a Cluster's: its two-tier network's nodes
    Topology.from_torchrun(os.environ)                  # a torchrun job's: LOCAL_WORLD_SIZE per node
    Topology.default(4)                                 # a laptop Cluster's: 2 nodes x 2

Ranks are numbered node by node, as torchrun numbers them: rank = node * k + local, with
k = ``ranks_per_node``. So node n holds ranks [n*k, ..., n*k + k-1], and the ranks with the same
``local`` index, one per node, hold the same shard under hybrid sharding (``strategies/hsdp.py``).

This is the one place that decides the layout. Hybrid sharding builds its groups from it, the
table of strategies reads the node size from it (``Strategy.shard_group_size``), and so do the
memory formulas, the cost model, the Cluster's and the command line's checks. Inside a rank,
``ddpkit.rankside.topology()`` is the rank's own.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# A Cluster on one machine has no nodes; for hybrid sharding to show anything there, its ranks
# are laid out as nodes of 2 unless its network says otherwise (4 ranks: 2 nodes x 2).
DEFAULT_RANKS_PER_NODE = 2


def check_ranks_per_node(k) -> None:
    """ValueError unless ``k`` is a whole number >= 1 (``Network(gpus_per_node=k)`` checks the same)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"gpus_per_node must be a whole number >= 1, got {k!r}")


@dataclass(frozen=True)
class Topology:
    """``world_size`` ranks in nodes of ``ranks_per_node``, numbered node by node; checked when made."""

    world_size: int
    ranks_per_node: int

    def __post_init__(self):
        n, k = self.world_size, self.ranks_per_node
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"world_size must be a whole number >= 1, got {n!r}")
        check_ranks_per_node(k)
        if n % k:
            raise ValueError(f"gpus_per_node={k} does not divide world_size={n} ({n} is not a multiple "
                             f"of {k}): every node must hold the same number of ranks")

    # --- where a layout comes from -------------------------------------------------------
    @classmethod
    def default(cls, world_size: int) -> Topology:
        """A Cluster's ranks on one machine with no two-tier network: nodes of
        ``DEFAULT_RANKS_PER_NODE`` (2), so 4 ranks are 2 nodes x 2 and 2 ranks one node."""
        k = DEFAULT_RANKS_PER_NODE
        if isinstance(world_size, int) and world_size >= 1 and world_size % k:
            raise ValueError(f"with no two-tier network the ranks are laid out as nodes of {k}, but "
                             f"{world_size} is not a multiple of {k}: run a multiple of {k} ranks, or give "
                             f"the network gpus_per_node=K, K a divisor of {world_size}")
        return cls(world_size, k)

    @classmethod
    def from_network(cls, network, world_size: int) -> Topology:
        """The nodes of a ``ddpkit.Network`` (its ``gpus_per_node``) over ``world_size`` ranks; a
        network without nodes (or None) gives the ``default``."""
        k = getattr(network, "gpus_per_node", None)
        return cls.default(world_size) if k is None else cls(world_size, k)

    @classmethod
    def from_torchrun(cls, env: Mapping[str, str]) -> Topology:
        """The layout torchrun describes in a rank's environment (pass ``os.environ``): WORLD_SIZE
        ranks, LOCAL_WORLD_SIZE on each node. Where RANK and LOCAL_RANK are there too, they must
        number the ranks node by node, as torchrun does (the layout above relies on it)."""
        try:
            world, local = int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"])
        except KeyError as exc:
            raise ValueError(f"torchrun's {exc.args[0]} is not set: start this with torchrun") from None
        except ValueError as exc:
            raise ValueError(f"torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE are not whole numbers: {exc}") from None
        try:
            topology = cls(world, local)
        except ValueError as exc:
            raise ValueError(f"torchrun's LOCAL_WORLD_SIZE={local} and WORLD_SIZE={world}: {exc}") from None
        if "RANK" in env and "LOCAL_RANK" in env and topology.local_rank(int(env["RANK"])) != int(env["LOCAL_RANK"]):
            raise ValueError(f"torchrun's RANK={env['RANK']} and LOCAL_RANK={env['LOCAL_RANK']} do not number "
                             f"the ranks node by node (RANK = node * LOCAL_WORLD_SIZE + LOCAL_RANK)")
        return topology

    @classmethod
    def of(cls, spec, world_size: int) -> Topology:
        """A Topology from what a caller may pass: a Topology (of ``world_size`` ranks), a
        ``ddpkit.Network`` (``from_network``) or None (the ``default``)."""
        if isinstance(spec, Topology):
            if spec.world_size != world_size:
                raise ValueError(f"a topology of {spec.world_size} ranks given for world_size={world_size}")
            return spec
        return cls.from_network(spec, world_size)

    # --- reading it ----------------------------------------------------------------------
    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        """The node ``rank`` is on."""
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        """``rank``'s index inside its node."""
        return rank % self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        """The ranks of ``node``: hybrid sharding's shard group there."""
        k = self.ranks_per_node
        return list(range(node * k, node * k + k))

    def peer_ranks(self, local: int) -> list[int]:
        """The ranks with index ``local`` inside their node, one per node: hybrid sharding's
        replicate group (they hold the same shard)."""
        return list(range(local, self.world_size, self.ranks_per_node))

    def describe(self) -> str:
        return f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {self.ranks_per_node}"
