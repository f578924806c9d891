"""Every private (underscored) or version-dependent torch API ddpkit uses, in one place, each with
why we need it and the releases it was checked on.

ddpkit leans on torch internals on purpose: a Python process group under every collective (torch's
DDP, ``fully_shard`` and ZeroRedundancyOptimizer included) is how it sees torch's own wrappers.
So it states a tested range, ``SUPPORTED`` (floor and newest release), proves it in CI (``.ci/compat``
runs the doctor, the equivalence matrix and the process-group, shared-memory, desync and
third-party-model tests on the floor and the newest), and warns once, naming the range, on any
other torch (``check_torch``, called by ``import ddpkit`` and by the doctor's first line).
The floor, 2.8: the oldest release on which torch's own ``fully_shard`` (FSDP2, the course's
reference for sharding), hybrid sharding on a 2-D mesh included, runs on CPU ranks over gloo. On
2.7 its hybrid form fails inside torch (``assert all_reduce_event is not None`` in
``post_backward``), on 2.6 every form does ("'Stream' object has no attribute 'record_event'");
every ddpkit strategy and torch's DDP still train there (the shims below for 2.6-2.7 are kept so
that a torch below the range warns instead of hanging). Checked: the compatibility job on 2.7.1,
2.8.0, 2.13 and 2.15; the doctor on 2.6, 2.7.1, 2.8.0, 2.11, 2.13 and 2.15.

- ``check_torch``, ``SUPPORTED``: the tested range and the one warning outside it;
- ``loopback_tcp_store``: the rendezvous store on a socket we bound (libuv's store takes a
  listening fd from 2.8; 2.6-2.7, below the range, take it only with the legacy store);
- ``all_gather_flat``, ``reduce_scatter_flat``: the flat collectives (renamed ``*_single`` in 2.12);
- ``fully_shard``: torch's FSDP2 (public in ``torch.distributed.fsdp`` from 2.6);
- ``is_chatter``: torch 2.8's gloo announcing its connections on every rank (dropped);
- ``is_async``: a collective's ``asyncOp`` option (from 2.8);
- ``hold_for_torch``: a Python ``Work`` kept alive for C++ (2.6 only; ``PyWorkHolder`` from 2.7);
- ``AllgatherOptions``: the options object a Python process group's ``allgather`` hands to the real
  backend's (not re-exported by ``torch.distributed``);
- ``queue_at_end_of_backward``: the autograd engine's ``queue_callback`` (strategies);
- ``StorageWeakRef``, ``storage_nbytes``: a weak reference to a storage and its size now (TensorWatch);
- ``allocator_history``: the CUDA caching allocator's history recorder (memory snapshots);
- ``register_real_backend``, ``backend_registered``: what ddpkit's own
  process group (``ddpkit.comm.process_group``) needs to stand in for gloo or NCCL (its ``FutureWork``
  needs nothing private: ``dist.Work`` subclassed, as torch's tests of Python groups do);
- ``TorchDispatchMode``: torch's dispatch mode, to watch the tensors operators create;
- ``copy_all``: torch's multi-tensor copy (``_foreach_copy_``), a bucket's slots into ``.grad``;
- ``tree_map``, ``tree_leaves_with_path``: torch's pytree (``torch.utils._pytree``), the one walker
  of nested batches, arguments and outputs (tuples, lists, dicts, named tuples, dataclasses);
  ``tensors_to`` (what torch's DDP does to a forward's inputs given ``device_ids``) and
  ``first_tensor`` (where a wrapper times a backward that it did not start) are walks of it;
- ``share_cuda_tensor``, ``open_cuda_tensor``: a CUDA tensor handed to another process through CUDA IPC
  (``torch.multiprocessing.reductions``, what ``torch.multiprocessing`` pickles a CUDA tensor with);
  the CUDA IPC transport's slab (``ddpkit.comm.transport.device_slab``);
- ``nvml_index``: the NVML index of a CUDA device (``CUDA_VISIBLE_DEVICES`` renumbers torch's),
  for the memory a process holds outside the allocator (``ddpkit.memory.cuda_context_bytes``).

Beyond these names, ``ddpkit.process_group`` overrides the methods torch calls on a Python
``ProcessGroup`` (``allreduce``, ``_allgather_base``, ``_reduce_scatter_base``, ...): their names
and arguments are torch's, and the compatibility job is what proves them on each release.
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
    """Warn once (``UntestedTorchWarning``) when this torch is outside the tested range; return
    the problem, or None."""
    problem = torch_problem()
    if problem is not None:
        warnings.warn(problem, UntestedTorchWarning, stacklevel=3)
    return problem


def loopback_tcp_store(sock, timeout: float):
    """The rendezvous ``TCPStore``, hosted here on ``sock``, a socket already bound (to loopback)
    and listening; the store owns a duplicate of its fd.

    torch's default store backend (libuv, from 2.4) accepts a listening fd only from 2.8
    (earlier: ``NotImplementedError``), so 2.6-2.7 get the legacy store, which always did.
    """
    legacy = {"use_libuv": False} if torch_version() < (2, 8) else {}
    return dist.TCPStore("127.0.0.1", sock.getsockname()[1], is_master=True, wait_for_workers=False,
                         master_listen_fd=os.dup(sock.fileno()), timeout=timedelta(seconds=timeout), **legacy)


def is_async(opts) -> bool:
    """Did the caller launch this collective asynchronously (``async_op=True``)? Options carry it
    as ``asyncOp`` from 2.8; before, a backend cannot tell, and takes every call as asynchronous."""
    return getattr(opts, "asyncOp", True)


# torch 2.8's gloo prints a line for every group it connects ("[Gloo] Rank 0 is connected to 1 peer
# ranks. Expected number of connected peer ranks is : 1"), below Python, on every rank: in a
# notebook, a screenful of it for each Cluster. Not printed by 2.13 or 2.15.
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

# torch's dispatch mode: a context in which every operator call passes through
# ``__torch_dispatch__`` (``ddpkit.memory.TensorWatch`` counts the tensors operators create). It
# lives in the underscored ``torch.utils._python_dispatch``.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402,F401
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402,F401


def storage_nbytes(ref: StorageWeakRef) -> int:
    """The bytes a weakly referenced storage holds now (0 once freed or resized to 0): TensorWatch
    follows storages, since the tensor an operator returned may die while its storage lives on."""
    return 0 if ref.expired() else torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()


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


# torch's pytree (underscored; torch's DDP and FSDP walk their inputs with it, Hugging Face registers
# its ModelOutput with it). A dataclass is a leaf there unless registered (``register_dataclass``,
# global): walked here through its fields, registering nothing. Used: tree_map, tree_leaves and
# tree_flatten_with_path with ``is_leaf``, keystr, SUPPORTED_NODES (key paths came in 2.2); run on
# 2.13 here, and on 2.8 and 2.15 by .ci/compat's test_equivalence, which slices every batch with them.
def _dataclass(x) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type) and type(x) not in pytree.SUPPORTED_NODES


def tree_map(fn, tree):
    """``tree`` with ``fn`` applied to every leaf, its structure kept (tuples, lists, dicts, named
    tuples, what torch's pytree knows; dataclasses rebuilt with ``dataclasses.replace``)."""
    def leaf(x):
        if not _dataclass(x):
            return fn(x)
        return dataclasses.replace(x, **{f.name: tree_map(fn, getattr(x, f.name)) for f in dataclasses.fields(x)
                                         if f.init})

    return pytree.tree_map(leaf, tree, is_leaf=_dataclass)


def tree_leaves_with_path(tree, where: str = ""):
    """``(where, leaf)`` for every leaf of ``tree`` in order, ``where`` as torch prints a key path,
    e.g. ``"['input_ids']"``, ``"[0]"``, ``".labels"`` (a named tuple's or a dataclass's field)."""
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
    """The first tensor inside a forward's output (a tensor, a tuple, a dict, a Hugging Face
    ``ModelOutput``, a dataclass), or None."""
    return next((t for _, t in tree_leaves_with_path(tree) if isinstance(t, torch.Tensor)), None)


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


def register_real_backend(group, real, real_backend: str, cuda: bool = False) -> None:
    """Register the real backend (gloo, NCCL) on ddpkit's Python process group ``group``; a gloo
    one for CUDA tensors too where ``cuda`` (ranks on GPUs over gloo's family: gloo takes them).

    A group's name lives on its registered backend in C++; a Python group with none has no
    name, and ``DeviceMesh`` (so ``fully_shard``) refuses it ("ProcessGroup name not set").
    ``_register_backend`` is underscored. Collectives still come to ``group``'s Python methods:
    ``torch.distributed`` calls those, and torch DDP's C++ reducer reaches them through the
    binding's virtual methods.
    """
    import torch.distributed as dist

    kind = dist.ProcessGroup.BackendType.NCCL if real_backend == "nccl" else dist.ProcessGroup.BackendType.GLOO
    devices = ["cuda"] if real_backend == "nccl" else ["cpu", "cuda"] if cuda else ["cpu"]
    for device in devices:
        group._register_backend(torch.device(device), kind, real)
    # torch 2.15's init_process_group attaches its Flight Recorder to every group with a
    # registered device backend, and asks the group for its *default* backend type, which
    # _register_backend does not set ("Could not find the default backend type 0"). Earlier
    # releases never ask; setting it there is harmless (checked on 2.6 to 2.15).
    group._set_default_backend(kind)


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


# A Python ``Work`` handed to C++ (torch DDP's reducer, ``_verify_params_across_processes``) lives
# on as two halves: the C++ object C++ holds, and the Python object whose ``wait()`` C++ calls
# through pybind's trampoline. From 2.7 torch keeps the Python half alive with the C++ one
# (``PyWorkHolder``); on 2.6, below the tested range, nothing does, so once Python drops it C++'s
# ``wait()`` reaches the base ``Work`` and blocks forever (torch DDP's constructor hung over the
# shared-memory transport). There, a Work returned by ddpkit's process group is held here until
# somebody waits on it or takes its future (``hold_for_torch``): a hang is worse than a warning.
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
    """What another process needs to map ``tensor`` (a CUDA tensor this process keeps alive) into its
    own address space: picklable bytes and numbers (a ``cudaIpcMemHandle``, its size and offset,
    the reference counter and event that keep the producer's memory valid).
    ``torch.multiprocessing.reductions.reduce_tensor`` is how ``torch.multiprocessing`` ships a CUDA
    tensor between processes; its rebuild function and argument list are its own, unchanged from
    2.0 to 2.13 (to be proven on a GPU: the GPU lab's shared-GPU parts)."""
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, args = reduce_tensor(tensor)
    return rebuild, args


def open_cuda_tensor(shared: tuple):
    """The tensor ``share_cuda_tensor`` described, mapped here (CUDA IPC: the same GPU memory)."""
    rebuild, args = shared
    return rebuild(*args)


def nvml_index(device) -> int:
    """NVML's index of CUDA device ``device`` (NVML counts physical GPUs; torch counts those
    ``CUDA_VISIBLE_DEVICES`` shows): ``torch.cuda._get_nvml_device_index``, underscored, as
    ``torch.cuda.utilization`` uses it; the torch index where it is missing."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    lookup = getattr(torch.cuda, "_get_nvml_device_index", None)
    try:
        return lookup(index) if lookup is not None else index
    except Exception:  # noqa: BLE001 - a visible-devices string NVML cannot map: torch's own index
        return index
