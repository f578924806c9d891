"""How ranks on one host move bytes without the network stack: a shared-memory transport.

- ``segment``: one group's shared slab (a file in ``/dev/shm`` mapped by every rank) and its
  doorbells (one named semaphore per rank), the barrier built on them, and the cleanup;
- ``runner``: a group's queue of pieces, and which thread moves it;
- ``shm``: ``ShmBackend``, a gloo process group whose collectives move their bytes through the
  slab instead (all-reduce, all-gather, reduce-scatter, broadcast, barrier); the rest is gloo's;
- ``device_slab``: the slab's data area on a GPU, mapped by every rank sharing it (CUDA IPC);
- ``staging``: ``HostStaged``, CUDA tensors through the host slab by way of pinned host memory (and,
  for every transport of ranks sharing a GPU, through gloo's send and recv, which take none).

``ddpkit.comm.process_group`` builds them as the Cluster's transport says (``ddpkit.cluster.placement``):
``"shm"`` (CPU ranks; staged for ranks sharing a GPU) and ``"cuda-ipc"`` (ranks sharing a GPU).
"""
from ddpkit.comm.transport.segment import ShmError, unlink_segments
from ddpkit.comm.transport.shm import ShmBackend
from ddpkit.comm.transport.staging import POINT_TO_POINT, STAGED, HostStaged

__all__ = ["POINT_TO_POINT", "STAGED", "HostStaged", "ShmBackend", "ShmError", "unlink_segments"]
