"""How ranks on one host move bytes without the network stack: a shared-memory transport.

``segment`` (a group's slab in ``/dev/shm`` and its doorbells), ``runner`` (its queue of pieces),
``shm`` (``ShmBackend``: gloo with the collectives moved through the slab), ``device_slab`` (the
slab on a GPU, CUDA IPC), ``staging`` (CUDA tensors through host memory). ``comm.process_group``
builds them as the Cluster's transport says: ``"shm"`` or ``"cuda-ipc"``.
"""
from ddpkit.comm.transport.segment import ShmError, unlink_segments
from ddpkit.comm.transport.shm import ShmBackend
from ddpkit.comm.transport.staging import POINT_TO_POINT, STAGED, HostStaged

__all__ = ["POINT_TO_POINT", "STAGED", "HostStaged", "ShmBackend", "ShmError", "unlink_segments"]
