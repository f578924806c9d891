"""ddpkit.Topology: the one rank layout, checked when made, and everything that reads it."""
from __future__ import annotations

import pytest

import ddpkit
from ddpkit.network import Network
from ddpkit.strategies.hsdp import hybrid_layout
from ddpkit.strategies.table import STRATEGIES, unfit
from ddpkit.topology import Topology


def test_ranks_are_numbered_node_by_node():
    t = Topology(world_size=6, ranks_per_node=3)
    assert t.nodes == 2 and t.describe() == "2 nodes x 3"
    assert [t.node_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [t.local_rank(r) for r in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [t.node_ranks(n) for n in range(2)] == [[0, 1, 2], [3, 4, 5]]
    assert [t.peer_ranks(i) for i in range(3)] == [[0, 3], [1, 4], [2, 5]]
    # hybrid sharding's groups are this layout: shard inside a node, replicate across nodes
    assert hybrid_layout(6, 3) == ([[0, 1, 2], [3, 4, 5]], [[0, 3], [1, 4], [2, 5]])
    assert Topology(4, 4).describe() == "1 node x 4"


@pytest.mark.parametrize("world_size, k, message", [
    (3, 2, "gpus_per_node=2 does not divide world_size=3 (3 is not a multiple of 2)"),
    (4, 0, "gpus_per_node must be a whole number >= 1, got 0"),
    (4, True, "gpus_per_node must be a whole number >= 1, got True"),
    (4, 2.0, "gpus_per_node must be a whole number >= 1, got 2.0"),
    (0, 1, "world_size must be a whole number >= 1, got 0"),
])
def test_a_layout_that_cannot_be_is_a_value_error_naming_the_value(world_size, k, message):
    with pytest.raises(ValueError) as info:
        Topology(world_size, k)
    assert message in str(info.value)


def test_the_default_is_nodes_of_two_and_a_network_says_otherwise():
    assert Topology.default(4) == Topology(4, 2) and Topology.default(2) == Topology(2, 2)
    with pytest.raises(ValueError, match="3 is not a multiple of 2: run a multiple of 2 ranks, or give the network"):
        Topology.default(3)
    assert Topology.from_network(None, 4) == Topology.from_network(Network.of("10GbE"), 4) == Topology(4, 2)
    assert Topology.from_network(Network.of("10GbE", gpus_per_node=3), 6) == Topology(6, 3)
    assert Topology.of(Topology(8, 4), 8) == Topology(8, 4)
    with pytest.raises(ValueError, match="a topology of 8 ranks given for world_size=4"):
        Topology.of(Topology(8, 4), 4)


def test_torchrun_layout_from_a_fake_environment():
    env = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "RANK": "5", "LOCAL_RANK": "1"}
    t = Topology.from_torchrun(env)
    assert t == Topology(8, 4) and t.node_of(5) == 1
    # 1 node x 4 CPU ranks: hybrid sharding shards over all 4, not over the default's 2
    one_node = Topology.from_torchrun({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"})
    assert STRATEGIES["hsdp"].shard_group_size(4, one_node) == 4
    assert STRATEGIES["hsdp"].shard_group_size(4) == 2
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE is not set: start this with torchrun"):
        Topology.from_torchrun({"WORLD_SIZE": "8"})
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=3 and WORLD_SIZE=8: gpus_per_node=3 does not divide"):
        Topology.from_torchrun({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "3"})
    with pytest.raises(ValueError, match="do not number the ranks node by node"):
        Topology.from_torchrun({**env, "LOCAL_RANK": "2"})


def test_the_table_reads_the_node_size_from_the_layout():
    net4 = Network.of("10GbE", gpus_per_node=4)
    for name, row in STRATEGIES.items():
        expected = 4 if row.hybrid else 8
        assert row.shard_group_size(8, net4) == expected, name
    assert not STRATEGIES["hsdp"].fits(3) and STRATEGIES["hsdp"].fits(3, Network.of("10GbE", gpus_per_node=3))
    assert STRATEGIES["fsdp"].fits(3)
    assert set(unfit(list(STRATEGIES), [2, 3])) == {"hsdp", "torch_hsdp"}
    assert unfit(list(STRATEGIES), [3, 6], Network.of("10GbE", gpus_per_node=3)) == {}
    assert "hsdp shards inside nodes" in unfit(["hsdp"], [4], Network.of("10GbE", gpus_per_node=3))["hsdp"]


def test_a_two_tier_layout_on_loopback_emulates_no_link():
    net = Network.of("loopback", gpus_per_node=2)
    assert not net.emulated
    assert net.describe() == "loopback (no emulated link), 2 ranks per node"
    assert net.link_for([0, 1]) == ("intra-node", None) and net.link_for([0, 2]) == ("inter-node", None)
    assert Network.from_dict(net.to_dict()) == net


def test_a_cluster_refuses_nodes_that_do_not_divide_it_before_starting(monkeypatch):
    from ddpkit.cluster import check_arguments
    from ddpkit.cluster.processes import Workers

    monkeypatch.setattr(Workers, "start", lambda *a: pytest.fail("a rank was started"))
    with pytest.raises(ValueError, match="gpus_per_node=4 does not divide world_size=6"):
        ddpkit.Cluster(6, network=Network.of("loopback", gpus_per_node=4))
    settings = check_arguments(4, "gloo", network=Network.of("loopback", gpus_per_node=2))
    assert settings.network.gpus_per_node == 2 and settings.backend == "gloo"


def _hsdp_node_size(topology=None):
    """On every rank: the node size the table's hsdp is built with (``topology`` set first, if given)."""
    from ddpkit.experiment import wrap
    from ddpkit.models import build_model
    from ddpkit.rankside import set_topology, topology as rank_topology

    if topology is not None:
        set_topology(topology)
    try:
        model, _ = wrap("hsdp", build_model("mlp", width=8, depth=2), "sgd")
        return rank_topology(), model.gpus_per_node
    finally:
        set_topology(None)


def test_a_rank_builds_hybrid_sharding_on_its_own_layout(cluster_of):
    c = cluster_of(2)
    # a Cluster with no two-tier network: the default, one node of 2
    assert c.run(_hsdp_node_size) == [(Topology(2, 2), 2)] * 2
    # what torchrun's environment would say for two nodes of one rank (ddpkit.train sets it)
    assert c.run(_hsdp_node_size, Topology(2, 1)) == [(Topology(2, 1), 1)] * 2
    assert c.run(_hsdp_node_size) == [(Topology(2, 2), 2)] * 2  # set_topology(None): back to the network's
    # the Cluster's network: its nodes are the rank's
    c.network = Network.of("loopback", gpus_per_node=1)
    try:
        assert c.run(_hsdp_node_size) == [(Topology(2, 1), 1)] * 2
    finally:
        c.network = "loopback"


def test_set_topology_refuses_another_world_size(cluster_of):
    def job():
        from ddpkit.rankside import set_topology

        try:
            set_topology(Topology(4, 2))
        except ValueError as exc:
            return str(exc)

    assert cluster_of(2).run(job) == ["a topology of 4 ranks for a process group of 2"] * 2
