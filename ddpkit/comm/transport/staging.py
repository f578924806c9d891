"""HostStaged: CUDA tensors through a host transport, by way of pinned host memory.

The shared-memory transport (``ShmBackend``) moves host bytes. For ranks that share a GPU
(``Cluster(4, gpus=[0, 0, 0, 0], transport="shm")``) each collective's CUDA tensors are staged:

1. at the issue, on the issuing thread, each CUDA tensor the collective reads is copied into a
   pinned host buffer (device to host at the copy engine's speed; torch's caching host allocator
   hands the same buffers out again), and each one it only writes gets an empty one. The copy runs
   on the issuing thread's current stream, the one that produced the tensor, and waits for it:
   the host bytes are the tensor's;
2. the host transport runs the collective on the host buffers, as for CPU ranks (its pieces, its
   slab, its doorbells and fingerprints: ``ddpkit.comm.transport.shm``);
3. when it completes, the results are copied back into the CUDA tensors (host to device), before
   the collective's future completes: whoever then reads them, on any stream, reads the result.

So a byte crosses the PCIe bus twice per rank (down, then up) and the host's memory three times
(into the slab, out of it, the sums), against CUDA IPC's none (``device_slab``); measured side by
side in ``benchmarks/bench_shared_gpu.py``. Every collective still goes through ddpkit's process
group first: counted, recorded, emulated and desync-checked as on the CPU.

gloo takes CUDA tensors for its collectives but not for ``send`` and ``recv`` (the course's ring
exercise), so on ranks sharing a GPU every gloo-family transport is wrapped for those at least
(``POINT_TO_POINT``): the CUDA IPC transport and gloo stage only them, the shared-memory one
everything (``STAGED``).

It wraps the host transport (``inner``, registered with torch as the group's backend) and passes
everything it does not stage straight to it. ``devices``: which devices' tensors are staged; the
tests stage CPU tensors (``devices=("cpu",)``) to prove the staging path without a GPU.
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
    """A staged collective in flight: done once the host transport's own ``Work`` is and the
    results are copied back (``finish``). ``wait()`` waits on the inner ``Work`` first (the
    shared-memory transport moves its queue there). Where the inner ``Work`` has no future (gloo's
    send, recv and reduce-scatter), the copy back is made by the first ``wait()``."""

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
    """A host transport (``inner``) that also takes CUDA tensors in ``methods``, staged through
    pinned host memory."""

    def __init__(self, inner, devices=("cuda",), methods=STAGED):
        self.inner = inner
        self.devices = tuple(devices)
        self.methods = frozenset(methods)

    def __getattr__(self, name):  # barrier, gather, ...: the inner transport's own, unstaged
        return getattr(self.inner, name)

    def _host(self, t, read: bool):
        """A host buffer for ``t`` (pinned where it stands for a CUDA tensor), holding its bytes if
        ``read``."""
        if not torch.is_tensor(t) or t.device.type not in self.devices:
            return t
        host = torch.empty_like(t, device="cpu", pin_memory=t.device.type == "cuda")
        if read:
            host.copy_(t)  # on the current stream, waited for: the bytes the producer left there
        return host

    def _staged(self, name: str, first, *rest, **at_wait):
        """``at_wait``: handed to the inner transport (ddpkit's process group passes it, see
        ``ddpkit.comm.emulator``)."""
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
