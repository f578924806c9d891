"""Communication hooks: how a bucket of ``BucketedDDP`` / ``OverlappedDDP`` is reduced, swappable.

torch DDP lets you replace the all-reduce of each bucket with your own function (the DDP paper's
"communication hook"; torch's ``register_comm_hook``, ``docs/papers.md``). Ours has the same
shape on our buckets::

    model = ddpkit.OverlappedDDP(module)
    model.register_comm_hook(fp16_compress_hook)

    def hook(bucket, process_group, recorder) -> torch.futures.Future:
        # bucket.flat: the bucket's flat buffer, (sum of numels,), every gradient already x 1/N.
        # Launch the reduction (async) and return a future whose value is the reduced buffer
        # (bucket.flat itself, or a tensor of its size that the bucket copies back in).

The wrapper calls the hook where it would launch the bucket's all-reduce (from a gradient hook in
``OverlappedDDP``, after backward in ``BucketedDDP``) and waits for its future where it would wait
for the all-reduce. Every rank must run the same hook (the collectives must match).

Built in: ``allreduce_hook`` (what no hook does), ``fp16_compress_hook`` and
``bf16_compress_hook``: the buffer is cast to 16 bits, all-reduced, and cast back: half the bytes
on the wire, at the price of rounding every gradient to 16 bits (fp16: 10-bit mantissa, range
~6e-5 to 65504 -- the gradients are divided by N *before* the sum, so the sum cannot overflow
where the gradients did not; bf16: fp32's range, 7-bit mantissa, and Adam, which divides a
gradient by its running RMS, moves a parameter by up to ~lr a step where rounding changed a small
gradient). How far each lands from one process: ``docs/papers.md``.
"""
from __future__ import annotations

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
