"""The CUDA IPC transport's slab: one GPU buffer per group, which every rank of the group maps.

Ranks sharing a GPU (transport "cuda-ipc") move bytes as NCCL does inside a node: group rank 0
allocates the slab's data area on the GPU (``segment``'s layout) and posts a CUDA IPC handle in the
group's store; the others map it. Deposits are device-to-device copies, completions sums on the
GPU; doorbells, queue and cutting are the shared-memory transport's (``runner``, ``shm``).

A GPU adds *when* bytes are there: before ringing "deposited" or "freed" a rank waits on the host
for its stream (``settle``); a deposit on another thread first waits for an event recorded at the
issue (``inputs_ready``, ``before_deposit``). The slab (``DEVICE_SLAB_BYTES``, 2 slots) counts in
group rank 0's allocator figures and lives as long as its process group.
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
        """Before ringing a doorbell: what this thread queued on the GPU is done, so the peers see it."""
        torch.cuda.current_stream(self.device).synchronize()


class HostSlab:
    """The host slab's data area: no waits (CPU copies are done on return, semaphores order memory)."""

    @staticmethod
    def inputs_ready():
        return None

    @staticmethod
    def before_deposit(ready) -> None:
        pass

    @staticmethod
    def settle() -> None:
        pass
