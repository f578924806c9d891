"""Where a Cluster's ranks run and what carries their bytes, decided once, before any rank starts.

    place(4, "auto", None, "auto")           # one GPU here: ("gloo", (0, 0, 0, 0), "cuda-ipc")
    carried_by(4, "gloo", (0, 0, 0, 0), "cuda-ipc")   # "gloo, 4 ranks sharing GPU 0, bytes through CUDA IPC"

Three layouts: CPU ranks (gloo; bytes through ``"shm"`` or gloo's sockets), one GPU per rank (NCCL),
and ranks sharing a GPU (rank r on GPU r % GPUs). NCCL before 2.30.3 refuses two ranks on one GPU,
so theirs go through ddpkit's process group over a transport that takes CUDA tensors:
``"cuda-ipc"`` (the default on one GPU: a device buffer per group, ``comm.transport.device_slab``),
``"shm"`` (staged through pinned host memory; the default across several GPUs), ``"gloo"``, or
``"nccl"`` (its experimental multi-rank mode, only by name, where the installed NCCL has it).
``benchmarks/bench_shared_gpu.py`` measures them all.
"""
from __future__ import annotations

BACKENDS = ("auto", "gloo", "nccl")
TRANSPORTS = ("auto", "shm", "gloo", "cuda-ipc", "nccl")
CPU_TRANSPORTS = ("shm", "gloo")
NCCL_SHARES_GPUS_FROM = (2, 30, 3)   # NCCL_MULTI_RANK_GPU_ENABLE appeared in this release (experimental)
NCCL_SHARE_SWITCH = "NCCL_MULTI_RANK_GPU_ENABLE"

# Said beside a step time measured on ranks sharing a GPU (compare prints it under its table)
SHARED_GPU_NOTE = ("note: these ranks share a GPU and take turns on its SMs: a step's time is theirs together, "
                   "not what as many GPUs would take, and overlap hides less; --network emulates the links of N "
                   "real GPUs, and `python -m ddpkit predict` shows what N GPUs would do.")

# What the transports are called where a learner reads them (the widget's header, compare's head line)
_WORDS = {"cuda-ipc": "CUDA IPC", "shm": "shared memory, staged through pinned host memory",
          "gloo": "gloo (it stages through the host)", "nccl": "NCCL's multi-rank mode"}


def visible_gpus() -> int:
    """CUDA GPUs this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(backend: str, ranks_here: int) -> str:
    """``backend="auto"``: NCCL when this machine has a GPU for each of its ``ranks_here`` ranks,
    else gloo; a named one is checked."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    gpus = visible_gpus()
    if backend == "auto":
        return "nccl" if gpus >= ranks_here else "gloo"
    if backend == "nccl" and gpus < ranks_here:
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: {ranks_here} rank(s) on this machine but "
            f"{gpus} CUDA GPU(s) are visible; use backend='gloo' (CPU) or fewer ranks"
            + (f", or let the ranks share the GPU: backend='auto', or gpus={[r % gpus for r in range(ranks_here)]}"
               if gpus else "")
        )
    return backend


def check_gpus(gpus, world_size: int) -> tuple[int, ...]:
    """``gpus`` as a tuple of visible CUDA device indices, one per rank (repeats share a GPU), or a
    ValueError saying what is wrong."""
    if isinstance(gpus, (str, bytes)) or not hasattr(gpus, "__iter__"):
        raise ValueError(f"gpus must be a list of CUDA device indices, one per rank, e.g. [4, 5] (or [0, 0] "
                         f"for two ranks sharing GPU 0); got {gpus!r}")
    gpus = list(gpus)
    if any(isinstance(g, bool) or not isinstance(g, int) or g < 0 for g in gpus):
        raise ValueError(f"gpus must be whole numbers >= 0 (CUDA device indices), got {gpus!r}")
    if len(gpus) != world_size:
        raise ValueError(f"gpus={gpus!r} names {len(gpus)} GPU(s) for world_size={world_size}: one per rank "
                         f"(ranks may share one: gpus={[gpus[0] if gpus else 0] * world_size})")
    visible = visible_gpus()
    if not visible:
        import torch

        raise ValueError(f"gpus={gpus!r}: this machine has no CUDA GPU that torch can use "
                         f"(torch.cuda.is_available() is False; torch {torch.__version__}); leave out gpus= "
                         "to run the ranks on the CPU")
    missing = sorted({g for g in gpus if g >= visible})
    if missing:
        raise ValueError(f"gpus={gpus!r}: no GPU {', '.join(map(str, missing))} here; {visible} GPU(s) are "
                         f"visible, numbered 0-{visible - 1} (CUDA_VISIBLE_DEVICES renumbers them)")
    return tuple(gpus)


def shares(gpus) -> bool:
    """Do some of these ranks share a GPU?"""
    return gpus is not None and len(set(gpus)) < len(gpus)


