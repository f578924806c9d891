"""What moving bytes between ranks that share one GPU costs, per transport, beside a device copy.

    python benchmarks/bench_shared_gpu.py [--world-sizes 2,4] [--sizes 4K,1M,64M] [--rounds 3] [--iters 5]
        [--candidates cuda-ipc,shm,gloo,nccl] [--collectives all_reduce,all_gather,reduce_scatter]

For each world size, one Cluster of that many ranks on GPU 0 (``gpus=[0] * n``; its own group only
sets the benchmark up). Inside, every rank builds each candidate transport as a process group of
its own, over a fresh store, and calls its collectives directly (``allreduce``, ``_allgather_base``,
``_reduce_scatter_base``, then ``wait()`` and a device synchronize), so nothing but the transport is
timed (``ddpkit.cluster.placement`` says what each is):

  cuda-ipc   ShmBackend with its slab on the GPU, mapped by every rank (the default for ranks sharing a GPU)
  shm        ShmBackend with its slab in host memory, CUDA tensors staged through pinned host memory
  gloo       ProcessGroupGloo on CUDA tensors (it stages through the host itself)
  nccl       ProcessGroupNCCL with NCCL_MULTI_RANK_GPU_ENABLE, only where the installed NCCL has it (2.30.3+)

The candidates take turns for every collective and size, in an order that rotates from round to
round. A call's time is the slowest rank's; each cell is the median of rounds x iters calls. GB/s
is the bus bandwidth, as nccl-tests prints it: S / t (S the full size: all-reduce the buffer,
all-gather the output, reduce-scatter the input) times 2(N-1)/N for all-reduce and (N-1)/N for
all-gather and reduce-scatter, the bytes each rank moves by the ring algorithm. Beside them, one
rank alone copying S bytes from one GPU buffer to another (S / t): the limit of moving bytes on
this GPU (the ranks share its memory bandwidth, and take turns on its SMs).

Without a GPU it runs on CPU ranks (shm and gloo on CPU tensors, a host memcpy for the copy), so
that it is known to start; those figures say nothing of a GPU, and the first line says so.
"""
from __future__ import annotations

import argparse
import statistics

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
CANDIDATES = ("cuda-ipc", "shm", "gloo", "nccl")
RING = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n}


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def _label(nbytes: int) -> str:
    return (f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB" if nbytes >= 1 << 10
            else f"{nbytes} B")


def _group(name: str, store, rank: int, n: int, dev):
    """The candidate transport ``name`` as a process group of its own, on this rank's device."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from ddpkit.comm.transport import HostStaged, ShmBackend

    timeout = timedelta(seconds=120)
    on_gpu = dev.type == "cuda"
    if name == "cuda-ipc":
        return ShmBackend(store, rank, n, timeout, device=dev)
    if name == "shm":
        shm = ShmBackend(store, rank, n, timeout)
        return HostStaged(shm) if on_gpu else shm
    if name == "gloo":
        return dist.ProcessGroupGloo(store, rank, n, timeout)
    os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"  # asked for by name here, where NCCL has it (main checks)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, n, opts)


def _call(pg, collective: str, tensors: dict):
    """One synchronous collective on ``pg`` (as ``dist.all_reduce(t)`` issues it) on ``tensors``."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import AllgatherOptions

    def sync(kind):
        opts = kind()
        opts.asyncOp = False
        return opts

    if collective == "all_reduce":
        opts = sync(dist.AllreduceOptions)
        return lambda: pg.allreduce([tensors["whole"]], opts).wait()
    if collective == "all_gather":
        opts = sync(AllgatherOptions)
        return lambda: pg._allgather_base(tensors["whole"], tensors["part"], opts).wait()
    opts = sync(dist.ReduceScatterOptions)
    return lambda: pg._reduce_scatter_base(tensors["part"], tensors["whole"], opts).wait()


