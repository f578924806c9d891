"""Every private (underscored) or version-dependent torch API ddpkit uses, in one place, each with
why we need it and the releases it was checked on.

ddpkit leans on torch internals on purpose: a Python process group under every collective (torch's
DDP, ``fully_shard`` and ZeroRedundancyOptimizer included) is how it sees torch's own wrappers. The
tested range is ``SUPPORTED``; CI's ``.ci/compat`` proves the floor and the newest, and
``check_torch`` warns once on any other torch. The floor, 2.8, is the oldest release whose
``fully_shard`` (hybrid sharding on a 2-D mesh included) runs on CPU ranks over gloo (2.7 fails in
``post_backward``, 2.6 on ``record_event``); the shims below for 2.6-2.7 make such a torch warn
instead of hang. Checked: the compatibility job on 2.7.1, 2.8.0, 2.13 and 2.15; the doctor on 2.6
to 2.15. ``ddpkit.comm.process_group`` also overrides the methods torch calls on a Python
``ProcessGroup`` (``allreduce``, ``_allgather_base``, ...): their names are torch's, proven by that job.
"""
from __future__ import annotations

import dataclasses
import os
import re
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
# the options a Python group's ``allgather`` passes on to the real backend's (every release in
# the range keeps it in the C extension only)
from torch._C._distributed_c10d import AllgatherOptions  # noqa: F401

# The tested range, (major, minor) of the floor and of the newest release proven in CI.
SUPPORTED = ((2, 8), (2, 15))


