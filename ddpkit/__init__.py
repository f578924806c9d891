"""ddpkit: see how data-parallel training works, from naive all-reduce to FSDP.

In the notebook (the parent process)::

    cluster = ddpkit.Cluster(world_size=2)   # displayed: the cluster widget
    cluster.run(fn)                          # fn runs on every rank; results in rank order
                                             # (ranks whose collectives part: ddpkit.DesyncError)
    ddpkit.Cluster(4, network=ddpkit.Network("10GbE", gpus_per_node=2))  # an emulated network
    ddpkit.Cluster(4, gpus=[0, 0, 0, 0])     # 4 ranks sharing one GPU (a rank out of its memory:
                                             # ddpkit.GpuOutOfMemoryError, saying what each held)

Inside a rank (a Cluster job, a torchrun script, a test)::

    model = ddpkit.OverlappedDDP(module)     # or NaiveDDP, BucketedDDP, ZeRO1, ZeRO2, FSDP, HSDP
    opt = ddpkit.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)

What an experiment trains, on any of them: ``ddpkit.Workload(model=, batch=, loss=, name=)`` (or
``ddpkit.Workload.builtin("mlp")``), for ``ddpkit.compare.compare(cluster, names, workload=wl)``.

Before a measurement, the course asks for a prediction: ``q = ddpkit.ask("02.naive_bytes")``, then
``q.reveal(trace)`` after the measuring cell (``ddpkit.predictions``).

Plots (``ddpkit.viz``) and the widget (``ddpkit.widget``) are imported on first use, so a
rank never pays for matplotlib or ipywidgets.
"""
import sys

from ddpkit.cluster import Cluster, RankError
from ddpkit.cluster.errors import DesyncError, GpuOutOfMemoryError
from ddpkit.network import Network
from ddpkit.predictions import ask
from ddpkit.topology import Topology
from ddpkit.torch_internals import check_torch
from ddpkit.workload import Workload
from ddpkit.cluster.worker import progress
from ddpkit.rankside import device, rank, world_size
from ddpkit.strategies import (FSDP, HSDP, BucketedDDP, NaiveDDP, OverlappedDDP, ShardedOptimizer, ZeRO1,
                               ZeRO2)
from ddpkit.torchrun import init_process_group, record

__version__ = "0.1.0"


def _show_clusters_as_widgets() -> None:
    """In IPython (a notebook), display a Cluster as its widget. The cluster knows nothing of
    widgets (they are a later layer): the formatter imports ``ddpkit.widget`` on first display,
    so a rank, which has no IPython, never loads ipywidgets."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None:
        def display_cluster(cluster):
            from ddpkit.widget import show

            show(cluster)

        shell.display_formatter.ipython_display_formatter.for_type(Cluster, display_cluster)


_show_clusters_as_widgets()
check_torch()  # outside the tested torch range: one warning naming it, before any rank starts

__all__ = [
    "Cluster", "RankError", "DesyncError", "GpuOutOfMemoryError", "Network", "Topology", "Workload", "rank",
    "world_size", "device",
    "progress", "ask",
    "NaiveDDP", "BucketedDDP", "OverlappedDDP", "ShardedOptimizer", "ZeRO1", "ZeRO2", "FSDP", "HSDP",
    "init_process_group", "record",
]


def load_ipython_extension(ipython):
    """``%load_ext ddpkit``: adds the ``%%ranks`` cell magic."""
    from ddpkit.magic import register

    register(ipython)
    _show_clusters_as_widgets()
