"""What moving bytes between the ranks of this host costs: α and β per collective, gloo vs shared memory.

    python benchmarks/bench_transport.py [--world-size 2] [--rounds 5] [--iters 8] [--sizes 4K,64K,256K,1M,8M]
        [--candidates gloo,gloo-lo,gloo-2lo,gloo-lazy,gloo-1thread,gloo-4threads,shm,shm-chunk256K,shm-slots2]
        [--collectives all_reduce,all_gather,reduce_scatter,broadcast]

Part 1, the transports alone. Inside one Cluster (on gloo: its own group only sets the benchmark
up) every rank builds each candidate as a process group of its own (over a fresh TCPStore, one
prefix per candidate) and calls its collectives directly (``allreduce``, ``_allgather_base``,
``_reduce_scatter_base``, ``broadcast``, then ``wait()``, with ``asyncOp`` off as
``dist.all_reduce(t)`` passes it), so nothing but the transport is timed. Everything is
interleaved in one run: for every collective and size, the candidates take turns, in an order
that rotates from round to round, so a burst of load from others on the machine hits them alike.
A call's time is the slowest rank's (a collective is done when every rank has it); each cell
shows the median of rounds x iters calls and its spread (25th-75th percentile). α and β come
from a least-squares fit of the medians, t = α + S / β, S the full size (all-reduce: the buffer,
all-gather: the output, reduce-scatter: the input, broadcast: the buffer).

  gloo            ProcessGroupGloo as the Cluster builds it (device from the host name: loopback here)
  gloo-lo         gloo on a device bound to interface "lo" (what GLOO_SOCKET_IFNAME=lo does)
  gloo-2lo        two such devices (GLOO_SOCKET_IFNAME=lo,lo: pairs spread over two)
  gloo-lazy       gloo connecting its pairs on first use (what TORCH_GLOO_LAZY_INIT=1 does)
  gloo-1thread    gloo with 1 worker thread (default: 2); gloo-4threads: 4
  shm             ddpkit.comm.transport.ShmBackend as a Cluster builds it: 2 MiB regions (``chunk_bytes``,
                  the largest piece a rank deposits at once), 8 pieces in flight (``slots``)
  shm-chunk256K   256 KiB regions: a 1 MB all-reduce goes through in 4 pieces instead of 1
  shm-slots2      2 pieces in flight: an 8 MB all-reduce (4 pieces) deposits its third only once
                  every rank completed its first (more, combinable: ``shm-chunk<SIZE>-slots<N>``)

Part 2, the goal: between 2 ranks of a Cluster. Two Clusters, transport="gloo" and "shm", live
together; rounds alternate between them; each times ``dist.all_reduce`` through the cluster's own
process group (ddpkit's, over its transport: what every strategy sees) at 4 KB and 1 MB, called
synchronously (``dist.all_reduce(t)``: the goal, shm <= 0.5x gloo at 4 KB, <= 0.4x at 1 MB) and
asynchronously (``async_op=True``, then ``wait()``: how buckets are reduced). On shm neither hands
the collective to a thread to start it: the call deposits this rank's part where it is made (and
completes it there if the peer's part is in); what is left is moved by whoever comes first,
``wait()`` on the calling thread or, for an asynchronous call, the group's own thread.

Where the kernel puts the ranks decides much of it on 2 cores: two ranks on one core take turns
at every barrier, so small collectives come out bimodal. Each part prints how often, of the
samples taken after each block of calls, the ranks sat on one core.
"""
from __future__ import annotations

import argparse
import os
import statistics

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
CANDIDATES = ("gloo", "gloo-lo", "gloo-2lo", "gloo-lazy", "gloo-1thread", "gloo-4threads",
              "shm", "shm-chunk256K", "shm-slots2")


def _group(name: str, store, rank: int, n: int):
    """The candidate transport ``name`` as a process group of its own."""
    from datetime import timedelta

    import torch.distributed as dist

    from ddpkit.comm.transport import ShmBackend

    timeout = timedelta(seconds=60)
    if name.startswith("shm"):
        return ShmBackend(store, rank, n, timeout, **_shm_options(name))
    if name == "gloo":
        return dist.ProcessGroupGloo(store, rank, n, timeout)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    lo = dist.ProcessGroupGloo.create_device(interface="lo", lazy_init=name == "gloo-lazy")
    opts._devices = [lo, dist.ProcessGroupGloo.create_device(interface="lo")] if name == "gloo-2lo" else [lo]
    if name.endswith("threads") or name.endswith("thread"):
        opts._threads = int(name.split("-")[1].rstrip("threads"))
    return dist.ProcessGroupGloo(store, rank, n, opts)


