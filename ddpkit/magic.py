"""``%%ranks``: run a notebook cell on every rank of a Cluster, like ipyparallel's ``%%px``.

    %load_ext ddpkit
    cluster = ddpkit.Cluster(world_size=2)

    %%ranks
    import torch, torch.distributed as dist, ddpkit
    t = torch.ones(2, device=ddpkit.device()) * dist.get_rank()   # the rank's GPU under NCCL
    dist.all_reduce(t)
    t                       # a trailing expression: shown once per rank

Each rank keeps its own namespace across cells until the cluster restarts. The cell runs on the
newest running Cluster, or the one named (``%%ranks cluster``); an error raises ``RankError``.
"""
from __future__ import annotations

from ddpkit.cluster import worker
from ddpkit.cluster import Cluster


def find_cluster(user_ns: dict, name: str = "") -> Cluster:
    """The Cluster called ``name`` in ``user_ns``, or the newest running one there."""
    from IPython.core.error import UsageError

    if name:
        if name not in user_ns:
            raise UsageError(f"%%ranks {name}: no variable {name!r} in the notebook")
        cluster = user_ns[name]
        if not isinstance(cluster, Cluster):
            raise UsageError(f"%%ranks {name}: {name!r} is a {type(cluster).__name__}, not a ddpkit.Cluster")
        return cluster
    running = [v for v in list(user_ns.values()) if isinstance(v, Cluster) and v._alive()]
    if not running:
        raise UsageError("%%ranks: no running ddpkit.Cluster in the notebook; create one first, "
                         "e.g. cluster = ddpkit.Cluster(world_size=2)")
    return max(running, key=lambda c: c._created)


def ranks(line: str, cell: str, user_ns: dict) -> list:
    """Run ``cell`` on every rank; print each rank's trailing expression; their reprs in rank order."""
    cluster = find_cluster(user_ns, line.strip())
    # run_cell is referenced by module (ddpkit.cluster.worker), so the ranks use their own copy,
    # which holds their persistent namespace.
    outs = cluster.run(worker.run_cell, cell)
    for r, out in enumerate(outs):
        if out is not None:
            print(f"Out[rank {r}]: {out}")
    return outs


def register(ipython) -> None:
    """Add the ``%%ranks`` cell magic to an IPython shell (``%load_ext ddpkit`` calls this)."""

    def ranks_magic(line, cell):
        ranks(line, cell, ipython.user_ns)  # returns None to IPython: the output is printed

    ranks_magic.__doc__ = __doc__
    ipython.register_magic_function(ranks_magic, magic_kind="cell", magic_name="ranks")
