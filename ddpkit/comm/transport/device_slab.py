"""The CUDA IPC transport's slab: one GPU buffer per group, which every rank of the group maps.

Ranks sharing a GPU (``Cluster(4, gpus=[0, 0, 0, 0])``, the default transport "cuda-ipc") move
their bytes the way NCCL does inside a node: through GPU memory they can all reach. Group rank 0
allocates the slab's data area on the GPU (S slots x N regions, as the shared-memory slab lays it
out: ``ddpkit.comm.transport.segment``) and posts a CUDA IPC handle for it in the group's store;
the others map the same memory into their own CUDA contexts. A piece is deposited with a
device-to-device copy into this rank's region and completed with sums (or copies) on the GPU,
straight into the caller's tensor; the doorbells, fingerprints and the queue are the shared-memory
transport's, unchanged (``runner``), and so is every collective's cutting (``shm``).

What a GPU adds is *when* bytes are there. A copy or a sum is queued on a stream and done later,
and a peer process reads the slab without seeing our streams. So:
- before a rank rings "deposited" (its region is filled) or "freed" (it has read the slot and
  may let the peers overwrite it), it waits on the host until its stream has done the copy or
  the sums (``settle``): the peer that takes the ring finds the bytes there, and a result is in
  the caller's tensor before the collective's future completes;
- the inputs: a piece may be deposited later than its collective was issued, on another thread
  (whoever moves the queue, ``runner``), whose stream knows nothing of the kernels that produced
  the tensor. An event recorded on the issuing thread's stream at the issue (``inputs_ready``)
  is waited for, on the depositing thread's stream, before the copy (``before_deposit``).
Waiting on the host is simple and exact, and costs the waiting thread the GPU's queue; events
shared between the processes (device-side waits, as NCCL's kernels do) would not, and are left
for a measurement to ask for.

The slab (``DEVICE_SLAB_BYTES`` a group, in 2 slots: big regions, as each piece costs two waits)
is allocated through the caching allocator of group rank 0: its allocator figures count it, the
other ranks' do not. It lives as long as that rank's process group.
"""
from __future__ import annotations

import pickle

import torch

from ddpkit.torch_internals import open_cuda_tensor, share_cuda_tensor

DEVICE_SLAB_BYTES = 32 << 20   # a group's slab on the GPU (2 ranks: 8 MiB regions; 4 ranks: 4 MiB)
DEVICE_SLOTS = 2               # pieces in flight per group: each piece waits twice on the host anyway
_KEY = "ddpkit_shm/device_slab"


class DeviceSlab:
    """This rank's view of its group's slab on the GPU, and the waits that make it safe."""

    def __init__(self, store, rank: int, nbytes: int, device):
        self.device = torch.device(device)
        try:
            if rank == 0:
                self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                store.set(_KEY, pickle.dumps(share_cuda_tensor(self.buffer)))
            else:  # the same GPU memory, mapped into this process's context
                self.buffer = open_cuda_tensor(pickle.loads(store.get(_KEY)))
        except RuntimeError as exc:  # CUDA IPC refused: a sandbox that does not pass it through, ...
            raise RuntimeError(f"the CUDA IPC transport could not {'share' if rank == 0 else 'map'} its group's "
                               f"buffer on {self.device} ({type(exc).__name__}: {exc}); this machine may not allow "
                               "CUDA IPC between processes. Use ddpkit.Cluster(..., transport='shm') (staged through "
                               "host memory) or transport='gloo'") from exc

    def inputs_ready(self):
        """At a collective's issue, on the issuing thread: an event after what produced its inputs."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def before_deposit(self, ready) -> None:
        """Before a piece's copy into the slab, on the depositing thread: its inputs are produced."""
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)

    def settle(self) -> None:
        """Before ringing a doorbell: what this thread queued on the GPU (a deposit's copy, a
        completion's sums) is done, so the peers see it."""
        torch.cuda.current_stream(self.device).synchronize()


class HostSlab:
    """The shared-memory slab's data area needs none of the waits: the CPU's copies are done when
    they return, and the doorbells' semaphores order memory between processes (``segment``)."""

    @staticmethod
    def inputs_ready():
        return None

    @staticmethod
    def before_deposit(ready) -> None:
        pass

    @staticmethod
    def settle() -> None:
        pass
