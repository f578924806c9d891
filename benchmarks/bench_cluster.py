"""How long a Cluster takes to start, and to run a job that does nothing.

    python benchmarks/bench_cluster.py [--world-size 2] [--repeats 3] [--round-trips 200]

Prints, for a gloo Cluster:
- cold start: ``Cluster(...)`` plus the first no-op ``run()`` (fresh interpreters import
  torch and join the process group); target <= 3 s for 2 ranks;
- warm round trip: one ``run(noop)`` on ready ranks (pickle, send, run, reply); median and
  90th percentile; target <= 5 ms;
and, for comparison in the same run, ``torch.multiprocessing.spawn`` of the same number of
ranks that each join a gloo process group, pass one barrier and exit: what a notebook would
pay per experiment without persistent ranks. Then a new shared-memory process group (its slab
mapped, every page in place) and its first all-reduces, one per slot of the slab, against the same
group's next ones: what a fresh cluster's first collectives cost.
"""
from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta

from ddpkit.comm.transport.shm import SLOTS  # a group's slab has this many slots, used in turn


def _noop():
    return None


def _spawned_rank(rank: int, world_size: int, port: int) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    dist.barrier()
    dist.destroy_process_group()


def cold_start(world_size: int) -> float:
    import ddpkit

    t0 = time.perf_counter()
    cluster = ddpkit.Cluster(world_size=world_size, backend="gloo")
    cluster.run(_noop)
    took = time.perf_counter() - t0
    cluster.shutdown()
    return took


def warm_round_trips(world_size: int, n: int) -> list[float]:
    import ddpkit

    with ddpkit.Cluster(world_size=world_size, backend="gloo") as cluster:
        for _ in range(10):  # warm up: first pickles, first sends
            cluster.run(_noop)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            cluster.run(_noop)
            times.append(time.perf_counter() - t0)
    return times


def _fresh_group(nbytes: int, calls: int) -> tuple[float, list[float], list[float]]:
    """On every rank: a new group over all of them (seconds to make it and pass a barrier), then
    ``calls`` all-reduces of ``nbytes`` on it, then ``calls`` more: each call's seconds."""
    import torch
    import torch.distributed as dist

    t = torch.ones(nbytes // 4)
    dist.all_reduce(t)  # the tensor and the code path are warm; only the group is new
    dist.barrier()
    t0 = time.perf_counter()
    group = dist.new_group(list(range(dist.get_world_size())))
    dist.barrier(group=group)
    made = time.perf_counter() - t0
    times = []
    for _ in range(2 * calls):
        t1 = time.perf_counter()
        dist.all_reduce(t, group=group)
        times.append(time.perf_counter() - t1)
    dist.destroy_process_group(group)
    return made, times[:calls], times[calls:]


def fresh_groups(world_size: int, repeats: int, sizes=(1 << 20, 4 << 20), calls: int = SLOTS) -> dict:
    """{bytes: (ms to make a group, first calls' median ms, later calls' median ms)}, each the
    median over ``repeats`` shared-memory groups of the slowest rank's figures (``SLOTS`` calls:
    every slot of the slab used once, for the first time)."""
    import ddpkit

    out = {}
    with ddpkit.Cluster(world_size=world_size, backend="gloo", transport="shm") as cluster:
        for nbytes in sizes:
            made, first, later = [], [], []
            for _ in range(repeats):
                ranks = cluster.run(_fresh_group, nbytes, calls)
                made.append(max(r[0] for r in ranks))
                first.append(statistics.median(max(c) for c in zip(*(r[1] for r in ranks), strict=True)))
                later.append(statistics.median(max(c) for c in zip(*(r[2] for r in ranks), strict=True)))
            out[nbytes] = tuple(1e3 * statistics.median(x) for x in (made, first, later))
    return out


def spawn_start(world_size: int) -> float:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.spawn(_spawned_rank, args=(world_size, store.port), nprocs=world_size, join=True)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--round-trips", type=int, default=200)
    a = p.parse_args()

    import torch  # noqa: F401  (imported once here, so no measurement includes the parent's import)

    colds = [cold_start(a.world_size) for _ in range(a.repeats)]
    spawns = [spawn_start(a.world_size) for _ in range(a.repeats)]
    trips = sorted(warm_round_trips(a.world_size, a.round_trips))
    p90 = trips[int(0.9 * (len(trips) - 1))]
    ws = a.world_size
    print(f"cold start, Cluster({ws}) + first no-op run: median {statistics.median(colds):.2f} s "
          f"(runs: {', '.join(f'{t:.2f}' for t in colds)}; target <= 3 s for 2 ranks)")
    print(f"torch.multiprocessing.spawn, {ws} gloo ranks, init + barrier + exit: median "
          f"{statistics.median(spawns):.2f} s (runs: {', '.join(f'{t:.2f}' for t in spawns)})")
    print(f"warm no-op round trip, {ws} ranks: median {1e3 * statistics.median(trips):.3f} ms, "
          f"p90 {1e3 * p90:.3f} ms over {len(trips)} runs (target <= 5 ms)")
    for nbytes, (made, first, later) in fresh_groups(a.world_size, a.repeats).items():
        print(f"new shared-memory group of {ws} ranks: made in {made:.1f} ms; all-reduce of {nbytes >> 20} MiB: "
              f"first {SLOTS} calls {first:.3f} ms, the next {SLOTS} {later:.3f} ms (medians over {a.repeats} groups)")


if __name__ == "__main__":
    main()
