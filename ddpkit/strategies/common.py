"""What every strategy shares: construction checks, rank-0 broadcast, FSDP's units, clipping, timing
(a forward, and a backward as its "backward" and "sync" spans: ``BackwardSpans``).

Strategies report through the recorder seam (``ddpkit.trace.seam``; ``NullRecorder`` when off) and
never store or draw it. The DDP wrappers' core is ``ddp_module.DDPModule``, torch DDP's extras
``ddp_compat.TorchDDPCompat``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.strategies.flat_layout import FlatLayout
from ddpkit.torch_internals import copy_all, first_tensor, queue_at_end_of_backward
from ddpkit.trace.seam import NULL_RECORDER


def require_process_group(strategy: str, group=None) -> None:
    """Fail clearly before init_process_group, or on a ``group`` this process is not in."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{strategy} needs a process group: call torch.distributed.init_process_group() "
            "first, or build it inside a job run by ddpkit.Cluster.run() or under torchrun."
        )
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(f"{strategy}: this process (global rank {dist.get_rank()}) is not a member "
                         "of the process_group it was given")


def unique_named_parameters(module: nn.Module, trainable_only: bool = True):
    """(name, parameter) pairs with tied parameters listed once, frozen ones skipped."""
    seen = set()
    for name, p in module.named_parameters():  # named_parameters() already drops duplicates
        if id(p) in seen or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        yield name, p


def _trainable(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def default_units(module: nn.Module) -> list[nn.Module]:
    """FSDP's default units: the trainable members of the biggest ``nn.ModuleList`` (a transformer's
    layers), else each trainable child (GPT-2's children would be one unit, the whole model)."""
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
    if lists:
        blocks = [m for m in max(lists, key=_trainable) if _trainable(m)]  # the first of equals
        if blocks:
            return blocks
    return [m for m in module.children() if _trainable(m)]


def resolve_units(module: nn.Module, units) -> list[nn.Module]:
    """FSDP units as modules in ``module``'s order (alike on every rank): a class stands for each
    submodule of it; one matching nothing, or a module outside ``module``, is a ValueError."""
    items = [units] if isinstance(units, type) else list(units)
    classes = tuple(u for u in items if isinstance(u, type))
    given = {id(u) for u in items if not isinstance(u, type) and u is not module}  # the root: a unit anyway
    for u in items:
        if not isinstance(u, (type, nn.Module)):
            raise TypeError(f"FSDP units must be nn.Modules or module classes, got {type(u).__name__}")
    inside = list(module.modules())[1:]  # the root is always a unit of its own
    for cls in classes:
        if not any(isinstance(m, cls) for m in inside):
            raise ValueError(f"FSDP units: no submodule of {type(module).__name__} is a {cls.__name__}")
    chosen = [m for m in inside if id(m) in given or (classes and isinstance(m, classes))]
    missing = given - {id(m) for m in chosen}
    if missing:
        stray = next(u for u in items if id(u) in missing)
        raise ValueError(f"FSDP unit {type(stray).__name__} is not a submodule of the wrapped "
                         f"{type(module).__name__}: units must be modules inside it")
    return chosen


def check_same_shapes(module: nn.Module, group=None) -> None:
    """Raise naming the first parameter or buffer whose shape or dtype differs across ranks (all
    ranks all-gather their lists first), where the later broadcasts would hang."""
    named = [("parameter", n, t) for n, t in module.named_parameters()] + \
            [("buffer", n, t) for n, t in module.named_buffers()]
    shapes = [(f"{kind} {name!r}", tuple(t.shape), str(t.dtype)) for kind, name, t in named]
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, shapes, group=group)
    mine = gathered[0]
    for other_rank, theirs in enumerate(gathered[1:], start=1):
        if len(theirs) != len(mine):
            raise ValueError(
                f"rank 0 has {len(mine)} parameters and buffers, rank {other_rank} has "
                f"{len(theirs)}: every rank must wrap the same model"
            )
        for (name, s0, d0), (_, s1, d1) in zip(mine, theirs, strict=True):
            if (s0, d0) != (s1, d1):
                raise ValueError(
                    f"{name} has shape {list(s0)} ({d0}) on rank 0 but "
                    f"{list(s1)} ({d1}) on rank {other_rank}: every rank must wrap the same model"
                )


BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # torch DDP's broadcast_bucket_size at construction