def torch_version(text: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``text`` (default: the torch imported here), "2.15.0+cu132" -> (2, 15)."""
    parts = (text or torch.__version__).split("+")[0].split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def supported_range() -> str:
    """The tested range as a reader says it: "2.8 to 2.15"."""
    (a, b), (c, d) = SUPPORTED
    return f"{a}.{b} to {c}.{d}"


def torch_problem(text: str | None = None) -> str | None:
    """What is wrong with this torch for ddpkit, in one sentence; None inside the tested range."""
    version = torch_version(text)
    if SUPPORTED[0] <= version <= SUPPORTED[1]:
        return None
    shown = text or torch.__version__
    side = "older than" if version < SUPPORTED[0] else "newer than"
    return (f"ddpkit is tested with torch {supported_range()}; this is torch {shown}, {side} that range: "
            f"it may fail in ways the kit cannot explain. Install a torch in the range, e.g. "
            f"pip install 'torch>={SUPPORTED[0][0]}.{SUPPORTED[0][1]},<{SUPPORTED[1][0]}.{SUPPORTED[1][1] + 1}'")


class UntestedTorchWarning(UserWarning):
    """The torch imported is outside ddpkit's tested range (``SUPPORTED``)."""


def check_torch() -> str | None:
    """Warn once (``UntestedTorchWarning``) outside the tested range; the problem, or None."""
    problem = torch_problem()
    if problem is not None:
        warnings.warn(problem, UntestedTorchWarning, stacklevel=3)
    return problem


def loopback_tcp_store(sock, timeout: float):
    """The rendezvous ``TCPStore`` hosted on ``sock`` (bound to loopback, listening; the store owns a
    duplicate fd). libuv's store takes a listening fd from 2.8 only: 2.6-2.7 get the legacy store."""
    legacy = {"use_libuv": False} if torch_version() < (2, 8) else {}
    return dist.TCPStore("127.0.0.1", sock.getsockname()[1], is_master=True, wait_for_workers=False,
                         master_listen_fd=os.dup(sock.fileno()), timeout=timedelta(seconds=timeout), **legacy)


def is_async(opts) -> bool:
    """Was the collective launched with ``async_op=True``? (``asyncOp`` from 2.8; before, assumed so.)"""
    return getattr(opts, "asyncOp", True)


# torch 2.8's gloo prints "[Gloo] Rank 0 is connected to 1 peer ranks..." below Python for every
# group, on every rank: a screenful per Cluster in a notebook (not printed by 2.13 or 2.15).
_CHATTER = re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks")


def is_chatter(line: str) -> bool:
    """Is ``line`` (a rank's output below Python) torch's progress chatter, dropped by the cluster?"""
    return _CHATTER.match(line) is not None


# The flat collectives (one tensor in, one out): torch 2.12 renamed ``all_gather_into_tensor`` and
# ``reduce_scatter_tensor`` to ``*_single`` (same meaning) and deprecates the old names after it.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def fully_shard(module, **kwargs):
    """torch's FSDP2 on ``module`` (public in ``torch.distributed.fsdp`` from 2.6)."""
    from torch.distributed.fsdp import fully_shard as shard

    return shard(module, **kwargs)

# torch's dispatch mode (underscored module): ``memory.TensorWatch`` counts the tensors operators create
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402,F401
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402,F401


def storage_nbytes(ref: StorageWeakRef) -> int:
    """The bytes a weakly referenced storage holds now (0 once freed or resized to 0): TensorWatch
    follows storages, since the tensor an operator returned may die while its storage lives on."""
    return 0 if ref.expired() else torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()


def queue_at_end_of_backward(fn) -> bool:
    """Run ``fn`` once the running backward has finished (after every hook), as torch's DDP and FSDP
    do, so ``loss.backward()`` waits for the last collectives; False if torch cannot (then
    train_step's explicit ``finish_gradient_synchronization()`` does it). Call it from a hook only."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is None or not hasattr(engine, "queue_callback"):
        return False
    engine.queue_callback(fn)
    return True


def copy_all(destinations: list, sources: list) -> None:
    """``d.copy_(s)`` for every pair in one call (torch's underscored ``_foreach_copy_``, a C++ loop)."""
    torch._foreach_copy_(destinations, sources)


# torch's pytree (underscored; torch's DDP and FSDP walk inputs with it, Hugging Face registers its
# ModelOutput). A dataclass is a leaf there unless registered: walked here through its fields,
# registering nothing. Checked on 2.8, 2.13 and 2.15 (.ci/compat's test_equivalence).
def _dataclass(x) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type) and type(x) not in pytree.SUPPORTED_NODES


def tree_map(fn, tree):
    """``tree`` with ``fn`` on every leaf, structure kept (dataclasses rebuilt with ``replace``)."""
    def leaf(x):
        if not _dataclass(x):
            return fn(x)
        return dataclasses.replace(x, **{f.name: tree_map(fn, getattr(x, f.name)) for f in dataclasses.fields(x)
                                         if f.init})

    return pytree.tree_map(leaf, tree, is_leaf=_dataclass)


def tree_leaves_with_path(tree, where: str = ""):
    """``(where, leaf)`` for every leaf, ``where`` a key path as torch prints it (``"['input_ids']"``)."""
    try:
        flat = pytree.tree_flatten_with_path(tree, is_leaf=_dataclass)[0]
    except ValueError:  # a node registered without key paths (e.g. an older library's): unnamed
        flat = [((), leaf) for leaf in pytree.tree_leaves(tree, is_leaf=_dataclass)]
    for path, leaf in flat:
        here = where + pytree.keystr(path)
        if _dataclass(leaf):
            for f in dataclasses.fields(leaf):
                yield from tree_leaves_with_path(getattr(leaf, f.name), f"{here}.{f.name}")
        else:
            yield here, leaf


def tensors_to(tree, device: torch.device):
    """``tree`` (a forward's args or kwargs) with every tensor moved to ``device``, the rest as it was."""
    return tree_map(lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, tree)


def first_tensor(tree):
    """The first tensor inside a forward's output (tensor, tuple, dict, ``ModelOutput``), or None."""
    return next((t for _, t in tree_leaves_with_path(tree) if isinstance(t, torch.Tensor)), None)


def allocator_history(enabled: bool, path=None, max_entries: int = 100_000) -> None:
    """Start or stop (writing ``path``, memory_viz's pickle) the CUDA allocator's history."""
    from torch.cuda import memory as cuda_memory

    if enabled:
        cuda_memory._record_memory_history(max_entries=max_entries)
    else:
        if path is not None:
            cuda_memory._dump_snapshot(str(path))
        cuda_memory._record_memory_history(enabled=None)


def register_real_backend(group, real, real_backend: str, cuda: bool = False) -> None:
    """Register the real backend on ddpkit's Python group (gloo for CUDA tensors too where ``cuda``):
    without one the group has no name and ``DeviceMesh`` refuses it; collectives still come to Python."""
    import torch.distributed as dist

    kind = dist.ProcessGroup.BackendType.NCCL if real_backend == "nccl" else dist.ProcessGroup.BackendType.GLOO
    devices = ["cuda"] if real_backend == "nccl" else ["cpu", "cuda"] if cuda else ["cpu"]
    for device in devices:
        group._register_backend(torch.device(device), kind, real)
    # torch 2.15's Flight Recorder asks every group for its default backend type, which
    # _register_backend does not set; earlier releases never ask (harmless there, 2.6 to 2.15)
    group._set_default_backend(kind)


class FutureWork(dist.Work):
    """A ``Work`` that completes with a future (an emulated link's pace, a reduce-scatter's copy-out,
    the shared-memory transport); ``wait()`` raises the future's error, where torch's underscored
    ``_create_work_from_future`` returns True even when the future failed."""

    def __init__(self, future):
        super().__init__()
        self._future = future

    def wait(self, timeout=None):
        try:
            self._future.wait()  # raises what the collective raised
        finally:
            _HELD.pop(id(self), None)
        return True

    def get_future(self):
        _HELD.pop(id(self), None)  # whoever asks goes on with the future, not with this Work
        return self._future

    def is_completed(self):
        return self._future.done()

    def result(self):
        return self._future.value()


# A Python ``Work`` handed to C++ (torch DDP's reducer) lives on in two halves; from 2.7 torch keeps
# the Python half alive (``PyWorkHolder``), on 2.6 (below the range) nothing does, and C++'s
# ``wait()`` blocks forever. There a Work of ddpkit's process group is held until waited on or its
# future taken (``hold_for_torch``): a hang is worse than a warning.
_HELD: dict[int, FutureWork] = {}
_HOLD = torch_version() < (2, 7)
_HELD_AT_MOST = 1024  # Works nobody ever waits on (fire and forget) are let go past this, done ones first


def hold_for_torch(work):
    """``work``, held alive until waited on where this torch would drop it (see ``_HELD``)."""
    if _HOLD and isinstance(work, FutureWork):
        if len(_HELD) >= _HELD_AT_MOST:
            for key in [k for k, w in list(_HELD.items()) if w.is_completed()]:
                _HELD.pop(key, None)
        _HELD[id(work)] = work
    return work


def work_from_future(future) -> FutureWork:
    """A ``Work`` that completes with ``future`` (see ``FutureWork``)."""
    return FutureWork(future)


def backend_registered(name: str) -> bool:
    """Has a backend plugin called ``name`` been registered in this process (``Backend._plugins``)?"""
    import torch.distributed as dist

    return name.upper() in dist.Backend._plugins


def share_cuda_tensor(tensor) -> tuple:
    """What another process needs to map CUDA ``tensor`` (kept alive here) into its address space:
    ``torch.multiprocessing``'s own ``reduce_tensor`` (unchanged from 2.0 to 2.13)."""
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(tensor)


def open_cuda_tensor(shared: tuple):
    """The tensor ``share_cuda_tensor`` described, mapped here (CUDA IPC: the same GPU memory)."""
    rebuild, args = shared
    return rebuild(*args)


def nvml_index(device) -> int:
    """NVML's index of CUDA ``device`` (torch counts only the visible ones): torch's underscored
    ``_get_nvml_device_index``; the torch index where it is missing."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    lookup = getattr(torch.cuda, "_get_nvml_device_index", None)
    try:
        return lookup(index) if lookup is not None else index
    except Exception:  # noqa: BLE001 - a visible-devices string NVML cannot map: torch's own index
        return index
