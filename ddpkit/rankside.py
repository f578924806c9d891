"""What a job running inside a rank can ask and report: its rank, the world size, its device,
progress, and the recorder its strategies record into.

These work in any process that joined the default process group (a Cluster job, a torchrun
script, a test); ``progress()`` reaches the cluster widget only from inside a Cluster worker.

The rank's recorder is the one piece of process-wide state here, on purpose: a process is one
rank, and everything in it that records (every strategy built without an explicit ``recorder=``,
and ddpkit's process group, which sees every collective) must record into the same place, also
from threads the job did not start (autograd's, a collective's completion callback).

The other is per *thread*: the ``labels()`` block a strategy is issuing a collective in. ddpkit's
process group is the one writer of a collective's record; a strategy only labels what it issues
(``with recorder.labels(bucket=i): work = dist.all_reduce(...)``), and the group, called on the
same thread, reads the labels (``labelled()``) and records into that recorder. Per thread,
because collectives are issued from autograd's threads too (overlapped DDP, FSDP's backward),
while the main thread may be inside a block of its own.
"""
from __future__ import annotations

import contextlib
import threading

_NO_SPAN = contextlib.nullcontext()


class _Issuing(threading.local):
    labels = None  # the innermost Labels block this thread is in (a class default: finding none is fast)


_ISSUING = _Issuing()


class Labels:
    """``with recorder.labels(bucket=i): ...``: the collectives this thread issues inside the
    block are recorded (by ddpkit's process group) into ``recorder``, with ``fields`` added.
    Blocks nest: the innermost one labels (a recorder that is off opens no block at all)."""

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
    """The ``Labels`` block this thread is issuing collectives in (its ``recorder`` and
    ``fields``), or None: what ddpkit's process group asks of each collective."""
    return _ISSUING.labels


class NullRecorder:
    """The recorder that records nothing (the default for every strategy)."""

    enabled = False

    def span(self, name: str, cat: str = "compute", **fields):
        return _NO_SPAN

    def labels(self, **fields):
        """Label the collectives issued inside the block (bucket, unit, ...). Off: a shared empty
        ``with``. A recorder that is on (a subclass, e.g. a test's counting recorder) gets them."""
        return Labels(self, fields) if self.enabled else _NO_SPAN

    def launch_mark(self):
        """What ddpkit's process group takes just *before* launching a collective it will record
        (``collective(..., launched=mark)``); None here: nothing to mark."""
        return None

    def collective(self, name: str, work, nbytes: int, **fields) -> None:
        """What ddpkit's process group calls for each collective it records (strategies label)."""

    def grad_ready(self, param_name: str, **fields) -> None:
        pass

    def memory(self, **bytes_by_category: int) -> None:
        pass

    # what the training step (``experiment.train_step``) tells a recorder besides
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


class _Rank:
    """This process's rank-wide settings (one instance, ``_RANK``)."""

    recorder = NULL_RECORDER
    comm = None  # ddpkit.comm.process_group.Comm, once this process joined with backend "ddpkit"
    reporter = None  # send(kind, payload) to the cluster, inside a Cluster worker
    topology = None  # ddpkit.Topology, where the process's launcher set one (set_topology)
    device = None  # this rank's GPU (a torch.device), once its launcher chose one (set_device)
    groups = None  # (the default group, {ranks: group}): subgroup()'s groups, made once each


_RANK = _Rank()


def recorder():
    """The recorder this rank records into now: a ``ddpkit.trace.Recorder`` while recording is on
    (``with recording(rec):``, or ``cluster.recording()`` in the notebook), else the do-nothing
    ``NullRecorder``. A strategy built with ``recorder=None`` takes this one."""
    return _RANK.recorder


@contextlib.contextmanager
def recording(rec):
    """Make ``rec`` this rank's recorder inside the block (the previous one is restored after)."""
    previous, _RANK.recorder = _RANK.recorder, rec
    try:
        yield rec
    finally:
        _RANK.recorder = previous


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


