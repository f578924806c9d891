"""HostStaged: CUDA tensors through a host transport, by way of pinned host memory.

For ranks sharing a GPU over the shared-memory transport each collective's CUDA tensors are
copied into pinned host buffers at the issue (on the issuing thread's stream, which produced
them), the host transport runs on those, and the results are copied back before the future
completes. So a byte crosses PCIe twice, against CUDA IPC's none (``bench_shared_gpu.py``).

gloo takes no CUDA tensor for ``send`` and ``recv``, so those are staged on every gloo-family
transport (``POINT_TO_POINT``), everything on the shared-memory one (``STAGED``). What is not
staged passes to ``inner``; ``devices=("cpu",)`` proves the path without a GPU in the tests.
"""
from __future__ import annotations

import threading

import torch

from ddpkit.nested import map_leaves, tensors
from ddpkit.torch_internals import FutureWork

# Argument 0 is what each of these writes (a send: what it reads); the in-place ones read it too.
IN_PLACE = ("allreduce", "allreduce_coalesced", "broadcast")
OUT_OF_PLACE = ("allgather", "_allgather_base", "allgather_into_tensor_coalesced", "reduce_scatter",
                "_reduce_scatter_base", "reduce_scatter_tensor_coalesced")
POINT_TO_POINT = ("send", "recv", "recv_anysource")
STAGED = IN_PLACE + OUT_OF_PLACE + POINT_TO_POINT


class StagedWork(FutureWork):
    """A staged collective: done once the inner ``Work`` is and the results are copied back
    (``finish``; by the first ``wait()`` where the inner Work has no future)."""

    def __init__(self, inner, finish, value):
        self._inner, self._finish, self._value = inner, finish, value
        self._lock = threading.Lock()
        self.at_wait = getattr(inner, "at_wait", False)  # the emulator asks (ddpkit.comm.emulator)
        try:
            future, self._no_future = inner.get_future().then(self._done), False
        except RuntimeError:  # "Work::getFuture not implemented": the first wait() copies back
            future, self._no_future = torch.futures.Future(), True
        super().__init__(future)

    def _done(self, inner_future):
        inner_future.value()  # raises what the collective raised: nothing is copied back then
        self._finish()
        return self._value

    @property
    def ready_s(self):
        return getattr(self._inner, "ready_s", None)

    def wait(self, timeout=None):
        self._inner.wait()
        if self._no_future:
            with self._lock:
                if not self._future.done():
                    self._finish()
                    self._future.set_result(self._value)
        return super().wait(timeout)

    def is_completed(self):
        return self._inner.is_completed() and (self._no_future or self._future.done())


class HostStaged:
    """A host transport (``inner``) that also takes CUDA tensors in ``methods``, staged through pinned memory."""

    def __init__(self, inner, devices=("cuda",), methods=STAGED):
        self.inner = inner
        self.devices = tuple(devices)
        self.methods = frozenset(methods)

    def __getattr__(self, name):  # barrier, gather, ...: the inner transport's own, unstaged
        return getattr(self.inner, name)

    def _host(self, t, read: bool):
        """A host buffer for ``t`` (pinned for a CUDA tensor), holding its bytes if ``read``."""
        if not torch.is_tensor(t) or t.device.type not in self.devices:
            return t
        host = torch.empty_like(t, device="cpu", pin_memory=t.device.type == "cuda")
        if read:
            host.copy_(t)  # on the current stream, waited for: the bytes the producer left there
        return host

    def _staged(self, name: str, first, *rest, **at_wait):
        """``at_wait``: handed on to the inner transport (``ddpkit.comm.emulator``)."""
        if name not in self.methods or not any(t.device.type in self.devices for t in tensors([first, *rest])):
            return getattr(self.inner, name)(first, *rest, **at_wait)
        host_first = map_leaves(lambda t: self._host(t, read=name in IN_PLACE or name == "send"), first)
        host_rest = [map_leaves(lambda t: self._host(t, read=True), a) for a in rest]
        work = getattr(self.inner, name)(host_first, *host_rest, **at_wait)
        back = [] if name == "send" else [(t, h) for t, h in zip(tensors(first), tensors(host_first), strict=True)
                                           if t is not h]

        def copy_back():
            for t, h in back:
                t.copy_(h)  # host to device, finished before the collective counts as done (not non_blocking)

        return StagedWork(work, copy_back, first)


def _method(name: str):
    def method(self, first, *rest, **at_wait):
        return self._staged(name, first, *rest, **at_wait)
    method.__name__ = method.__qualname__ = name
    return method


for _name in STAGED:
    setattr(HostStaged, _name, _method(_name))
