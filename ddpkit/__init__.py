"""ddpkit: see how data-parallel training works, from naive all-reduce to FSDP.

In the notebook (the parent process)::

    cluster = ddpkit.Cluster(world_size=2)   # displayed: the cluster widget
    cluster.run(fn)                          # fn runs on every rank; results in rank order

Inside a rank (a Cluster job, a torchrun script, a test)::

    model = ddpkit.OverlappedDDP(module)     # or NaiveDDP, BucketedDDP, FSDP
    opt = ddpkit.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)

Plots (``ddpkit.viz``) and the widget (``ddpkit.widget``) are imported on first use, so a
rank never pays for matplotlib or ipywidgets.
"""
from ddpkit.cluster import Cluster, RankError
from ddpkit.rankside import device, progress, rank, world_size
from ddpkit.strategies import BucketedDDP, FSDP, NaiveDDP, OverlappedDDP, ShardedOptimizer

__version__ = "0.1.0"

__all__ = [
    "Cluster", "RankError", "rank", "world_size", "device", "progress",
    "NaiveDDP", "BucketedDDP", "OverlappedDDP", "ShardedOptimizer", "FSDP",
]


def load_ipython_extension(ipython):
    """``%load_ext ddpkit``: adds the ``%%ranks`` cell magic."""
    from ddpkit.magic import register

    register(ipython)