# ----------------------------------------------------------------------------- the network
def attach_comm(comm) -> None:
    """This process's ``ddpkit.comm.process_group.Comm`` (its counts, its emulator): every group the
    ``"ddpkit"`` backend creates from now on reports to it (``process_group.install`` calls this)."""
    _RANK.comm = comm


def attached_comm():
    """The ``Comm`` set by ``attach_comm`` (None before)."""
    return _RANK.comm


def network():
    """The network this rank's collectives are emulated on (``ddpkit.Network``; None outside a
    ddpkit process group, e.g. under torchrun)."""
    return _RANK.comm.network if _RANK.comm is not None else None


def topology():
    """This rank's layout (a ``ddpkit.Topology``): the one its launcher set (``set_topology``:
    ``python -m ddpkit.train`` sets torchrun's), else the nodes of this rank's network (a
    Cluster's ``gpus_per_node``), else ``Topology.default`` for ``world_size()`` ranks. A
    ValueError where the ranks cannot be laid out so (e.g. 3 ranks in nodes of 2)."""
    from ddpkit.topology import Topology

    if _RANK.topology is not None:
        return _RANK.topology
    return Topology.from_network(network(), world_size())


def set_topology(topology) -> None:
    """Make ``topology`` this rank's layout (None: back to the network's, or the default). A
    script started by torchrun sets ``Topology.from_torchrun(os.environ)`` after joining the
    process group, as ``ddpkit.train`` does, so hybrid sharding follows the real nodes."""
    if topology is not None and topology.world_size != world_size():
        raise ValueError(f"a topology of {topology.world_size} ranks for a process group of {world_size()}")
    _RANK.topology = topology


def set_network(network) -> None:
    """Emulate ``network`` from the next collective on (every rank must call this, between
    collectives: ``cluster.network = ...`` does)."""
    from ddpkit.network import Network

    if _RANK.comm is None:
        raise RuntimeError("this rank's process group is not ddpkit's: start it from a ddpkit.Cluster")
    _RANK.comm.network = Network.from_dict(network) if isinstance(network, dict) else Network.of(network)


@contextlib.contextmanager
def real_transport():
    """Inside the block, collectives take what the real transport takes (no emulated delay):
    for measuring the transport itself, e.g. the cost model's calibration."""
    comm = _RANK.comm
    if comm is None:
        yield
        return
    previous, comm.emulator.enabled = comm.emulator.enabled, False
    try:
        yield
    finally:
        comm.emulator.enabled = previous


def emulation_counts() -> tuple[int, int]:
    """``(collectives the emulated links carried, of which this machine's own transport took
    longer than the link)`` so far on this rank, over every link; subtract two for a window.
    (0, 0) off a network or outside a ddpkit process group."""
    if _RANK.comm is None:
        return 0, 0
    counts = _RANK.comm.emulator.fidelity().values()
    return sum(carried for carried, _ in counts), sum(outran for _, outran in counts)


def transport_seconds() -> float:
    """Seconds this rank has spent moving the bytes of ``at_wait`` collectives when it waited for
    them (``ddpkit.comm.emulator``: the transport's part of their time) so far; 0 off a network."""
    return 0.0 if _RANK.comm is None else _RANK.comm.emulator.transport_s()


def comm_counts() -> dict:
    """``{(collective, link): (calls, bytes sent, bytes the transport moved)}`` so far on this
    rank (empty outside a ddpkit process group). Subtract two snapshots to count a window."""
    return _RANK.comm.snapshot() if _RANK.comm is not None else {}


def set_reporter(send) -> None:
    """How this process sends side messages to the cluster: ``send(kind, payload)`` (a Cluster
    worker sets it when it starts; None elsewhere)."""
    _RANK.reporter = send


def report(kind: str, **payload) -> None:
    """Send a side message (progress, records, ...) to the cluster while a job runs; nothing
    happens outside a Cluster worker."""
    if _RANK.reporter is not None:
        _RANK.reporter(kind, payload)


def progress(done: int, total: int) -> None:
    """Report ``done`` of ``total`` steps to the cluster widget (does nothing outside a Cluster)."""
    report("progress", done=int(done), total=int(total))
