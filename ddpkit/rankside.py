"""What a job running inside a rank can ask and report: its rank, the world size, its device,
progress, and the recorder its strategies record into.

These work in any process that joined the default process group (a Cluster job, a torchrun
script, a test); ``progress()`` reaches the cluster widget only from inside a Cluster worker.

The rank's recorder is the one piece of process-wide state here, on purpose: a process is one
rank, and everything in it that records (every strategy built without an explicit ``recorder=``,
and ddpkit's process group, which sees every collective) must record into the same place, also
from threads the job did not start (autograd's, a collective's completion callback).
"""
from __future__ import annotations

import contextlib

_NO_SPAN = contextlib.nullcontext()


class NullRecorder:
    """The recorder that records nothing (the default for every strategy)."""

    enabled = False

    def span(self, name: str, cat: str = "compute", **fields):
        return _NO_SPAN

    def collective(self, name: str, work, nbytes: int, **fields) -> None:
        pass

    def grad_ready(self, param_name: str, **fields) -> None:
        pass

    def memory(self, **bytes_by_category: int) -> None:
        pass

    # what the training step (``experiment.train_step``) tells a recorder besides
    def begin_step(self) -> None:
        pass

    def next_step(self) -> None:
        pass

    def loss(self, value) -> None:
        pass

    def memory_due(self) -> bool:
        return False


NULL_RECORDER = NullRecorder()


class _Rank:
    """This process's rank-wide settings (one instance, ``_RANK``)."""

    recorder = NULL_RECORDER


_RANK = _Rank()


def recorder():
    """The recorder this rank records into now: a ``ddpkit.trace.Recorder`` while recording is on
    (``with recording(rec):``, or ``cluster.recording()`` in the notebook), else the do-nothing
    ``NullRecorder``. A strategy built with ``recorder=None`` takes this one."""
    return _RANK.recorder


@contextlib.contextmanager
def recording(rec):
    """Make ``rec`` this rank's recorder inside the block (the previous one is restored after)."""
    previous, _RANK.recorder = _RANK.recorder, rec
    try:
        yield rec
    finally:
        _RANK.recorder = previous


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