def place(world_size: int, backend: str, gpus, transport: str) -> tuple[str, tuple[int, ...] | None, str]:
    """``(backend, gpus, transport)`` resolved (gpus None: the CPU), or a ValueError naming the
    argument where they do not fit together."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    if gpus is not None:
        gpus = check_gpus(gpus, world_size)
    elif backend == "auto":
        visible = visible_gpus()
        if visible:  # a GPU per rank (NCCL), or fewer: ranks share them, rank r on GPU r % visible
            gpus = tuple(r % visible for r in range(world_size))
    elif backend == "nccl":
        resolve_backend("nccl", world_size)  # a GPU per rank, else the error says how to share
        gpus = tuple(range(world_size))
    if gpus is None:  # CPU ranks
        if transport not in ("auto",) + CPU_TRANSPORTS:
            raise ValueError(f"transport={transport!r} carries CUDA tensors, but these ranks run on the CPU; "
                             f"CPU ranks take {' or '.join(map(repr, CPU_TRANSPORTS))} (or 'auto': shared memory)")
        return "gloo", None, "shm" if transport == "auto" else transport
    shared = shares(gpus)
    if not shared and backend != "gloo" and transport in ("auto", "nccl"):
        return "nccl", gpus, "nccl"  # a GPU per rank: NCCL, as on a cluster
    if backend == "nccl" and transport not in ("auto", "nccl"):
        raise ValueError(f"backend='nccl' moves its own bytes; transport={transport!r} is for ranks on gloo "
                         "(leave out backend=, or use transport='auto')")
    if transport == "nccl" or backend == "nccl":
        version = nccl_version()
        if version is None or version < NCCL_SHARES_GPUS_FROM:
            have = ".".join(map(str, version)) if version else "no NCCL"
            raise ValueError(f"gpus={list(gpus)} puts several ranks on one GPU, and NCCL refuses that before "
                             f"{'.'.join(map(str, NCCL_SHARES_GPUS_FROM))} ({NCCL_SHARE_SWITCH}); this torch has "
                             f"{have}. Leave out backend= and transport= (ddpkit's own transport, CUDA IPC), or "
                             "pick transport='shm' or 'gloo'")
        return "nccl", gpus, "nccl"
    if transport == "auto":
        transport = "cuda-ipc" if len(set(gpus)) == 1 else "shm"
    if transport == "cuda-ipc" and len(set(gpus)) > 1:
        raise ValueError(f"transport='cuda-ipc' shares one GPU's buffer between ranks on that GPU, but gpus="
                         f"{list(gpus)} names {len(set(gpus))} GPUs; use transport='shm' (staged through host "
                         "memory) or 'gloo'")
    return "gloo", gpus, transport


def nccl_version() -> tuple[int, int, int] | None:
    """The NCCL that torch ships, as (major, minor, patch); None without CUDA or NCCL."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        v = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    if isinstance(v, int):  # old torch: NCCL_VERSION_CODE, major * 10000 + minor * 100 + patch since 2.9
        return v // 10000, v // 100 % 100, v % 100
    return tuple(int(x) for x in v[:3])


def rank_environment(gpus, transport: str) -> dict[str, str]:
    """A rank's environment for its transport: NCCL's multi-rank switch where ranks share a GPU."""
    return {NCCL_SHARE_SWITCH: "1"} if transport == "nccl" and shares(gpus) else {}


def check_memory_fraction(fraction, gpus) -> float | None:
    """``memory_fraction`` (``torch.cuda.set_per_process_memory_fraction`` on each rank's GPU): None,
    or a number in (0, 1] for ranks on GPUs, whose ranks sharing one GPU add up to at most 1."""
    if fraction is None:
        return None
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"memory_fraction must be a fraction of a GPU's memory in (0, 1], got {fraction!r}")
    if gpus is None:
        raise ValueError("memory_fraction caps each rank's share of its GPU's memory, but these ranks run on the "
                         "CPU; leave it out (or give the ranks GPUs: gpus=[0, 0])")
    most = max(gpus.count(g) for g in set(gpus))
    if most * fraction > 1 + 1e-9:
        raise ValueError(f"memory_fraction={fraction} for {most} ranks on one GPU asks for {most * fraction:.2f} "
                         f"of it; at most {1 / most:.3f} each")
    return float(fraction)


def carried_by(world_size: int, backend: str, gpus, transport: str) -> str:
    """What the ranks' collectives go through, in words ("gloo, 4 ranks sharing GPU 0, bytes through CUDA IPC")."""
    if gpus is None or (transport == "nccl" and not shares(gpus)):  # the CPU, or a GPU each on NCCL
        return f"{backend}, bytes through shared memory" if transport == "shm" else backend
    on = sorted(set(gpus))
    where = f"GPU {on[0]}" if len(on) == 1 else f"GPUs {', '.join(map(str, on))}"
    return (f"{backend}, {world_size} ranks {'sharing' if shares(gpus) else 'on'} {where}, "
            f"bytes through {_WORDS[transport]}")


__all__ = ["BACKENDS", "SHARED_GPU_NOTE", "TRANSPORTS", "carried_by", "check_gpus", "check_memory_fraction",
           "nccl_version", "place",
           "rank_environment", "resolve_backend", "shares", "visible_gpus"]
