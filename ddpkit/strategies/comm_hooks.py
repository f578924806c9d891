"""Communication hooks: how a bucket of ``BucketedDDP`` / ``OverlappedDDP`` is reduced, swappable.

torch DDP lets you replace the all-reduce of each bucket with your own function (the DDP paper's
"communication hook"; torch's ``register_comm_hook``, ``docs/papers.md``). Ours has the same
shape on our buckets, and a hook of this file can be chosen by its name in ``COMM_HOOKS``::

    model = ddpkit.OverlappedDDP(module, comm_hook="bf16_compress")   # by name, at construction
    model = ddpkit.OverlappedDDP(module)
    model.register_comm_hook(fp16_compress_hook)                       # or torch's way: the function

    def hook(bucket, process_group, recorder) -> torch.futures.Future:
        # bucket.flat: the bucket's flat buffer, (sum of numels,), every gradient already x 1/N.
        # Launch the reduction (async) and return a future whose value is the reduced buffer
        # (bucket.flat itself, or a tensor of its size that the bucket copies back in).

The wrapper calls the hook where it would launch the bucket's all-reduce and waits for its future
where it would wait; every rank must run the same hook. By name it reaches every strategy whose
buckets take one (``Strategy.takes_comm_hook``) through ``compare``, ``--comm-hook``,
``run_strategy`` and the cost model (``CostStep.comm_hook``). Adding a hook touches this file only:
write it, label its collectives with the bucket, give it a row in ``COMM_HOOKS`` (bytes per element
sent, passes over the bucket), test it in ``tests/test_ddp.py``.

Built in: ``allreduce_hook``, ``fp16_compress_hook`` and ``bf16_compress_hook`` (cast to 16 bits,
all-reduce, cast back: half the bytes, every gradient rounded; fp16 cannot overflow in the sum
since gradients are divided by N first; how far each lands from one process: ``docs/papers.md``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


def allreduce_hook(bucket, process_group, recorder) -> torch.futures.Future:
    """The default: all-reduce (SUM) the bucket's buffer in place."""
    with recorder.labels(bucket=bucket.index):
        work = dist.all_reduce(bucket.flat, group=process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _compress_hook(dtype: torch.dtype):
    def hook(bucket, process_group, recorder) -> torch.futures.Future:
        compressed = bucket.flat.to(dtype)  # (numel,) in 16 bits: half the bytes to send
        with recorder.labels(bucket=bucket.index):
            work = dist.all_reduce(compressed, group=process_group, async_op=True)
        # decompress when the sum has arrived: the bucket copies this back into its buffer
        return work.get_future().then(lambda fut: fut.value()[0].to(bucket.flat.dtype))

    return hook


fp16_compress_hook = _compress_hook(torch.float16)
fp16_compress_hook.__doc__ = "All-reduce the bucket in fp16 (half the bytes), then back to its dtype."
bf16_compress_hook = _compress_hook(torch.bfloat16)
bf16_compress_hook.__doc__ = "All-reduce the bucket in bf16 (half the bytes), then back to its dtype."


@dataclass(frozen=True)
class CommHook:
    """A hook by name: the function, and what the cost model (``ddpkit.costmodel``) needs of it."""

    hook: Callable                  # hook(bucket, process_group, recorder) -> Future of the reduced buffer
    wire_itemsize: int | None = None  # bytes per element it sends (None: the gradient's own)
    passes: tuple[int, int] = (0, 0)  # passes over the bucket it makes on the rank: before its
                                      # launch, after its wait (casts, the copy back into the buffer)

    def wire_bytes(self, nbytes: float, itemsize: int) -> float:
        """Bytes on the wire for a bucket of ``nbytes`` of ``itemsize``-byte gradients."""
        return nbytes if self.wire_itemsize is None else nbytes * self.wire_itemsize / itemsize


# cast down before the launch; after it, cast back up and copy into the bucket's buffer
_CAST = dict(wire_itemsize=2, passes=(1, 2))
COMM_HOOKS: dict[str, CommHook] = {
    "allreduce": CommHook(allreduce_hook),
    "fp16_compress": CommHook(fp16_compress_hook, **_CAST),
    "bf16_compress": CommHook(bf16_compress_hook, **_CAST),
}


def comm_hook(name_or_hook) -> Callable:
    """The hook for a name in ``COMM_HOOKS`` (a ValueError naming them otherwise), or a function as is."""
    if callable(name_or_hook):
        return name_or_hook
    if name_or_hook not in COMM_HOOKS:
        raise ValueError(f"unknown comm hook {name_or_hook!r}; valid: {', '.join(COMM_HOOKS)}, or a function "
                         "hook(bucket, process_group, recorder)")
    return COMM_HOOKS[name_or_hook].hook