def _shm_options(name: str) -> dict:
    """``ShmBackend``'s keywords for a candidate: ``shm``, none (its defaults, as a Cluster builds
    it); ``shm-chunk256K``: ``chunk_bytes`` 256 KiB per rank's region; ``shm-slots2``: ``slots``
    2 pieces in flight; combinable (``shm-chunk256K-slots2``)."""
    opts = {}
    for part in name.split("-")[1:]:
        try:
            if part.startswith("chunk"):
                opts["chunk_bytes"] = _size(part[5:])
            elif part.startswith("slots"):
                opts["slots"] = int(part[5:])
            else:
                raise ValueError
        except (ValueError, IndexError, KeyError):
            raise ValueError(f"unknown shm option {part!r} in {name!r}: chunk<SIZE> (e.g. chunk256K) "
                             "or slots<N> (e.g. slots2)") from None
    return opts


def _call(pg, collective: str, nbytes: int, n: int):
    """One collective of ``nbytes`` (the full size) on ``pg``, its tensors made once."""
    import torch
    import torch.distributed as dist

    from torch.distributed.distributed_c10d import AllgatherOptions

    def sync(kind):  # what torch's synchronous calls pass (``dist.all_reduce(t)``: asyncOp False)
        opts = kind()
        opts.asyncOp = False
        return opts

    elems = max(n, nbytes // 4 // n * n)
    if collective == "all_reduce":
        t, opts = torch.randn(elems), sync(dist.AllreduceOptions)
        return lambda: pg.allreduce([t], opts).wait()
    if collective == "all_gather":
        out, inp, opts = torch.empty(elems), torch.randn(elems // n), sync(AllgatherOptions)
        return lambda: pg._allgather_base(out, inp, opts).wait()
    if collective == "reduce_scatter":
        out, inp, opts = torch.empty(elems // n), torch.randn(elems), sync(dist.ReduceScatterOptions)
        return lambda: pg._reduce_scatter_base(out, inp, opts).wait()
    t, opts = torch.randn(elems), sync(dist.BroadcastOptions)
    return lambda: pg.broadcast([t], opts).wait()


def transports_job(candidates, collectives, sizes, rounds: int, iters: int) -> dict:
    """A Cluster job: {(candidate, collective, bytes): [seconds per call]} on this rank."""
    import time

    import torch.distributed as dist

    from ddpkit.cluster.processes import loopback_store

    rank, n = dist.get_rank(), dist.get_world_size()
    store = loopback_store(60.0) if rank == 0 else None   # rank 0 hosts it, on loopback only
    port = [store.port if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    if rank != 0:
        store = dist.TCPStore("127.0.0.1", port[0], n, False)
    groups = {c: _group(c, dist.PrefixStore(f"bench/{c}", store), rank, n) for c in candidates}
    calls = {(c, coll, s): _call(groups[c], coll, s, n) for c in candidates for coll in collectives for s in sizes}
    times = {key: [] for key in calls}
    for r in range(rounds):
        order = candidates[r % len(candidates):] + candidates[:r % len(candidates)]
        for coll in collectives:
            for s in sizes:
                for c in order:
                    call = calls[(c, coll, s)]
                    call()  # warm-up: the peers meet here
                    for _ in range(iters):
                        t = time.perf_counter()
                        call()
                        times[(c, coll, s)].append(time.perf_counter() - t)
                    times.setdefault("cpus", []).append(_cpu())
    dist.barrier()
    return times


def cluster_job(sizes, iters: int) -> dict:
    """A Cluster job: {(bytes, "sync" or "async"): [seconds per dist.all_reduce]} through the
    cluster's own group; async: ``dist.all_reduce(t, async_op=True).wait()``."""
    import time

    import torch
    import torch.distributed as dist

    out = {}
    for s in sizes:
        t = torch.randn(s // 4)
        for mode in ("sync", "async"):
            dist.all_reduce(t)
            out[(s, mode)] = []
            for _ in range(iters):
                a = time.perf_counter()
                if mode == "sync":
                    dist.all_reduce(t)
                else:
                    dist.all_reduce(t, async_op=True).wait()
                out[(s, mode)].append(time.perf_counter() - a)
            out.setdefault("cpus", []).append(_cpu())
    return out


def _cpu() -> int:
    """The core this process last ran on (Linux; -1 elsewhere): 2 ranks on 1 core of 2 take
    turns at every barrier, which is what makes small collectives bimodal here."""
    try:
        with open("/proc/self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return -1


def _shared_core(per_rank: list[dict]) -> str:
    """How often (of the samples taken after each block of calls) two ranks sat on one core."""
    samples = list(zip(*(r["cpus"] for r in per_rank), strict=True))
    if not samples or -1 in samples[0]:
        return "placement unknown"
    shared = sum(len(set(s)) < len(s) for s in samples)
    return f"ranks shared a core in {shared} of {len(samples)} samples"


def _slowest(per_rank: list[list[float]]) -> list[float]:
    """Per call, the slowest rank's time (ms): the collective is done when every rank has it."""
    return [1e3 * max(ts) for ts in zip(*per_rank, strict=True)]


def _stats(ms: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
    return statistics.median(ms), q[0], q[2]


def _fit(points):
    """Least squares t = α + S/β over (bytes, ms): (α in µs, β in GB/s)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if len(xs) < 2:
        return float("nan"), float("nan")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    alpha_ms = my - slope * mx
    return 1e3 * alpha_ms, (1 / slope) * 1e3 / 1e9 if slope > 0 else float("inf")


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def _label(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=8, help="timed calls per cell and round")
    p.add_argument("--sizes", default="4K,64K,256K,1M,8M")
    p.add_argument("--candidates", default=",".join(CANDIDATES))
    p.add_argument("--collectives", default=",".join(COLLECTIVES))
    args = p.parse_args()
    sizes = [_size(s) for s in args.sizes.split(",")]
    candidates = args.candidates.split(",")
    collectives = args.collectives.split(",")
    if args.rounds < 2 or args.iters < 1 or args.world_size < 2 or "gloo" not in candidates:
        p.error("need --rounds >= 2, --iters >= 1, --world-size >= 2 and gloo among the candidates (the ratios "
                f"are to it); got --rounds {args.rounds} --iters {args.iters} --world-size {args.world_size}")
    unknown = {c for c in candidates if c not in CANDIDATES and not c.startswith("shm-")}
    unknown |= set(collectives) - set(COLLECTIVES)
    if unknown:
        p.error(f"unknown candidate or collective: {sorted(unknown)}")
    for c in candidates:
        if c.startswith("shm-"):
            try:
                _shm_options(c)
            except ValueError as err:
                p.error(str(err))

    import ddpkit

    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start; "
          f"{args.world_size} ranks, {args.rounds} rounds x {args.iters} calls per cell, interleaved")
    with ddpkit.Cluster(args.world_size, backend="gloo", transport="gloo") as cluster:
        per_rank = cluster.run(transports_job, candidates, collectives, sizes, args.rounds, args.iters)
    cells = {key: _stats(_slowest([r[key] for r in per_rank])) for key in per_rank[0] if key != "cpus"}

    print(f"\nPart 1: the transports alone; median ms [25th-75th percentile], and x gloo ({_shared_core(per_rank)})")
    for coll in collectives:
        print(f"\n{coll:<15}" + "".join(f"{c:>24}" for c in candidates))
        for s in sizes:
            base = cells[("gloo", coll, s)][0]
            row = "".join(f"{m:>8.3f} [{lo:.3f}-{hi:.3f}]".rjust(24) for m, lo, hi in
                          (cells[(c, coll, s)] for c in candidates))
            ratio = "".join(f"{cells[(c, coll, s)][0] / base:>24.2f}x" for c in candidates if c != "gloo")
            print(f"{_label(s):<15}{row}\n{'  x gloo':<39}{ratio}")
    print("\nα (µs) and β (GB/s), fitted to the medians, t = α + S / β")
    print(f"{'':<15}" + "".join(f"{c:>18}" for c in candidates))
    for coll in collectives:
        fits = [_fit([(s, cells[(c, coll, s)][0]) for s in sizes]) for c in candidates]
        print(f"{coll:<15}" + "".join(f"{a:>8.0f} µs {b:>5.2f}".rjust(18) for a, b in fits))

    goal_sizes = [4 << 10, 1 << 20]
    rounds = {"gloo": [], "shm": []}
    print(f"\nPart 2: dist.all_reduce between {args.world_size} ranks of a Cluster, transport gloo vs shm "
          "(two clusters, rounds alternating)")
    with ddpkit.Cluster(args.world_size, backend="gloo", transport="gloo") as cg, \
            ddpkit.Cluster(args.world_size, backend="gloo", transport="shm") as cs:
        for r in range(2 * args.rounds):
            for name, c in ((("gloo", cg), ("shm", cs)) if r % 2 == 0 else (("shm", cs), ("gloo", cg))):
                rounds[name].append(c.run(cluster_job, goal_sizes, 4 * args.iters))
    for name, runs in rounds.items():   # each rank's core samples, over all its runs
        per_rank = [{"cpus": [c for res in runs for c in res[r]["cpus"]]} for r in range(args.world_size)]
        print(f"  {name}: {_shared_core(per_rank)}")
    for mode in ("sync", "async"):
        for s, goal in zip(goal_sizes, (0.5, 0.4), strict=True):
            med = {}
            for name in rounds:
                ms = [t for res in rounds[name] for t in _slowest([rank_res[(s, mode)] for rank_res in res])]
                med[name] = _stats(ms)
            ratio = med["shm"][0] / med["gloo"][0]
            verdict = f"goal <= {goal}x: {'met' if ratio <= goal else 'NOT met'}" if mode == "sync" else "no goal"
            what = "dist.all_reduce(t)" if mode == "sync" else "dist.all_reduce(t, async_op=True).wait()"
            print(f"{_label(s):>5} all-reduce through a Cluster, {what}: shm {med['shm'][0]:.3f} ms "
                  f"[{med['shm'][1]:.3f}-{med['shm'][2]:.3f}], gloo {med['gloo'][0]:.3f} ms [{med['gloo'][1]:.3f}-"
                  f"{med['gloo'][2]:.3f}] -> {ratio:.2f}x gloo ({verdict})")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
