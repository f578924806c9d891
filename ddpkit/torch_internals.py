"""Every private (underscored) torch API ddpkit uses, in one place, each with why we need it.

Private APIs may change between torch releases; keeping them here means one file to check when
torch moves, and each one fails soft (returns False or raises a clear error) where it can.

- ``queue_at_end_of_backward``: the autograd engine's ``queue_callback`` (strategies);
- ``allocator_history``: the CUDA caching allocator's history recorder (memory snapshots);
- ``register_real_backend``, ``backend_registered``: what ddpkit's own
  process group (``ddpkit.comm.process_group``) needs to stand in for gloo or NCCL (its ``FutureWork``
  needs nothing private: ``dist.Work`` subclassed, as torch's tests of Python groups do);
- ``TorchDispatchMode``: torch's dispatch mode, to watch the tensors operators create;
- ``copy_all``: torch's multi-tensor copy (``_foreach_copy_``), a bucket's slots into ``.grad``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# torch's dispatch mode: a context in which every operator call passes through
# ``__torch_dispatch__`` (``ddpkit.memory.TensorWatch`` counts the tensors operators create). It
# lives in the underscored ``torch.utils._python_dispatch``.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402,F401


def queue_at_end_of_backward(fn) -> bool:
    """Run ``fn`` once the backward pass running now has finished (after every hook); False if
    torch cannot. Call it from a hook only.

    torch's own DDP (in C++) and FSDP do the same. It lets ``loss.backward()`` itself wait for
    the last collectives, so an explicit ``finish_gradient_synchronization()`` finds nothing left
    to do; without it (a future torch) train_step's explicit call still finishes the work.
    """
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is None or not hasattr(engine, "queue_callback"):
        return False
    engine.queue_callback(fn)
    return True


def copy_all(destinations: list, sources: list) -> None:
    """``d.copy_(s)`` for every pair, in one operator call: torch's ``_foreach_copy_`` (underscored)
    loops in C++, where a Python loop pays the interpreter and the dispatcher once per tensor (66
    times a step for the course's MLP). One by one where it is missing."""
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(destinations, sources)
        return
    for d, s in zip(destinations, sources, strict=True):
        d.copy_(s)


def allocator_history(enabled: bool, path=None, max_entries: int = 100_000) -> None:
    """Start (``enabled``) or stop the CUDA allocator's history; on stop, write it to ``path``.

    ``torch.cuda.memory._record_memory_history`` makes the caching allocator keep a stack trace
    per allocation; ``_dump_snapshot`` writes them as a pickle that https://pytorch.org/memory_viz
    draws.
    """
    from torch.cuda import memory as cuda_memory

    if enabled:
        cuda_memory._record_memory_history(max_entries=max_entries)
    else:
        if path is not None:
            cuda_memory._dump_snapshot(str(path))
        cuda_memory._record_memory_history(enabled=None)


def register_real_backend(group, real, real_backend: str) -> None:
    """Register the real backend (gloo, NCCL) on ddpkit's Python process group ``group``.

    A group's name lives on its registered backend in C++; a Python group with none has no
    name, and ``DeviceMesh`` (so ``fully_shard``) refuses it ("ProcessGroup name not set").
    ``_register_backend`` is underscored. Collectives still come to ``group``'s Python methods:
    ``torch.distributed`` calls those, and torch DDP's C++ reducer reaches them through the
    binding's virtual methods.
    """
    import torch.distributed as dist

    kind = dist.ProcessGroup.BackendType.NCCL if real_backend == "nccl" else dist.ProcessGroup.BackendType.GLOO
    device = torch.device("cuda" if real_backend == "nccl" else "cpu")
    group._register_backend(device, kind, real)


class FutureWork(dist.Work):
    """A ``Work`` that completes with a future: what a Python process group returns when the
    result comes later (an emulated link's pace, a reduce-scatter's copy-out, the shared-memory
    transport). ``wait()`` raises the future's error. (torch's own ``_create_work_from_future``
    is underscored, and its ``wait()`` returns True even when the future failed: a failed
    collective would pass unnoticed.) torch's DDP reducer reaches these methods through the
    binding's virtual calls, as for any Python Work."""

    def __init__(self, future):
        super().__init__()
        self._future = future

    def wait(self, timeout=None):
        self._future.wait()  # raises what the collective raised
        return True

    def get_future(self):
        return self._future

    def is_completed(self):
        return self._future.done()

    def result(self):
        return self._future.value()


def work_from_future(future) -> FutureWork:
    """A ``Work`` that completes with ``future`` (see ``FutureWork``)."""
    return FutureWork(future)


def backend_registered(name: str) -> bool:
    """Has a backend plugin called ``name`` been registered in this process (``Backend._plugins``)?"""
    import torch.distributed as dist

    return name.upper() in dist.Backend._plugins
