"""Overlap: start each bucket's all-reduce while backward is still computing earlier layers.

DDP (Li et al. 2020, section 3.2.3) registers an autograd hook per parameter. When a gradient
is ready its hook marks it; when the last gradient of a bucket is marked, that bucket's
all-reduce is launched *asynchronously*, and backward carries on computing. Buckets are
launched strictly in bucket order (every rank must issue the same collectives in the same
order, or the ranks would sum different buckets together). At the end of backward, wait for
every launched all-reduce. This file is the bookkeeping; the hooks call ``mark_ready``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable


@dataclass
class OverlapState:
    """The bookkeeping one backward pass needs (plain data, built once per model)."""

    bucket_of: list[int]                 # parameter index -> its bucket
    counts: list[int]                    # bucket -> how many parameters it holds
    launch: Callable[[int], Any]         # launch(b) starts bucket b's all-reduce, returns a handle with .wait()
    missing: list[int] = field(default_factory=list)   # bucket -> gradients not ready yet
    next_bucket: int = 0                 # the next bucket to launch (strictly in order)
    handles: list = field(default_factory=list)        # launched, not yet waited for

    def __post_init__(self):
        if not self.missing:
            self.missing = list(self.counts)


def mark_ready(state: OverlapState, index: int) -> None:
    """Parameter ``index``'s gradient is ready: launch every bucket that is now complete, in order.

    Decrement ``state.missing`` of its bucket. Then, while the bucket ``state.next_bucket`` has
    no gradient missing, call ``state.launch(b)``, keep the handle in ``state.handles`` and move
    to the next bucket. A complete bucket waits if an earlier one is not complete yet.
    Check: launches happen as soon as allowed, and always in the order 0, 1, 2, ...
    """
    b = state.bucket_of[index]
    state.missing[b] -= 1
    while state.next_bucket < len(state.missing) and state.missing[state.next_bucket] == 0:
        state.handles.append(state.launch(state.next_bucket))
        state.next_bucket += 1


def wait_all(state: OverlapState) -> None:
    """End of backward: wait for every launched bucket, then reset ``state`` for the next backward.

    If some bucket was never launched (a gradient never became ready: an unused parameter),
    raise ``RuntimeError`` naming the buckets, rather than returning unsynchronised gradients.
    Call ``.wait()`` once on every handle, clear ``state.handles``, set ``state.missing`` back
    to ``state.counts`` and ``state.next_bucket`` to 0. Check: a second backward works again.
    """
    for h in state.handles:  # first finish what was launched: no collective left in flight
        h.wait()
    state.handles = []
    if state.next_bucket != len(state.counts):
        never = [b for b, m in enumerate(state.missing) if m]
        raise RuntimeError(f"bucket(s) {never} never became ready: some gradients were not computed")
    state.missing = list(state.counts)
    state.next_bucket = 0
