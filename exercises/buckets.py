"""Buckets: fewer, larger all-reduces.

An all-reduce costs a fixed latency (alpha) per message plus bytes x beta; sending 66 small
gradients pays alpha 66 times. DDP (Li et al. 2020, section 3.2.2) packs gradients into
buckets of about ``bucket_cap_mb`` (25 MiB in torch) and all-reduces each bucket as one flat
buffer. Parameters go into buckets in *reverse* registration order, because backward produces
the gradients of the last layers first: the first bucket fills first.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def assign_buckets(sizes: list[int], cap_bytes: int) -> list[list[int]]:
    """Group parameter indices into buckets: reverse order, a bucket closes once it reaches the cap.

    ``sizes[i]`` is parameter i's gradient size in bytes, i in registration order. Walk the
    indices from last to first, adding each to the open bucket; once the bucket holds
    ``>= cap_bytes`` it closes (so the tensor that crosses the cap stays in its bucket) and a
    new one opens. ``cap_bytes == 0`` gives one parameter per bucket; a negative cap is a
    ``ValueError``; no empty buckets. Example: sizes [4, 4, 4, 4], cap 8 -> [[3, 2], [1, 0]].
    Check: every index exactly once, in reverse order, each bucket except the last reaches the
    cap and stops reaching it without its last tensor.
    """
    raise NotImplementedError("exercise: buckets.assign_buckets (see the docstring)")


def reduce_bucket(grads: list[torch.Tensor], group=None) -> None:
    """Average a bucket of gradients over the ranks with ONE ``dist.all_reduce``, in place.

    Copy the gradients (any shapes, one dtype) into one flat buffer (``torch.cat`` of their
    flattened views), divide by the world size, all-reduce (SUM) once, then copy each slice
    back into its gradient (``.view_as``). Check: every gradient is the mean over ranks and
    exactly one all-reduce was called.
    """
    raise NotImplementedError("exercise: buckets.reduce_bucket (see the docstring)")
