"""Shared fixtures: one persistent gloo Cluster per world size for the whole test session.

Starting ranks costs ~1.5 s (each imports torch); reusing them keeps the suite fast. A test
that leaves a cluster broken (a dead rank) gets it restarted by the next user.
"""
from __future__ import annotations

import pytest

import ddpkit


@pytest.fixture(scope="session")
def _clusters():
    made: dict[int, ddpkit.Cluster] = {}
    yield made
    for c in made.values():
        c.shutdown()


@pytest.fixture
def cluster_of(_clusters):
    """``cluster_of(n)`` -> a ready gloo Cluster with n ranks, shared across tests."""

    def get(world_size: int) -> ddpkit.Cluster:
        c = _clusters.get(world_size)
        if c is None:
            c = _clusters[world_size] = ddpkit.Cluster(world_size, backend="gloo", timeout=30.0)
        elif any(r.status in ("dead", "stopped") for r in c.ranks):
            c.restart()
        return c

    return get


def pytest_collection_modifyitems(config, items):
    """Skip GPU-marked tests on machines without enough CUDA devices."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
