"""BucketedDDP: pack gradients into a few flat buckets, one all-reduce per bucket.

One idea more than ``NaiveDDP``: a ring all-reduce of S bytes over N ranks costs about
2(N-1) alpha + 2(N-1)/N S beta. Per-parameter all-reduces pay the latency alpha once per
tensor; packing the gradients into a few large flat buffers ("buckets") pays it once per
bucket and moves the same bytes. The default MLP (66 tensors, 8.4 MB of fp32 gradients)
fits one 25 MiB bucket: 1 collective per step instead of 66.

Bucket assignment follows torch DDP (``assign_buckets`` below):
- parameters in *reverse* registration order: the last layers' gradients are ready first in
  backward, so the first bucket is the first to fill (``OverlappedDDP`` relies on this);
- a bucket closes once it reaches ``bucket_cap_mb`` MiB, so the tensor that crosses the cap
  stays in it; ``0`` means one parameter per bucket; a negative cap is a ``ValueError``;
- a bucket holds one dtype on one device (it is a single flat tensor);
- frozen parameters are left out, tied parameters are in once.
(torch DDP additionally caps its first bucket at 1 MiB when ``bucket_cap_mb`` is left at its
default, and rebuilds the buckets once in the order gradients actually arrived; we don't.)

Copies, not views: after backward each gradient is copied into its bucket slot (scaled by
1/N on the way), the bucket is all-reduced, and the averaged values are copied back into
``.grad``. Cost: memory, one extra copy of all gradients (the buckets, ``comm_buffer_bytes()``,
8.4 MB for the default MLP); time, one copy in and one copy out per step (cheap next to the
network). torch DDP's ``gradient_as_bucket_view=True`` points ``.grad`` at its bucket slot
instead, saving the extra memory and the copy out; plain copies are simpler to follow.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.strategies._common import DDPModule, nbytes


@dataclass
class Bucket:
    """One bucket as plain data (for plots and exercises): which gradients, how many bytes."""

    index: int
    names: list[str]   # parameter names, in the order they sit in the flat buffer
    numels: list[int]  # elements of each parameter, same order
    nbytes: int        # bytes of the flat buffer = bytes this bucket's all-reduce reduces
    dtype: str
    device: str


def bucket_cap_bytes(bucket_cap_mb: float) -> float:
    """The cap in bytes (MiB as in torch DDP); ValueError unless it is a number >= 0."""
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
            or not bucket_cap_mb >= 0:  # `not >=` also rejects NaN
        raise ValueError(f"bucket_cap_mb must be a number of MiB >= 0, got {bucket_cap_mb!r}")
    return int(bucket_cap_mb * 1024 * 1024) if math.isfinite(bucket_cap_mb) else math.inf


def assign_buckets(named_params, bucket_cap_mb: float) -> list[list[str]]:
    """Names of the tensors in each bucket, bucket by bucket, as torch DDP assigns them.

    ``named_params``: (name, tensor) pairs in registration order (e.g. from
    ``unique_named_parameters``). Walks them in reverse; each (dtype, device) has one open
    bucket; a tensor joins its open bucket, and the bucket closes once it holds >= the cap.
    Buckets come out ordered by their first tensor, i.e. in the order they will fill.
    """
    cap = bucket_cap_bytes(bucket_cap_mb)
    buckets: list[list[str]] = []
    open_bucket: dict = {}  # (dtype, device) -> [index into buckets, bytes so far]
    for name, t in reversed(list(named_params)):
        kind = (t.dtype, t.device)
        if kind not in open_bucket:
            open_bucket[kind] = [len(buckets), 0]
            buckets.append([])
        index, size = open_bucket[kind]
        buckets[index].append(name)
        open_bucket[kind][1] = size = size + nbytes(t)
        if size >= cap:  # the tensor that crossed the cap stays in the bucket just closed
            del open_bucket[kind]
    return buckets


class BucketedDDP(DDPModule):
    """Copy gradients into flat buckets after backward and all-reduce each bucket once."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, process_group=None,
                 recorder=None):
        bucket_cap_bytes(bucket_cap_mb)  # a bad cap fails before any communication
        super().__init__(module, process_group, recorder)
        self.bucket_cap_mb = bucket_cap_mb
        self._scale = 1.0 / self.world_size  # gradients enter the buckets pre-averaged
        params = dict(self.named_grads)
        self.buckets: list[Bucket] = []
        self._flat: list[torch.Tensor] = []  # bucket i's buffer, allocated once: (numel_i,)
        self._slots: list[list] = []         # bucket i: [(param, view of its slot in _flat[i])]
        for i, names in enumerate(assign_buckets(self.named_grads, bucket_cap_mb)):
            first = params[names[0]]
            numels = [params[n].numel() for n in names]
            flat = torch.empty(sum(numels), dtype=first.dtype, device=first.device)
            slots, offset = [], 0
            for name, numel in zip(names, numels):
                p = params[name]
                slots.append((p, flat[offset:offset + numel].view_as(p)))
                offset += numel
            self._flat.append(flat)
            self._slots.append(slots)
            self.buckets.append(Bucket(i, names, numels, nbytes(flat), str(flat.dtype), str(flat.device)))
        self._register_hooks()

    def _register_hooks(self) -> None:
        if not self.recorder.enabled:
            return  # recording off: no hooks, nothing to pay
        # Hooks only to *record* when each gradient becomes ready (the bucket fill order);
        # the reduction itself still waits for the end of backward.
        recorder = self.recorder
        for i, bucket in enumerate(self.buckets):
            for name, (p, _) in zip(bucket.names, self._slots[i]):
                p.register_post_accumulate_grad_hook(
                    lambda p, name=name, i=i: recorder.grad_ready(name, bucket=i))

    def _copy_into_bucket(self, p: nn.Parameter, slot: torch.Tensor) -> None:
        # Scale by 1/N on the way in, *before* the SUM: ReduceOp.AVG is not on every backend,
        # and a sum of already-scaled values cannot overflow in low precision. A multiply by
        # 1/N (as torch's reducer does) is cheaper than a divide; detach() keeps the copy out
        # of any autograd graph (.grad has one under backward(create_graph=True)).
        if p.grad is None:
            slot.zero_()  # not used in this step on this rank: contribute zeros
        else:
            torch.mul(p.grad.detach(), self._scale, out=slot)

    def _copy_out_of_bucket(self, i: int) -> None:
        for p, slot in self._slots[i]:
            if p.grad is None:  # unused on this rank: it still gets the ranks' average
                p.grad = slot.clone()
            else:
                p.grad.copy_(slot)

    def _launch(self, i: int):
        work = dist.all_reduce(self._flat[i], op=dist.ReduceOp.SUM, group=self.process_group,
                               async_op=True)
        self.recorder.collective("all_reduce", work, nbytes=self.buckets[i].nbytes, bucket=i)
        return work

    @torch.no_grad()
    def _sync_gradients(self) -> None:
        works = []
        for i in range(len(self.buckets)):
            for p, slot in self._slots[i]:
                self._copy_into_bucket(p, slot)
            works.append(self._launch(i))  # async: packing bucket i+1 overlaps bucket i's send
        for i, work in enumerate(works):
            work.wait()
            self._copy_out_of_bucket(i)

    def comm_buffer_bytes(self) -> int:
        """Bytes of the flat buckets: one extra copy of every reduced gradient."""
        return sum(nbytes(flat) for flat in self._flat)