@torch.no_grad()
def broadcast_from_rank0(tensors: Iterable[torch.Tensor], group=None,
                         bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> None:
    """Copy rank 0's values into every rank's tensors (meta ones: once real, by deferred init),
    coalesced as torch's DDP does at construction: the tensors of one dtype and device packed into
    one flat buffer of up to ``bucket_bytes`` (250 MiB), one broadcast each, copied back; not a
    broadcast per tensor (``bucket_bytes=0``: one each, no flat copy, as deferred init wants).

    Besides the collectives saved, the flat buffer leaves the process's allocator as torch's DDP
    leaves it. glibc's malloc serves a large request with mmap and, once such a block is freed,
    raises its mmap threshold to that block's size and its trim threshold to twice that. With
    the model's whole state freed once here, each gradient of a step (no larger) comes from the
    heap, and the step's gradients freed by ``zero_grad()`` stay there for the next backward.
    Without it, a model of a few large tensors had its heap trimmed and refaulted every step
    (``benchmarks/bench_drop_in.py`` measures the difference; docs/own_script.md has the figures).
    """
    src = dist.get_global_rank(group, 0) if group is not None else 0
    mine = dist.get_rank() == src
    for chunk in _same_kind_chunks([t.data for t in tensors if not t.is_meta], bucket_bytes):
        if len(chunk) == 1:
            dist.broadcast(chunk[0], src=src, group=group)
            continue
        layout = FlatLayout.of(chunk)
        flat = layout.empty(chunk[0].dtype, chunk[0].device)
        views = layout.views(flat)
        if mine:
            copy_all(views, chunk)
        dist.broadcast(flat, src=src, group=group)
        if not mine:
            copy_all(chunk, views)


def _same_kind_chunks(tensors: list, cap_bytes: int) -> list[list]:
    """``tensors`` grouped by (dtype, device), in order, each group cut into runs of at most
    ``cap_bytes`` (a tensor larger than that on its own)."""
    kinds: dict = {}
    for t in tensors:
        kinds.setdefault((t.dtype, t.device), []).append(t)
    chunks = []
    for group in kinds.values():
        run, size = [], 0
        for t in group:
            if run and size + nbytes(t) > cap_bytes:
                chunks.append(run)
                run, size = [], 0
            run.append(t)
            size += nbytes(t)
        chunks.append(run)
    return chunks


def prepare_module(strategy: str, module: nn.Module, group=None, params: bool = True, buffers: bool = True) -> None:
    """Check, then broadcast rank 0's parameters and buffers (either left out: torch's ``init_sync``)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{strategy} wraps an nn.Module, got {type(module).__name__}")
    require_process_group(strategy, group)
    check_same_shapes(module, group)
    broadcast_from_rank0((list(module.parameters()) if params else []) + (list(module.buffers()) if buffers else []),
                         group)


def nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements (numel x element size)."""
    return t.numel() * t.element_size()


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, norm_type: float = 2.0, sharded: bool = False, group=None,
                    recorder=NULL_RECORDER) -> torch.Tensor:
    """Scale ``params``' ``.grad`` so the *whole* gradient's norm is at most ``max_norm``, as one process's
    ``clip_grad_norm_``; ``sharded``: disjoint shards, local norms combined across ``group``."""
    params = list(params)
    if not sharded:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    norm_type = float(norm_type)
    grads = [p.grad for p in params if p.grad is not None]
    device = params[0].device if params else torch.device("cpu")
    norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
    local = torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms else torch.zeros((), device=device)
    inf = norm_type == float("inf")
    total = local if inf else local.pow(norm_type)  # (1,) sums over ranks; the inf-norm takes the max
    with recorder.labels():  # a collective of this wrapper's, no bucket or unit
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
    if not inf:
        total = total.pow(1.0 / norm_type)
    clip = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as torch's: never scale up
    for g in grads:
        g.mul_(clip.to(g.dtype))
    return total


def forward_timed(recorder, module: nn.Module, args, kwargs):
    """``module(*args, **kwargs)``; in a loop that does not time its own steps (not ``train_step``)
    also a "forward" span, and its backward as ``BackwardSpans``: the compute lane, whatever loop."""
    if recorder.loop_spans:
        return module(*args, **kwargs)
    with recorder.span("forward", cat="compute"):
        out = module(*args, **kwargs)
    first = first_tensor(out)
    if first is not None and first.requires_grad:
        BackwardSpans(recorder, first, opened=False)
    return out


class BackwardSpans:
    """One backward on the compute lane: "backward", then (``opened``: ``train_batch``'s) "sync" until
    ``close()``; "backward" opens now, or when the gradient reaches ``tensor``."""

    def __init__(self, recorder, tensor: torch.Tensor, opened: bool = True):
        self.recorder, self.sync_follows = recorder, opened
        self.span = self.phase = None  # the span open now, and which: "backward", "sync" ("done" after)
        self.queued = False
        if opened:
            self._enter("backward")
        tensor.register_hook(self._reached)

    def _enter(self, phase: str) -> None:
        self.span, self.phase = self.recorder.span(phase, cat="compute").__enter__(), phase

    def _reached(self, grad) -> None:
        if self.phase is None:
            self._enter("backward")
        if not self.queued:
            self.queued = queue_at_end_of_backward(self.autograd_done)

    def autograd_done(self) -> None:
        """Autograd has computed every gradient: "backward" ends, "sync" begins (once)."""
        if self.phase != "backward":
            return
        self.span.__exit__(None, None, None)
        self.phase = "done"
        if self.sync_follows:
            self._enter("sync")

    def close(self) -> None:
        """The sync is over: "sync" ends (once)."""
        self.autograd_done()  # where torch could queue no callback, backward() has returned by now
        if self.phase == "sync":
            self.span.__exit__(None, None, None)
            self.phase = "done"


@contextlib.contextmanager
def no_sync(wrapper):
    """``wrapper.no_sync()``: gradients of forwards inside accumulate locally (``_require_sync``)."""
    previous, wrapper._require_sync = wrapper._require_sync, False
    try:
        yield
    finally:
        wrapper._require_sync = previous
