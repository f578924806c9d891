"""Buckets: gradients packed into one flat buffer, so that one collective carries many of them.

``assign_buckets`` says which tensors share a bucket (torch DDP's rule, the cost model's too),
``layout`` the caps; a ``Bucket`` is a flat buffer with a slot per gradient and this step's
progress, used in four calls: ``copy_in``, ``all_reduce`` (or a comm hook), ``wait``, ``copy_out``.
``InOrder`` launches them from the hooks strictly in order (OverlappedDDP, ZeRO-2).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ddpkit.strategies.common import nbytes
from ddpkit.strategies.flat_layout import FlatLayout
from ddpkit.torch_internals import copy_all


DEFAULT_CAP_MB = 25.0   # torch DDP's bucket_cap_mb
FIRST_BUCKET_MB = 1.0   # torch DDP's first bucket, while the cap is left at its default


def layout(bucket_cap_mb: float | None, first_bucket_mb: float | None = None) -> tuple[float, float | None]:
    """(every bucket's cap, the first's or None) in MiB, checked, by torch DDP's rule: None is 25 MiB
    with a 1 MiB first bucket (the first gradients travel early); a cap given applies to all."""
    if bucket_cap_mb is None:
        bucket_cap_mb, first_bucket_mb = DEFAULT_CAP_MB, FIRST_BUCKET_MB if first_bucket_mb is None else first_bucket_mb
    bucket_cap_bytes(bucket_cap_mb)
    if first_bucket_mb is not None:
        bucket_cap_bytes(first_bucket_mb)
    return bucket_cap_mb, first_bucket_mb


def bucket_cap_bytes(bucket_cap_mb: float) -> float:
    """The cap in bytes (MiB, as in torch DDP); ValueError unless it is a number >= 0."""
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
            or not bucket_cap_mb >= 0:  # `not >=` also rejects NaN
        raise ValueError(f"bucket_cap_mb must be a number of MiB >= 0, got {bucket_cap_mb!r}")
    return int(bucket_cap_mb * 1024 * 1024) if math.isfinite(bucket_cap_mb) else math.inf


def assign_buckets(sizes: list[int], cap_bytes: float, kinds: list | None = None,
                   first_cap_bytes: float | None = None) -> list[list[int]]:
    """Indices into ``sizes`` (bytes per tensor, registration order), bucket by bucket, in the order
    they fill. torch DDP's rule: walk the tensors in *reverse*; each kind (``kinds[i]``, e.g.
    (dtype, device)) has one open bucket, which closes once it holds >= ``cap_bytes`` (the tensor
    crossing the cap stays in); ``first_cap_bytes`` caps each kind's first bucket instead.
    """
    if not cap_bytes >= 0 or (first_cap_bytes is not None and not first_cap_bytes >= 0):
        raise ValueError(f"bucket caps must be >= 0 bytes, got {cap_bytes}, {first_cap_bytes}")
    kinds = kinds if kinds is not None else [None] * len(sizes)
    buckets: list[list[int]] = []
    open_bucket: dict = {}  # kind -> [index into buckets, bytes so far]
    closed: set = set()     # kinds whose first bucket has closed
    for i in reversed(range(len(sizes))):
        kind = kinds[i]
        if kind not in open_bucket:
            open_bucket[kind] = [len(buckets), 0]
            buckets.append([])
        index, size = open_bucket[kind]
        buckets[index].append(i)
        open_bucket[kind][1] = size = size + sizes[i]
        cap = first_cap_bytes if first_cap_bytes is not None and kind not in closed else cap_bytes
        if size >= cap:
            del open_bucket[kind]
            closed.add(kind)
    return buckets


class Bucket:
    """One bucket: a flat buffer with a slot per gradient, and this step's progress."""

    def __init__(self, index: int, named_params: list, grads_as_views: bool = False):
        self.index = index
        self.names = [name for name, _ in named_params]   # in the order they sit in the buffer
        self.params = [p for _, p in named_params]
        first = self.params[0]
        # The flat buffer, allocated once: (sum of numels,), no padding; each slot a view shaped like
        # its parameter, so copying a gradient in is one copy_.
        self.layout = FlatLayout.of(self.params)
        self.flat = self.layout.empty(first.dtype, first.device)
        self.slots = self.layout.views(self.flat)
        self.grads_as_views = grads_as_views  # torch DDP's gradient_as_bucket_view: .grad becomes its slot
        self._scale = (None, None)  # (copy_in's scale, as a 0-dim tensor)
        self.reset()

    @property
    def nbytes(self) -> int:
        """Bytes of the flat buffer = bytes this bucket's all-reduce reduces."""
        return nbytes(self.flat)

    def reset(self) -> None:
        """A new step: every gradient missing, nothing launched."""
        self.ready = [False] * len(self.params)
        self.missing = len(self.params)
        self.work = None     # the all-reduce's handle, or
        self.future = None   # a comm hook's future of the reduced buffer

    def copy_in(self, j: int, scale: float) -> None:
        """Gradient j into its slot, times ``scale``; zeros if it has none (unused this step)."""
        p, slot = self.params[j], self.slots[j]
        # Scale on the way in, *before* the SUM: ReduceOp.AVG is not on every backend, and a sum of
        # scaled values cannot overflow in low precision; detach(): no graph (create_graph=True).
        if p.grad is None:
            slot.zero_()
        elif self.grads_as_views and self.is_slot(j):
            slot.mul_(scale)  # the gradient was accumulated in its slot: scaled in place, no copy
        else:  # scale as a 0-dim tensor, made once: a Python float costs a wrapped scalar per call
            if self._scale[0] != scale:
                self._scale = (scale, torch.tensor(scale, dtype=slot.dtype))
            grad = p.grad
            torch.mul(grad.detach() if grad.requires_grad else grad, self._scale[1], out=slot)
            if self.grads_as_views and p.grad.grad_fn is None:
                p.grad = slot  # from now on backward accumulates into the slot itself
        self.ready[j] = True
        self.missing -= 1

    def buffer_bytes(self) -> int:
        """Bytes of the flat buffer that are not some parameter's ``.grad`` now (``grads_as_views``)."""
        return self.nbytes - sum(slot.nbytes for j, slot in enumerate(self.slots)
                                 if self.grads_as_views and self.is_slot(j))

    def is_slot(self, j: int) -> bool:
        """Is gradient j its slot of the flat buffer (``grads_as_views``), not a tensor of its own?"""
        grad, slot = self.params[j].grad, self.slots[j]
        return grad is not None and grad.data_ptr() == slot.data_ptr() and grad.shape == slot.shape

    def all_reduce(self, group, recorder, hook=None) -> None:
        """Launch the async all-reduce (SUM) of the whole buffer, or hand the bucket to a comm
        ``hook(bucket, group, recorder)``, which launches its own reduction and returns a future
        of the reduced buffer; ``wait()`` finishes either."""
        if hook is not None:
            self.future = hook(self, group, recorder)
            if not callable(getattr(self.future, "wait", None)):
                name = getattr(hook, "__qualname__", repr(hook))
                raise TypeError(f"comm hook {name} returned {type(self.future).__name__} for bucket {self.index}: a "
                                "hook must return a torch.futures.Future of the reduced buffer (comm_hooks.py)")
            return
        with recorder.labels(bucket=self.index):
            self.work = dist.all_reduce(self.flat, op=dist.ReduceOp.SUM, group=group, async_op=True)

    def wait(self) -> None:
        if self.future is None:
            self.work.wait()
            return
        reduced = self.future.wait()  # e.g. an fp16 sum decompressed back to the buffer's dtype
        if reduced is not self.flat:
            self.flat.copy_(reduced)

    def copy_out(self) -> None:
        """The reduced slots back into ``.grad`` (a parameter unused here gets the average too;
        with ``find_unused_parameters`` one no rank used is set back to None afterwards)."""
        grads, slots = [], []  # copied in one call (``copy_all``), not one call per tensor
        for j, (p, slot) in enumerate(zip(self.params, self.slots, strict=True)):
            if self.grads_as_views and (p.grad is None or self.is_slot(j)):
                p.grad = slot  # nothing to copy: the gradient is its slot
            elif p.grad is None:
                p.grad = slot.clone()
            else:
                grads.append(p.grad)
                slots.append(slot)
        if grads:
            copy_all(grads, slots)


