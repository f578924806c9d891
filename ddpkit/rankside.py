"""Who this process is among the ranks: its rank, the world size, its device, its layout, and the
communication state it joined with.

These work in any process that joined the default process group (a Cluster job, a torchrun
script, a test). A process is one rank, so what it is (its GPU, its layout, its ``Comm``) is
process-wide, set once by whoever starts the rank (a Cluster's worker, ``ddpkit.train``,
``ddpkit.init_process_group``) and read from every thread.

What a rank records into is the recorder seam's (``ddpkit.trace.seam``); what its collectives
did (counts, the emulated links) its ``Comm``'s (``comm()``, ``ddpkit.comm.rank_comm``); what it
tells the notebook while a job runs the Cluster worker's (``ddpkit.cluster.worker.report``,
``ddpkit.progress``).
"""
from __future__ import annotations


class _Rank:
    """This process's rank-wide settings (one instance, ``_RANK``)."""

    comm = None  # ddpkit.comm.rank_comm.Comm, once this process joined with backend "ddpkit"
    topology = None  # ddpkit.Topology, where the process's launcher set one (set_topology)
    device = None  # this rank's GPU (a torch.device), once its launcher chose one (set_device)
    groups = None  # (the default group, {ranks: group}): subgroup()'s groups, made once each


_RANK = _Rank()


def rank() -> int:
    """This process's rank in the default process group."""
    import torch.distributed as dist

    return dist.get_rank()


def world_size() -> int:
    """The number of ranks in the default process group."""
    import torch.distributed as dist

    return dist.get_world_size()


def backend() -> str | None:
    """The real backend under this rank's process group ("gloo" or "nccl"; under ddpkit's own
    group, the one it wraps), or None before ``init_process_group``. The shared-memory and CUDA
    IPC transports are gloo groups (``transport()`` tells them apart)."""
    moved_by = transport()
    return "gloo" if moved_by in ("shm", "cuda-ipc") else moved_by


def transport() -> str | None:
    """What moves this rank's bytes: "shm" (shared memory, ``ddpkit.comm.transport``; staged through
    pinned host memory for CUDA tensors), "cuda-ipc" (a GPU buffer, for ranks sharing a GPU), "gloo"
    (its sockets) or "nccl"; None before ``init_process_group``."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    return _RANK.comm.real_backend if _RANK.comm is not None else str(dist.get_backend())


def barrier(group=None, on=None) -> None:
    """``dist.barrier`` on this rank's device (or ``on``): under NCCL it names the rank's GPU, which
    torch would otherwise guess from the rank (with a warning, and a hang where ranks and GPUs differ)."""
    import torch.distributed as dist

    dev = on if on is not None else device()
    if dev.type == "cuda":
        dist.barrier(group=group, device_ids=[dev.index])
    else:
        dist.barrier(group=group)


def device():
    """This rank's device: its GPU (always with its index, e.g. ``cuda:5``; under NCCL, or shared with
    other ranks over gloo's family), else the CPU.

    The GPU is the one the rank's launcher chose (``set_device``: a Cluster's ``gpus=``, torchrun's
    LOCAL_RANK), the same from every thread. CUDA's current device is per *thread* (a new thread
    starts on GPU 0), so it is asked only where no launcher said."""
    import torch

    if _RANK.device is not None:
        return _RANK.device
    if backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_device(gpu) -> None:
    """Make GPU ``gpu`` (an index, or a ``cuda:i`` device) this rank's device: CUDA's current
    device on the calling thread, and ``device()`` on every thread (a Cluster's worker and
    ``ddpkit.train`` call this before joining the process group; None: forget it)."""
    import torch

    if gpu is None:
        _RANK.device = None
        return
    dev = torch.device("cuda", gpu) if isinstance(gpu, int) else torch.device(gpu)
    if dev.type != "cuda" or dev.index is None:
        raise ValueError(f"set_device takes a GPU index or an indexed cuda device, got {gpu!r}")
    torch.cuda.set_device(dev)
    _RANK.device = dev


def adopt_device(dev) -> None:
    """The first call of every thread ddpkit starts in a rank (the emulator's links, the streaming
    thread, the recorder's watcher): make ``dev``, the rank's GPU, this thread's current CUDA
    device. A new thread starts on GPU 0, where its first CUDA call would create a context of its
    own (hundreds of MiB, on another student's GPU) and record events that cannot be compared
    with the rank's. Nothing happens for the CPU (or None)."""
    if dev is not None and dev.type == "cuda":
        import torch

        torch.cuda.set_device(dev)


def subgroup(ranks):
    """``dist.new_group(ranks)``, made once per default process group and then reused: a
    long-lived rank builds many wrappers (a comparison builds hybrid sharding ~8 times), and each
    group holds communicators (NCCL's: GPU memory and a stream each) until the process group
    ends. Collective like ``new_group``: every rank asks for the same groups in the same order."""
    import torch.distributed as dist

    world = dist.group.WORLD
    if _RANK.groups is None or _RANK.groups[0] is not world:  # a new process group: new groups
        _RANK.groups = (world, {})
    made = _RANK.groups[1]
    key = tuple(int(r) for r in ranks)
    if key not in made:
        made[key] = dist.new_group(list(key))
    return made[key]


# ----------------------------------------------------------------------------- what it joined with
def attach_comm(comm) -> None:
    """This process's ``Comm`` (``ddpkit.comm.rank_comm``: its network, counts, emulator, flight
    recorder): every group the ``"ddpkit"`` backend creates from now on shares it
    (``process_group.install`` calls this)."""
    _RANK.comm = comm


def comm():
    """This rank's ``Comm`` (``ddpkit.comm.rank_comm``: its network, counts, emulated links and
    flight recorder), None outside a ddpkit process group (e.g. torch's own under torchrun)."""
    return _RANK.comm


def topology():
    """This rank's layout (a ``ddpkit.Topology``): the one its launcher set (``set_topology``:
    ``python -m ddpkit.train`` sets torchrun's), else the nodes of this rank's network (a
    Cluster's ``gpus_per_node``), else ``Topology.default`` for ``world_size()`` ranks. A
    ValueError where the ranks cannot be laid out so (e.g. 3 ranks in nodes of 2)."""
    from ddpkit.topology import Topology

    if _RANK.topology is not None:
        return _RANK.topology
    return Topology.from_network(_RANK.comm.network if _RANK.comm is not None else None, world_size())


def set_topology(topology) -> None:
    """Make ``topology`` this rank's layout (None: back to the network's, or the default). A
    script started by torchrun sets ``Topology.from_torchrun(os.environ)`` after joining the
    process group, as ``ddpkit.train`` does, so hybrid sharding follows the real nodes."""
    if topology is not None and topology.world_size != world_size():
        raise ValueError(f"a topology of {topology.world_size} ranks for a process group of {world_size()}")
    _RANK.topology = topology
