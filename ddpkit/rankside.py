"""What a job running inside a rank can ask and report: its rank, the world size, its device, progress.

These work in any process that joined the default process group (a Cluster job, a torchrun
script, a test); ``progress()`` reaches the cluster widget only from inside a Cluster worker.
"""
from __future__ import annotations


def rank() -> int:
    """This process's rank in the default process group."""
    import torch.distributed as dist

    return dist.get_rank()


def world_size() -> int:
    """The number of ranks in the default process group."""
    import torch.distributed as dist

    return dist.get_world_size()


def device():
    """This rank's device: its GPU under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def progress(done: int, total: int) -> None:
    """Report ``done`` of ``total`` steps to the cluster widget (does nothing outside a Cluster)."""
    from ddpkit import _worker

    _worker.report("progress", done=int(done), total=int(total))
