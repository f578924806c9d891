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

Every name here, and every submodule (``ddpkit.viz``, ``ddpkit.widget``, ...), is imported on
first use, so a rank never pays for the cluster, the course, matplotlib or ipywidgets.
"""
import sys

from ddpkit import strategies  # a face of names only: no strategy is imported before it is asked for
from ddpkit.lazy import lazy_names
from ddpkit.torch_internals import check_torch

__version__ = "0.1.0"

# Where each public name lives: its one home, imported on first use of the name, so ``import ddpkit``
# or one strategy loads no cluster, course, plots or widget (a rank needs none); a submodule
# (``ddpkit.rankside``) is imported on first use too. tests/test_package_face.py checks the names.
_HOMES = {
    "Cluster": "ddpkit.cluster", "RankError": "ddpkit.cluster.errors", "DesyncError": "ddpkit.cluster.errors",
    "GpuOutOfMemoryError": "ddpkit.cluster.errors", "Network": "ddpkit.network", "Topology": "ddpkit.topology",
    "Workload": "ddpkit.workload", "rank": "ddpkit.rankside", "world_size": "ddpkit.rankside",
    "device": "ddpkit.rankside", "progress": "ddpkit.cluster.worker", "ask": "ddpkit.predictions",
    **dict.fromkeys(strategies.__all__, "ddpkit.strategies"),  # each from its file, by that package's face
    "init_process_group": "ddpkit.torchrun", "record": "ddpkit.torchrun",
}
__all__ = list(_HOMES)
__getattr__, __dir__ = lazy_names(globals(), _HOMES, submodules=True)


def _show_clusters_as_widgets() -> None:
    """In IPython (a notebook), display a Cluster as its widget. The cluster knows nothing of
    widgets (they are a later layer): the formatter, registered by the class's name (so nothing is
    imported now), imports ``ddpkit.widget`` on first display; a rank, which has no IPython, never
    loads ipywidgets."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None:
        def display_cluster(cluster):
            from ddpkit.widget import show

            show(cluster)

        shell.display_formatter.ipython_display_formatter.for_type_by_name("ddpkit.cluster", "Cluster",
                                                                           display_cluster)


_show_clusters_as_widgets()
check_torch()  # outside the tested torch range: one warning naming it, before any rank starts


def load_ipython_extension(ipython):
    """``%load_ext ddpkit``: adds the ``%%ranks`` cell magic."""
    from ddpkit.magic import register

    register(ipython)
    _show_clusters_as_widgets()
