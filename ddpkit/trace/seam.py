"""The recorder seam: what strategies and ddpkit's process group record through, and the rank's recorder.

    with recorder.span("forward", cat="compute"):          # a timed span on this rank
        ...
    with recorder.labels(bucket=i):                         # label the collectives issued inside
        work = dist.all_reduce(flat, async_op=True)
    recorder.grad_ready("layers.3.weight", bucket=i)        # a gradient just became ready
    recorder.memory(parameters=..., gradients=..., ...)     # a memory sample, bytes by category

A strategy never records a collective itself: ddpkit's process group is the one writer, into the
recorder of the ``labels()`` block (per thread) it was issued in. ``NullRecorder``, the default,
does nothing. The rank's recorder is process-wide on purpose: a process is one rank. This module
imports nothing else of ``ddpkit.trace``.
"""
from __future__ import annotations

import contextlib
import threading

_NO_SPAN = contextlib.nullcontext()


class _Issuing(threading.local):
    labels = None  # the innermost Labels block this thread is in (a class default: finding none is fast)


_ISSUING = _Issuing()


class Labels:
    """``with recorder.labels(bucket=i): ...``: the collectives this thread issues inside are recorded
    into ``recorder`` with ``fields``; the innermost block labels."""

    __slots__ = ("recorder", "fields", "_outer")

    def __init__(self, recorder, fields: dict):
        self.recorder, self.fields = recorder, fields

    def __enter__(self):
        self._outer = _ISSUING.labels
        _ISSUING.labels = self
        return self

    def __exit__(self, *exc):
        _ISSUING.labels = self._outer
        return False


def labelled():
    """The ``Labels`` block this thread is issuing collectives in, or None (asked by the process group)."""
    return _ISSUING.labels


class NullRecorder:
    """The recorder that records nothing (the default for every strategy)."""

    enabled = False

    def span(self, name: str, cat: str = "compute", **fields):
        return _NO_SPAN

    def labels(self, **fields):
        """Label the collectives issued inside the block (bucket, unit, ...); off: a shared empty ``with``."""
        return Labels(self, fields) if self.enabled else _NO_SPAN

    def launch_mark(self):
        """What the process group takes just *before* a launch (``collective(..., launched=mark)``); None here."""
        return None

    def collective(self, name: str, work, nbytes: int, **fields) -> None:
        """What ddpkit's process group calls for each collective it records (strategies label)."""

    def grad_ready(self, param_name: str, **fields) -> None:
        pass

    def memory(self, **bytes_by_category: int) -> None:
        pass

    # what the training step (``ddpkit.step.train_batch``) tells a recorder besides
    def begin_step(self) -> None:
        pass

    def next_step(self) -> None:
        pass

    def begin_forward(self) -> None:  # a wrapper's training forward (trace.Recorder: a step begins)
        pass

    loop_spans = True  # the loop times forward and backward itself (trace.Recorder: unless it is one of its own)

    def loss(self, value) -> None:
        pass

    def memory_due(self) -> bool:
        return False


NULL_RECORDER = NullRecorder()


class _Current:
    recorder = NULL_RECORDER  # this rank's recorder now (one instance, ``_CURRENT``)


_CURRENT = _Current()


def recorder():
    """The recorder this rank records into now (``with recording(rec):``), else ``NullRecorder``."""
    return _CURRENT.recorder


@contextlib.contextmanager
def recording(rec):
    """Make ``rec`` this rank's recorder inside the block (the previous one is restored after)."""
    previous, _CURRENT.recorder = _CURRENT.recorder, rec
    try:
        yield rec
    finally:
        _CURRENT.recorder = previous


__all__ = ["Labels", "NULL_RECORDER", "NullRecorder", "labelled", "recorder", "recording"]
