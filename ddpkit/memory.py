"""Memory per rank by category, measured inside the rank.

Categories (``CATEGORIES``, bytes per rank): ``parameters`` (for FSDP the local shards),
``gradients``, ``optimizer_state`` (per-element only: no 0-dim ``step``, as the ZeRO formulas),
``communication_buffers`` (the wrapper's ``comm_buffer_bytes()``), ``activations`` (saved for
backward, ``ActivationMeter``) and ``unsharded_parameters`` (FSDP's gathered flat parameters, a
recorder counter). On CUDA also the allocator's ``cuda_allocated``, ``cuda_max_allocated`` (since
the job began), ``cuda_reserved``, and ``cuda_context``: what the process holds outside it (NVML).

    with ActivationMeter(model) as act:
        train_step(model, opt, x, y)
    recorder.memory(**memory_by_category(model, opt, activations=act))

``measure_step`` is the one memory-measuring pass; ``ddpkit.memory_formulas`` predicts the same.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import os

import torch

from ddpkit.nested import tensors
from ddpkit.torch_internals import StorageWeakRef, TorchDispatchMode, allocator_history, nvml_index, storage_nbytes

# in the order plots stack them: model states first, then what the ZeRO formulas leave out
CATEGORIES = ("parameters", "gradients", "optimizer_state", "communication_buffers", "activations",
              "unsharded_parameters")
MODEL_STATES = CATEGORIES[:3]  # what the ZeRO formulas count

def _tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied weights, views of one flat buffer
    count once; a freed storage nothing)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):  # a DTensor (fully_shard's parameters): this rank's shard
            t = t.to_local()
        storage = t.untyped_storage()
        key = (storage.data_ptr(), str(t.device))
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _optimizer_state_tensors(optimizer):
    """Per-element state tensors of an optimizer (or of the optimizer a wrapper holds)."""
    state = getattr(optimizer, "state", None)
    for inner in ("local_optimizer", "optimizer", "optim"):  # a wrapper (ShardedOptimizer, torch's
        if not state and hasattr(optimizer, inner):           # ZeroRedundancyOptimizer) keeps its
            state = getattr(optimizer, inner).state          # state in the inner optimizer
    for per_param in (state or {}).values():
        for v in per_param.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:  # skip 0-dim "step" counters
                yield v


def _optimizer_params(optimizer) -> list:
    """The tensors an optimizer steps (ZeRO-1/2: this rank's shards, with their ``.grad``)."""
    return [p for group in getattr(optimizer, "param_groups", None) or () for p in group["params"]]


def model_state_bytes(model, optimizer=None) -> dict[str, int]:
    """``{parameters, gradients, optimizer_state}`` bytes held by this rank right now."""
    params = list(model.parameters()) + (_optimizer_params(optimizer) if optimizer is not None else [])
    return {
        "parameters": _tensor_bytes(params),
        "gradients": _tensor_bytes(p.grad for p in params),
        "optimizer_state": _tensor_bytes(_optimizer_state_tensors(optimizer)) if optimizer is not None else 0,
    }


def memory_by_category(model, optimizer=None, activations=None, device=None) -> dict[str, int]:
    """Every category this rank can measure (see the module docstring), in bytes."""
    out = model_state_bytes(model, optimizer)
    comm = getattr(model, "comm_buffer_bytes", None)
    out["communication_buffers"] = int(comm()) if callable(comm) else 0
    if activations is not None:
        out["activations"] = int(getattr(activations, "peak_bytes", activations))
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if torch.device(device).type == "cuda":
        out.update(cuda_allocator_bytes(device))
    return out


def record_memory(recorder, model, optimizer=None, activations=None) -> dict[str, int]:
    """Measure ``memory_by_category`` and send it to ``recorder.memory``; returns it."""
    sample = memory_by_category(model, optimizer, activations)
    recorder.memory(**sample)
    return sample


def measure_step(model, optimizer, batch, loss, recorder=None, stepped: bool = False) -> dict[str, int]:
    """The memory-measuring pass: forward (``loss(model, batch)`` under ``ActivationMeter``),
    backward, sync, then ``memory_by_category`` with the gradients present (``stepped``: after
    ``optimizer.step()`` too); also sent to ``recorder.memory`` when given."""
    with ActivationMeter(model) as act:  # skips the parameters autograd saves
        value = loss(model, batch)
    value.backward()
    model.finish_gradient_synchronization()
    if stepped:
        optimizer.step()
    sample = memory_by_category(model, optimizer, activations=act)
    if recorder is not None:
        recorder.memory(**sample)
    return sample


def step_memory(model, optimizer, inputs, targets, loss_fn, recorder=None) -> dict[str, int]:
    """One training step measured at the model states' peak (after ``optimizer.step()``)."""
    sample = measure_step(model, optimizer, (inputs, targets), lambda m, b: loss_fn(m(b[0]), b[1]), recorder,
                          stepped=True)
    optimizer.zero_grad(set_to_none=True)
    return sample


class TensorWatch(TorchDispatchMode):
    """Inside ``with TensorWatch() as watch:``: ``watch.peak``, the most bytes the tensors created
    in the block held at once (a storage FSDP freed counts 0), and ``watch.largest``, the largest one;
    on any device, CPU included."""

    def __init__(self):
        super().__init__()
        self._live = {}   # data_ptr -> a weak reference to the storage: a tensor object may die (wrapped
        self.peak = self.largest = 0   # into an nn.Parameter, say) while its storage lives on

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a view or an in-place op hands back an input's storage: nothing was created
        given = {a.untyped_storage().data_ptr() for a in tensors((args, kwargs)) if not a.is_meta}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if torch.is_tensor(t) and not t.is_meta and t.untyped_storage().data_ptr() not in given:
                self._live[t.untyped_storage().data_ptr()] = StorageWeakRef(t.untyped_storage())
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        if self._held() > self.peak:
            gc.collect()   # a new peak? not one of tensors dropped but still in a reference cycle
            self.peak = max(self.peak, self._held())
        return out

    def _held(self) -> int:
        self._live = {k: r for k, r in self._live.items() if not r.expired()}
        return sum(storage_nbytes(r) for r in self._live.values())


class ActivationMeter:
    """Counts the bytes autograd saves for backward inside a ``with`` block (``peak_bytes``).

    Each distinct storage counts once, the model's parameters not at all (they are parameters);
    storages are sized when the block ends, so FSDP's freed gathered parameters count 0."""

    def __init__(self, model=None):
        params = [p.to_local() if hasattr(p, "to_local") else p  # DTensor: this rank's shard
                  for p in (model.parameters() if model is not None else ())]
        self._skip = {p.untyped_storage().data_ptr() for p in params}
        self._seen: dict = {}
        self.peak_bytes = 0
        self._hooks = None

    def _pack(self, t):
        if t.is_leaf and t.requires_grad:  # a parameter, e.g. one FSDP unsharded just now
            return t
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if key not in self._seen and key[0] not in self._skip:
            self._seen[key] = storage  # sized at the end (see the docstring)
        return t

    @staticmethod
    def _unpack(t):
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self.peak_bytes += sum(storage.nbytes() for storage in self._seen.values())
        self._seen = {}  # drop the storages; the byte count stays
        return False

    def __int__(self):
        return self.peak_bytes


def cuda_allocator_bytes(device=None) -> dict[str, int]:
    """The CUDA caching allocator's live, peak and reserved bytes on ``device``, and ``cuda_context``."""
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_allocator_bytes needs CUDA; on CPU use memory_by_category")
    out = {"cuda_allocated": torch.cuda.memory_allocated(device),
           "cuda_max_allocated": torch.cuda.max_memory_allocated(device),
           "cuda_reserved": torch.cuda.memory_reserved(device)}
    context = cuda_context_bytes(device)
    if context is not None:
        out["cuda_context"] = context
    return out


def cuda_context_bytes(device=None) -> int | None:
    """Bytes this process holds on ``device`` outside the caching allocator (NVML's figure minus
    the reserved bytes: mostly the CUDA context); None where NVML cannot tell."""
    used = _nvml_process_bytes(nvml_index(device), os.getpid())
    return None if used is None else max(0, used - torch.cuda.memory_reserved(device))


@functools.cache
def _nvml_handle(index: int):
    """NVML's handle of GPU ``index``, NVML initialised once per process; None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # noqa: BLE001 - no pynvml, no driver library, no such GPU: NVML cannot tell
        return None


def _nvml_process_bytes(index: int, pid: int) -> int | None:
    handle = _nvml_handle(index)
    if handle is None:
        return None
    import pynvml

    try:
        processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:  # noqa: BLE001
        return None
    used = [p.usedGpuMemory for p in processes if p.pid == pid and p.usedGpuMemory is not None]
    return sum(used) if used else None


def reset_cuda_peak(device) -> None:
    """Start ``cuda_max_allocated`` afresh on ``device`` (before every job: ranks outlive jobs)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


@contextlib.contextmanager
def cuda_memory_snapshot(path, max_entries: int = 100_000):
    """Record every CUDA allocation inside the block into ``path`` (open it at https://pytorch.org/memory_viz)."""
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_memory_snapshot records the CUDA allocator; no CUDA device here")
    allocator_history(True, max_entries=max_entries)
    try:
        yield path
    finally:
        allocator_history(False, path=path)


__all__ = [
    "CATEGORIES", "MODEL_STATES", "model_state_bytes", "memory_by_category", "record_memory", "measure_step",
    "step_memory", "ActivationMeter", "TensorWatch", "cuda_allocator_bytes", "cuda_context_bytes",
    "cuda_memory_snapshot", "reset_cuda_peak",
]
