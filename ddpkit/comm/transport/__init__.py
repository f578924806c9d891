"""How ranks on one host move bytes without the network stack: a shared-memory transport.

- ``segment``: one group's shared slab (a file in ``/dev/shm`` mapped by every rank) and its
  doorbells (one named semaphore per rank), the barrier built on them, and the cleanup;
- ``shm``: ``ShmBackend``, a gloo process group whose collectives move their bytes through the
  slab instead (all-reduce, all-gather, reduce-scatter, broadcast, barrier); the rest is gloo's.

``ddpkit.comm.process_group`` builds it when a Cluster runs with ``transport="shm"``.
"""
from ddpkit.comm.transport.segment import ShmError, unlink_segments
from ddpkit.comm.transport.shm import ShmBackend

__all__ = ["ShmBackend", "ShmError", "unlink_segments"]
