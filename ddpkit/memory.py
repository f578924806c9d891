"""Memory per rank by category, measured inside the rank.

Categories (bytes, per rank; ``CATEGORIES``, the one list of them, in the order plots stack them):
- ``parameters``: the tensors ``model.parameters()`` yields (for FSDP: the local shards);
- ``gradients``: their ``.grad`` tensors (absent after ``zero_grad(set_to_none=True)``);
- ``optimizer_state``: per-element optimizer state (SGD momentum, Adam's exp_avg and
  exp_avg_sq); the 0-dim ``step`` counters are left out, as the ZeRO formulas leave them out;
- ``communication_buffers``: the wrapper's ``comm_buffer_bytes()`` (buckets, gathered flat
  parameters) where it has one;
- ``activations``: bytes autograd saved for backward during a forward, measured with
  ``ActivationMeter`` (``torch.autograd.graph.saved_tensors_hooks``);
- ``unsharded_parameters``: FSDP's gathered flat parameters, which it reports itself while it
  holds them (a memory counter in the recorder: ``memory_sweep`` reads its most).
On CUDA, also the caching allocator's ``cuda_allocated``, ``cuda_max_allocated`` (the peak
since the job began: a Cluster's ranks live across jobs, and each job starts from
``reset_cuda_peak``) and ``cuda_reserved`` (what it holds from the GPU, freed blocks included), and
``cuda_context``: what the rank's process holds on its GPU *outside* the allocator, mostly its CUDA
context (the driver's state and the kernels it loaded: hundreds of MiB per process, so N ranks
sharing one GPU pay it N times), where NVML can tell (``cuda_context_bytes``). The model states
are the categories above; none of this is in them.

    with ActivationMeter(model) as act:
        train_step(model, opt, x, y)
    recorder.memory(**memory_by_category(model, opt, activations=act))

or, to catch the gradients before ``zero_grad`` frees them, the one memory-measuring pass:
``measure_step(model, opt, batch, loss)`` (forward, backward, sync, measure).

What the ZeRO formulas predict for the same run is ``ddpkit.memory_formulas``'s. The measurements of
a whole run per strategy are ``experiment.run_strategy``'s and ``compare``'s (``memory``: per rank,
by category), for any ``ddpkit.Workload``.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import os

import torch

from ddpkit.nested import tensors
from ddpkit.torch_internals import StorageWeakRef, TorchDispatchMode, allocator_history, nvml_index, storage_nbytes

# Every category, in the order plots stack them: model states first, then what the ZeRO formulas
# leave out.
CATEGORIES = ("parameters", "gradients", "optimizer_state", "communication_buffers", "activations",
              "unsharded_parameters")
MODEL_STATES = CATEGORIES[:3]  # what the ZeRO formulas count

def _tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``: a tensor seen twice (a tied weight), or
    several views of one flat buffer (ZeRO-1/2's parameters and the shards their optimizer steps),
    count once; a freed storage (FSDP's resharded buffers) counts nothing."""
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
    """The tensors an optimizer steps (ZeRO-1/2: this rank's shards, whose ``.grad`` is all that
    is left of the gradients once ZeRO-2 has freed the full ones)."""
    return [p for group in getattr(optimizer, "param_groups", None) or () for p in group["params"]]


def model_state_bytes(model, optimizer=None) -> dict[str, int]:
    """``{parameters, gradients, optimizer_state}`` bytes held by this rank right now: the
    model's parameters and the optimizer's (distinct storages, see ``_tensor_bytes``), their
    ``.grad``, and the optimizer's per-element state."""
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
    """The memory-measuring pass: forward (``loss(model, batch)``, a scalar; the bytes it saved
    for backward counted by ``ActivationMeter``), backward, the gradients' sync, then what this
    rank holds (``memory_by_category``, also sent to ``recorder.memory`` when given). Measured with
    the gradients present, as in the middle of a step; ``stepped``: after ``optimizer.step()`` too,
    when parameters, gradients and optimizer state all exist. The caller steps, or not, and drops
    the gradients (``zero_grad``) after."""
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
    """One training step (as ``ddpkit.experiment.train_step`` does) measured at the peak of the
    model states: ``measure_step`` after ``optimizer.step()``, then ``zero_grad``."""
    sample = measure_step(model, optimizer, (inputs, targets), lambda m, b: loss_fn(m(b[0]), b[1]), recorder,
                          stepped=True)
    optimizer.zero_grad(set_to_none=True)
    return sample


class TensorWatch(TorchDispatchMode):
    """Inside ``with TensorWatch() as watch:``, every tensor an operator creates is watched:
    ``watch.peak`` is the most bytes they held at once (their storages' sizes now: a storage FSDP
    freed counts 0; garbage is collected before a new peak counts), ``watch.largest`` the largest
    single one. On any device, CPU included, where there is no allocator to ask. Tensors that
    existed before the block are not counted.

    Shows e.g. that FSDP's deferred initialization never holds the whole model on a rank."""

    def __init__(self):
        super().__init__()
        self._live = {}   # data_ptr -> a weak reference to the storage: a tensor object may die (wrapped
        self.peak = self.largest = 0   # into an nn.Parameter, say) while its storage lives on

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a view or an in-place op hands back an input's storage: nothing was created (a slice of
        # the shared-memory transport's slab, say, is not 32 MiB more)
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
    """Counts the bytes autograd saves for backward inside a ``with`` block.

    Every tensor saved for backward passes through the pack hook. We count each distinct
    storage once (a view keeps its whole storage alive, and two saved views of one tensor
    share it), and skip the model's parameters -- they are saved too (``Linear`` keeps its
    weight for the input gradient) but are counted as parameters. Saved tensors are freed
    only as backward consumes them, so the total at the end of one forward is the peak.
    Storages are sized when the block ends: FSDP's gathered parameters, saved as views but
    freed after each unit's forward (and gathered again for backward), count 0, not a unit.
    Wrap one forward (or one training step); ``peak_bytes`` is the result.
    """

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


# ----------------------------------------------------------------------------- CUDA only
def cuda_allocator_bytes(device=None) -> dict[str, int]:
    """The CUDA caching allocator's live, peak and reserved bytes on ``device``, and the process's
    bytes outside it (``cuda_context``, where NVML can tell; see the module docstring). CUDA only."""
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
    """Bytes this process holds on ``device`` outside the caching allocator: NVML's figure for this
    process (what ``nvidia-smi`` lists for it) minus the allocator's reserved bytes. Mostly the CUDA
    context (the driver's state, the kernels loaded); also what libraries allocate past the
    allocator (NCCL's buffers). None where NVML cannot tell: no ``nvidia-ml-py`` (``pynvml``), or a
    container whose process ids NVML does not see."""
    used = _nvml_process_bytes(nvml_index(device), os.getpid())
    return None if used is None else max(0, used - torch.cuda.memory_reserved(device))


@functools.cache
def _nvml_handle(index: int):
    """NVML's handle of GPU ``index`` (NVML's numbering), NVML initialised once per process; None
    where there is no NVML."""
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
    """Start ``cuda_max_allocated`` afresh on ``device`` (a GPU; nothing for the CPU). A Cluster's
    worker calls it before every job: its ranks outlive jobs, and a peak counted since the rank
    started would carry the last job's (a bigger model's, a comparison's) into this one."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


@contextlib.contextmanager
def cuda_memory_snapshot(path, max_entries: int = 100_000):
    """Record every CUDA allocation inside the block; write a snapshot to ``path`` at the end.

    Open the file at https://pytorch.org/memory_viz. CUDA only: raises on CPU.
    """
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