class InOrder:
    """One step's buckets launched from the hooks strictly in bucket order (a bucket complete early
    waits), so every rank issues the same collectives in the same order; this keeps which is next."""

    def __init__(self, buckets: list):
        self.buckets = buckets
        for bucket in buckets:
            bucket.reset()  # every gradient missing, nothing launched
        self.launched = 0   # buckets[:launched] are launched

    def copy_in(self, bucket, j: int, scale: float) -> None:
        """Gradient j of ``bucket`` into its slot, times ``scale``, once per step."""
        if bucket.ready[j]:
            raise RuntimeError(f"the gradient of {bucket.names[j]!r} became ready twice in one step; each "
                               "gradient must arrive once per backward")
        bucket.copy_in(j, scale)  # of .grad detached: no autograd graph, even under create_graph=True

    def due(self):
        """The complete buckets next in order, each yielded once (launch it: it counts as launched)."""
        while self.launched < len(self.buckets) and self.buckets[self.launched].missing == 0:
            self.launched += 1
            yield self.buckets[self.launched - 1]

    def complete_the_rest(self, scale: float) -> None:
        """The end of backward: a gradient that never arrived (its parameter unused in this forward)
        goes in as its ``.grad`` holds it (what ``no_sync()`` accumulated), or as zeros."""
        for bucket in self.buckets[self.launched:]:
            for j, ready in enumerate(bucket.ready):
                if not ready:
                    bucket.copy_in(j, scale)


def make_buckets(named_params: list, bucket_cap_mb: float | None, bucket=Bucket,
                 first_bucket_mb: float | None = None) -> list:
    """The buckets for ``named_params`` ((name, parameter), registration order): one
    ``bucket(index, [(name, parameter), ...])`` each (ZeRO-1/2 pass their sharded bucket).
    The caps follow ``layout``: None is torch DDP's default (25 MiB, the first bucket 1 MiB)."""
    bucket_cap_mb, first_bucket_mb = layout(bucket_cap_mb, first_bucket_mb)
    cap = bucket_cap_bytes(bucket_cap_mb)
    first = None if first_bucket_mb is None else bucket_cap_bytes(first_bucket_mb)
    sizes = [nbytes(p) for _, p in named_params]
    kinds = [(p.dtype, p.device) for _, p in named_params]  # a bucket is one flat tensor
    return [bucket(i, [named_params[k] for k in indices])
            for i, indices in enumerate(assign_buckets(sizes, cap, kinds, first_cap_bytes=first))]
