"""What a synchronisation costs when ranks share cores: the term the cost model does not have.

    python benchmarks/bench_contention.py [--world-sizes 2,4] [--chunks-ms 0.5,2,5] [--iters 60] [--repeats 2]
                                          [--network 10GbE]

Every rank of a Cluster runs three loops of ``--iters`` iterations: a chunk of compute (matrix
products, about ``--chunks-ms`` on one core), a small all-gather (1 KiB, on the emulated
``--network``), and both, one after the other. Per iteration, the median over the ranks' medians:

    sync cost = both - compute alone - all-gather alone

With a core per rank it stays near zero; with more ranks than cores (4 on a 2-core laptop) every
all-gather waits until the last rank has had a core for its chunk, which neither the compute
alone (no rank waits for another) nor the collective alone (nobody computes) shows. FSDP issues
three such synchronous collectives per unit, which is where ``predict --validate`` misses most
(docs/laptop_cluster.md, "Does the cost model hold?").
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def _loops(chunk_ms: float, iters: int) -> tuple[float, float, float]:
    """(compute, all-gather, both): this rank's median ms per iteration of each loop."""
    import torch
    import torch.distributed as dist

    from ddpkit.costmodel.measure import compute_chunk  # timed one rank at a time, on a core of its own
    from ddpkit.torch_internals import all_gather_flat  # torch 2.13's name, without its warning

    chunk = compute_chunk(chunk_ms / 1e3)
    small = torch.ones(256)  # 1 KiB of float32
    out = torch.empty(256 * dist.get_world_size())

    def loop(compute: bool, sync: bool) -> float:
        dist.barrier()
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            if compute:
                chunk()
            if sync:
                all_gather_flat(out, small)
            times.append(time.perf_counter() - t)
        return statistics.median(times[iters // 10:]) * 1e3  # the first tenth warms up

    return loop(True, False), loop(False, True), loop(True, True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--chunks-ms", default="0.5,2,5")
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--network", default="10GbE")
    a = p.parse_args()
    world_sizes = [int(n) for n in a.world_sizes.split(",")]
    chunks = [float(c) for c in a.chunks_ms.split(",")]
    if a.iters < 10 or a.repeats < 1 or min(world_sizes) < 2 or min(chunks) <= 0:
        p.error(f"need --iters >= 10, --repeats >= 1, world sizes >= 2 and chunks > 0; got --iters {a.iters} "
                f"--repeats {a.repeats} --world-sizes {a.world_sizes} --chunks-ms {a.chunks_ms}")

    import ddpkit

    print(f"{os.cpu_count()} cores; each rank one torch thread; all-gather of 1 KiB on {a.network}; "
          f"{a.iters} iterations per loop, {a.repeats} repeats")
    print(f"{'ranks':>5}  {'chunk':>8}  {'compute':>8}  {'gather':>8}  {'both':>8}  {'sync cost (repeats)':>24}")
    for n in world_sizes:
        with ddpkit.Cluster(n, backend="gloo", network=a.network, threads_per_rank=1) as cluster:
            for chunk in chunks:
                rows = []
                for _ in range(a.repeats):
                    per_rank = cluster.run(_loops, chunk, a.iters)
                    rows.append([statistics.median(r[i] for r in per_rank) for i in range(3)])
                costs = [both - compute - gather for compute, gather, both in rows]
                compute, gather, both = (statistics.median(r[i] for r in rows) for i in range(3))
                spread = ", ".join(f"{c:+.2f}" for c in costs)
                print(f"{n:>5}  {chunk:>5.1f} ms  {compute:8.2f}  {gather:8.2f}  {both:8.2f}  {spread:>21} ms")
    print("sync cost per iteration = both - compute alone - all-gather alone (ms; medians over the ranks)")


if __name__ == "__main__":
    main()