def shared_gpu_job(candidates, collectives, sizes, rounds: int, iters: int) -> dict:
    """A Cluster job: {(candidate, collective, bytes): [seconds per call]} on this rank, and on rank 0
    {("copy", bytes): [seconds per device copy]}."""
    import time

    import torch
    import torch.distributed as dist

    import ddpkit
    from ddpkit.cluster.processes import loopback_store

    rank, n, dev = dist.get_rank(), dist.get_world_size(), ddpkit.device()
    finish = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    store = loopback_store(120.0) if rank == 0 else None   # rank 0 hosts it, on loopback only
    port = [store.port if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    if rank != 0:
        store = dist.TCPStore("127.0.0.1", port[0], n, False)
    groups = {c: _group(c, dist.PrefixStore(f"bench/{c}", store), rank, n, dev) for c in candidates}
    times: dict = {}
    for s in sizes:
        elems = max(n, s // 4 // n * n)
        buffers = {"whole": torch.randn(elems, device=dev), "part": torch.randn(elems // n, device=dev)}
        calls = {(c, coll): _call(groups[c], coll, buffers) for c in candidates for coll in collectives}
        for r in range(rounds):
            order = candidates[r % len(candidates):] + candidates[:r % len(candidates)]
            for coll in collectives:
                for c in order:
                    call = calls[(c, coll)]
                    call()  # warm-up: the peers meet here
                    finish()
                    for _ in range(iters):
                        t = time.perf_counter()
                        call()
                        finish()
                        times.setdefault((c, coll, s), []).append(time.perf_counter() - t)
        if rank == 0:  # one rank alone: the device copy of the same bytes
            src, dst = torch.randn(s // 4, device=dev), torch.empty(s // 4, device=dev)
            dst.copy_(src)
            finish()
            for _ in range(rounds * iters):
                t = time.perf_counter()
                dst.copy_(src)
                finish()
                times.setdefault(("copy", s), []).append(time.perf_counter() - t)
        del buffers, calls
        dist.barrier()
    return times


def _median_of_slowest(per_rank: list[dict], key) -> float:
    """Per call, the slowest rank's time; their median (s)."""
    return statistics.median(max(ts) for ts in zip(*(r[key] for r in per_rank), strict=True))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", default="2,4", help="ranks sharing GPU 0, comma-separated (default 2,4)")
    p.add_argument("--sizes", default="4K,1M,64M", help="full sizes S (default 4K,1M,64M)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=5, help="timed calls per cell and round")
    p.add_argument("--candidates", default=",".join(CANDIDATES),
                   help="transports (default all; nccl only where NCCL has its multi-rank switch)")
    p.add_argument("--collectives", default=",".join(COLLECTIVES))
    return p


def main(argv=None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        world_sizes = [int(w) for w in args.world_sizes.split(",")]
        sizes = [_size(s) for s in args.sizes.split(",")]
    except (ValueError, IndexError):
        p.error(f"--world-sizes takes whole numbers and --sizes sizes like 4K,1M,64M; got {args.world_sizes!r}, "
                f"{args.sizes!r}")
    candidates = [c for c in args.candidates.split(",") if c]
    collectives = [c for c in args.collectives.split(",") if c]
    unknown = sorted((set(candidates) - set(CANDIDATES)) | (set(collectives) - set(COLLECTIVES)))
    if unknown or args.rounds < 1 or args.iters < 1 or min(world_sizes) < 2 or min(sizes) < 4:
        p.error(f"need known candidates ({', '.join(CANDIDATES)}) and collectives ({', '.join(COLLECTIVES)}), "
                f"--rounds and --iters >= 1, world sizes >= 2 and sizes >= 4 bytes; unknown: {unknown}")

    import torch

    import ddpkit
    from ddpkit.cluster.placement import NCCL_SHARES_GPUS_FROM, nccl_version

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        print(f"GPU 0: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; ranks sharing it, each its own "
              "process and CUDA context")
        version = nccl_version()
        if "nccl" in candidates and (version is None or version < NCCL_SHARES_GPUS_FROM):
            have = ".".join(map(str, version)) if version else "none"
            print(f"nccl: left out: this NCCL ({have}) refuses two ranks on one GPU; its multi-rank switch "
                  f"arrived in {'.'.join(map(str, NCCL_SHARES_GPUS_FROM))}")
            candidates.remove("nccl")
    else:
        candidates = [c for c in candidates if c in ("shm", "gloo")] or ["shm"]
        print(f"no CUDA GPU here: CPU ranks stand in ({', '.join(candidates)} on CPU tensors, a host memcpy for the "
              "copy), to show that the benchmark starts; these figures say nothing of a GPU")
    for n in world_sizes:
        with ddpkit.Cluster(n, gpus=[0] * n if on_gpu else None, transport="gloo", timeout=120.0) as cluster:
            per_rank = cluster.run(shared_gpu_job, candidates, collectives, sizes, args.rounds, args.iters)
        where = "sharing GPU 0" if on_gpu else "on the CPU"
        print(f"\n{n} ranks {where}: bus bandwidth in GB/s (and the median call, the slowest rank's), "
              f"{args.rounds} rounds x {args.iters} calls")
        print(f"{'':<26}" + "".join(f"{_label(s):>22}" for s in sizes))
        copy = {s: per_rank[0][("copy", s)] for s in sizes}
        print(f"{'device copy, one rank: S/t':<26}" + "".join(
            _cell(s / statistics.median(copy[s]) / 1e9, statistics.median(copy[s])) for s in sizes))
        for coll in collectives:
            print(coll)
            best = {}
            for c in candidates:
                row = ""
                for s in sizes:
                    t = _median_of_slowest(per_rank, (c, coll, s))
                    gbps = s / t * RING[coll](n) / 1e9
                    best[s] = max(best.get(s, (0.0, "")), (gbps, c))
                    row += _cell(gbps, t)
                print(f"  {c:<24}{row}")
            print(f"  {'fastest':<24}" + "".join(f"{best[s][1]:>22}" for s in sizes))


def _cell(gbps: float, seconds: float) -> str:
    took = f"{seconds * 1e6:.0f} us" if seconds < 1e-2 else f"{seconds * 1e3:.1f} ms"
    return f"{gbps:9.2f} ({took})".rjust(22)


if __name__ == "__main__":
    main()
