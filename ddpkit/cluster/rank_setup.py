"""A rank's start, before its first job: what it is told, its device, its share of the host, its group.

    settings = RankSettings.from_json(line)   # written by the parent (processes.Workers.rank_settings)
    share_the_cores(settings)                 # freed memory kept, cores pinned, torch's threads
    device = join(settings)                   # its GPU (join_device), then ddpkit's process group
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from datetime import timedelta


@dataclass(frozen=True)
class RankSettings:
    """What one rank is told when it starts, one JSON line on its stdin."""

    rank: int
    world_size: int
    generation: int                 # which start of the cluster this rank belongs to
    address: tuple[str, int]        # the parent's job socket (loopback)
    authkey: str                    # the cluster's random key, hex (admission.handshake)
    store: tuple[str, int]          # the parent's TCPStore (loopback), where the ranks meet
    timeout: float                  # seconds a collective may take
    backend: str                    # "gloo" or "nccl"
    transport: str                  # what carries the bytes (cluster.placement): "shm", "gloo", "cuda-ipc", "nccl"
    shm_prefix: str                 # names in /dev/shm of this start's shared-memory groups
    network: dict                   # the emulated links (ddpkit.Network.to_dict())
    threads_per_rank: int           # torch's CPU threads; 0: torch's default (one per core)
    sys_path: list[str]             # the parent's, so a job's modules import here too
    gpu: int | None = None          # this rank's CUDA device index; None: the CPU
    memory_fraction: float | None = None  # its cap on that GPU's memory
    cores: list[int] | None = None  # the CPU cores it is pinned to, or free

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, line: str | bytes) -> RankSettings:
        fields = json.loads(line)
        return cls(**dict(fields, address=tuple(fields["address"]), store=tuple(fields["store"])))


def share_the_cores(settings: RankSettings) -> None:
    """How this rank uses the host: freed memory kept, its cores (if pinned), torch's threads."""
    import torch

    _keep_freed_memory()
    if settings.cores:
        _pin(settings.cores)
    if settings.threads_per_rank:  # 0: keep torch's default (one thread per core)
        torch.set_num_threads(settings.threads_per_rank)


def join(settings: RankSettings) -> str:
    """Join the ranks' process group (ddpkit's, over the real backend); this rank's device."""
    import torch.distributed as dist

    from ddpkit.comm import process_group

    device = join_device(settings)
    # The store waits longer than a collective does: ranks that import torch at different speeds on
    # a loaded machine must still meet.
    store = dist.TCPStore(*settings.store, is_master=False,
                          timeout=timedelta(seconds=max(settings.timeout, 60.0)))
    process_group.install(settings.network, settings.transport, shm_prefix=settings.shm_prefix)
    dist.init_process_group("ddpkit", store=store, rank=settings.rank, world_size=settings.world_size,
                            timeout=timedelta(seconds=settings.timeout))
    return device


def join_device(settings: RankSettings) -> str:
    """Take this rank's GPU (``settings.gpu``) and its ``memory_fraction`` cap before joining the
    process group (NCCL binds to the current device); the device's name ("cuda:5", "cpu")."""
    from ddpkit import rankside

    if settings.gpu is None:
        return "cpu"
    rankside.set_device(settings.gpu)
    if settings.memory_fraction is not None:
        import torch

        torch.cuda.set_per_process_memory_fraction(settings.memory_fraction, rankside.device())
    return str(rankside.device())


def _pin(cores: list[int]) -> None:
    """Bind this process and every thread it has or starts to ``cores`` (``Cluster(pin_cores=True)``)."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except (OSError, ValueError):  # a thread that ended meanwhile
            pass


def _keep_freed_memory() -> None:
    """Keep the memory a step frees in this process, for the next step to reuse.

    glibc's malloc hands big freed blocks back to the kernel and adapts that threshold as it goes,
    so a step that reallocates the same tensors may fault every page in again (``ru_minflt``): some
    runs several times slower. Fixed thresholds make every run the fast one. glibc only."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not sys.platform.startswith("linux") or name is None:
        return
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3   # mallopt's parameter numbers (malloc.h)
        libc.mallopt(m_trim_threshold, 1 << 30)
        libc.mallopt(m_mmap_threshold, 32 << 20)      # glibc's largest allowed on 64-bit
    except (OSError, AttributeError):                 # not glibc (musl has no mallopt)
        pass
