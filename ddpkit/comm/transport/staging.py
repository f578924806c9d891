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

It wraps the host transport (``inner``, registered with torch as the group's backend) and passes
everything that holds no CUDA tensor straight to it. ``devices``: which devices' tensors are staged;
the tests stage CPU tensors (``devices=("cpu",)``) to prove the staging path without a GPU.
"""
from __future__ import annotations

import torch

from ddpkit.nested import map_leaves, tensors
from ddpkit.torch_internals import FutureWork

# The collectives a Python process group hands its real backend: (arguments written, arguments
# read). Argument 0 is what each one writes; the in-place ones (all-reduce, broadcast) read it too.
IN_PLACE = ("allreduce", "allreduce_coalesced", "broadcast")
OUT_OF_PLACE = ("allgather", "_allgather_base", "allgather_into_tensor_coalesced", "reduce_scatter",
                "_reduce_scatter_base", "reduce_scatter_tensor_coalesced")


class StagedWork(FutureWork):
    """A staged collective in flight: ``wait()`` first waits on the host transport's own ``Work``
    (the shared-memory transport moves its queue there), then on the copy back."""

    def __init__(self, inner, future):
        super().__init__(future)
        self._inner = inner
        self.deferred = getattr(inner, "deferred", False)  # the emulator asks (the NIC's rule)

    @property
    def ready_s(self):
        return getattr(self._inner, "ready_s", None)

    def wait(self, timeout=None):
        self._inner.wait()
        return super().wait(timeout)

    def is_completed(self):
        return self._inner.is_completed() and self._future.done()


class HostStaged:
    """A host transport (``inner``) that also takes CUDA tensors, staged through pinned host memory."""

    def __init__(self, inner, devices=("cuda",)):
        self.inner = inner
        self.devices = tuple(devices)

    # the emulated NIC's switch (ddpkit.comm.process_group sets it around a launch): the inner transport's
    @property
    def defer(self) -> bool:
        return self.inner.defer

    @defer.setter
    def defer(self, on: bool) -> None:
        self.inner.defer = on

    def __getattr__(self, name):  # barrier, send, recv, ...: the inner transport's own, unstaged
        return getattr(self.inner, name)

    def _stages(self, args) -> bool:
        return any(t.device.type in self.devices for t in tensors(list(args)))

    def _host(self, t, read: bool):
        """A host buffer for ``t`` (pinned where it stands for a CUDA tensor), holding its bytes if
        ``read``."""
        if not torch.is_tensor(t) or t.device.type not in self.devices:
            return t
        host = torch.empty_like(t, device="cpu", pin_memory=t.device.type == "cuda")
        if read:
            host.copy_(t)  # on the current stream, waited for: the bytes the producer left there
        return host

    def _staged(self, name: str, written, *rest):
        if not self._stages((written, *rest)):
            return getattr(self.inner, name)(written, *rest)
        host_written = map_leaves(lambda t: self._host(t, read=name in IN_PLACE), written)
        host_rest = [map_leaves(lambda t: self._host(t, read=True), a) for a in rest]
        work = getattr(self.inner, name)(host_written, *host_rest)
        pairs = [(t, h) for t, h in zip(tensors(written), tensors(host_written), strict=True) if t is not h]

        def copy_back(done):
            done.value()  # raises what the collective raised: nothing is copied back then
            for t, h in pairs:
                t.copy_(h)  # host to device, finished before the future completes (not non_blocking)
            return written

        try:
            future = work.get_future()
        except RuntimeError:  # what gloo carries without a future (its reduce-scatter): waited for here
            work.wait()
            future = torch.futures.Future()
            future.set_result(host_written)
        return StagedWork(work, future.then(copy_back))


def _method(name: str):
    def method(self, written, *rest):
        return self._staged(name, written, *rest)
    method.__name__ = method.__qualname__ = name
    return method


for _name in IN_PLACE + OUT_OF_PLACE:
    setattr(HostStaged, _name, _method(_name))
