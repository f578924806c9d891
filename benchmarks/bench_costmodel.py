"""How near the cost model comes to measured steps, and which term of it misses.

    python benchmarks/bench_costmodel.py [--world-sizes 2,4] [--runs 3] [--rounds 5] [--steps 10]
                                         [--network 10GbE] [--strategies ...] [--bucket-cap-mb MB]
                                         [--width W --depth D] [--phases] [--json PATH]

Each run starts a Cluster per world size on the emulated ``--network`` and calls
``costmodel.validate`` (what ``python -m ddpkit predict --validate`` runs: calibration, profile,
each wrapper alone and the timed strategies, interleaved over ``--rounds`` rounds), then prints its
table: per strategy the median step of the rounds, their range and spread, the model's step and its
error. After the runs, per world size and strategy, the error of each run, and per run the mean and
the worst |error| and whether the model put the strategies in the measured order.

``--phases`` also takes the step apart, in the same cluster right after the timing rounds: every
rank times forward, backward (its gradient synchronisation included) and the optimizer step of each
strategy, on the clock and in its own thread's CPU time; the model's own phases sit beside them
(``Prediction.phases_ms``), and the cores' bound beside the measured step (``phases_table``). A
phase whose wall time the model misses while its CPU time matches the model's compute is waiting the
model does not see (a collective, a wake-up, the ranks' turns on the cores); one whose CPU time is
off is work the profile or the host-work timing does not see.

The machine's load (``os.getloadavg``) is printed at the start and the end of every run: judge the
figures only from a quiet machine (a load near zero before the run).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time

PHASES = ("forward", "backward", "step")


def phase_job(name: str, workload, global_batch_size: int, bucket_cap_mb, steps: int, optimizer: str = "sgd"):
    """A Cluster job: train ``name`` for a warmup and ``steps`` steps as ``experiment.train_batch``
    does, timing its forward, backward (with the gradient synchronisation) and optimizer step;
    ``{phase: (median wall ms, median CPU ms of this thread)}``."""
    import torch.distributed as dist

    from ddpkit.experiment import wrap
    from ddpkit.rankside import device

    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = wrap(name, workload.build(0), optimizer, bucket_cap_mb)
    wall = {p: [] for p in PHASES}
    cpu = {p: [] for p in PHASES}
    for step in range(steps + 1):  # the first is a warmup
        batch = workload.local_batch(step, global_batch_size, rank, world, device())
        marks = [(time.perf_counter(), time.thread_time())]
        value = workload.compute_loss(model, batch)
        marks.append((time.perf_counter(), time.thread_time()))
        value.backward()
        model.finish_gradient_synchronization()
        marks.append((time.perf_counter(), time.thread_time()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        marks.append((time.perf_counter(), time.thread_time()))
        if step:
            for p, (a, b) in zip(PHASES, itertools.pairwise(marks), strict=True):
                wall[p].append(1e3 * (b[0] - a[0]))
                cpu[p].append(1e3 * (b[1] - a[1]))
    return {p: (statistics.median(wall[p]), statistics.median(cpu[p])) for p in PHASES}


def phases_table(cluster, records, workload, global_batch_size, bucket_cap_mb, steps) -> list[str]:
    """Measured phases (the slowest rank's, by its whole step) beside the model's, per strategy; and
    the cores' bound: the ranks' CPU per step (each rank's own thread, summed over its phases, the
    busiest rank's) shared out over this machine's cores, beside the measured step. Where it comes
    near the step, the ranks take turns on the cores (more ranks than cores) and the step is their
    compute one after another, not one rank's compute with its waits."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    lines = [f"{'ranks':>5}  {'strategy':>17}  " + "  ".join(f"{p + ' wall/cpu/model':>24}" for p in PHASES)
             + f"  {'cores bound/step':>16}"]
    for r in records:
        if "error" in r:
            continue
        ranks = cluster.run(phase_job, r["strategy"], workload, global_batch_size, bucket_cap_mb, steps)
        slowest = max(ranks, key=lambda ph: sum(wall for wall, _ in ph.values()))
        busiest = max(sum(cpu for _, cpu in ph.values()) for ph in ranks)
        bound = busiest * max(1.0, r["world_size"] / cores)
        model = r["predicted_phases_ms"]
        cells = [f"{slowest[p][0]:7.1f} {slowest[p][1]:7.1f} {model[p]:7.1f}" for p in PHASES]
        lines.append(f"{r['world_size']:>5}  {r['strategy']:>17}  " + "  ".join(f"{c:>24}" for c in cells)
                     + f"  {bound:7.1f} {r['measured_ms']:8.1f}")
    lines.append(f"cores bound: the busiest rank's CPU per step x max(1, ranks / {cores} cores), beside the "
                 "measured step (ms)")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--network", default="10GbE")
    p.add_argument("--strategies", default=None, help="comma-separated (default: every predictable one)")
    p.add_argument("--bucket-cap-mb", type=float, default=None)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--width", type=int, default=None, help="the MLP's width (default: the course's)")
    p.add_argument("--depth", type=int, default=None, help="the MLP's depth (default: the course's)")
    p.add_argument("--phases", action="store_true", help="also time each phase of a step (see the docstring)")
    p.add_argument("--json", default=None, help="write every run's records here")
    a = p.parse_args()

    import ddpkit
    from ddpkit.costmodel.validate import format_profile, format_validation, spread, summary, validate
    from ddpkit.strategies.table import NAMES, strategy, unfit
    from ddpkit.workload import resolve

    sizes = [int(n) for n in a.world_sizes.split(",")]
    names = a.strategies.split(",") if a.strategies else [s for s in NAMES if strategy(s).predictable]
    try:
        network = ddpkit.Network.of(a.network)
        [strategy(s) for s in names]
    except ValueError as exc:
        p.error(str(exc))
    if a.runs < 1 or a.rounds < 1 or a.steps < 1 or min(sizes) < 2:
        p.error("--runs, --rounds and --steps must be >= 1, and every world size >= 2")
    kwargs = {k: v for k, v in (("width", a.width), ("depth", a.depth)) if v is not None}
    workload = resolve(None, model_kwargs=kwargs or None)
    runs = []
    for run in range(a.runs):
        print(f"run {run + 1} of {a.runs}: load {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)",
              flush=True)
        records = []
        for n in sizes:
            fits = [s for s in names if s not in unfit(names, [n], network)]
            with ddpkit.Cluster(n, network=network) as cluster:
                recs, _, profile = validate(cluster, fits, workload=workload, rounds=a.rounds, steps=a.steps,
                                            global_batch_size=a.global_batch_size, bucket_cap_mb=a.bucket_cap_mb)
                print(f"{n} ranks on {network.describe()}: {format_profile(profile)}", flush=True)
                if a.phases:
                    print("\n".join(phases_table(cluster, recs, workload, a.global_batch_size, a.bucket_cap_mb,
                                                 a.steps)), flush=True)
            records += recs
        print(format_validation(records))
        print(f"load at the end of run {run + 1}: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n", flush=True)
        runs.append(records)

    print(f"every run ({a.runs}, {a.rounds} rounds of {a.steps} steps each): error = model / measured - 1")
    for n in sizes:
        by_name: dict = {}
        for records in runs:
            for r in records:
                if r["world_size"] == n and "error" not in r:
                    by_name.setdefault(r["strategy"], []).append(r)
        for name, rs in by_name.items():
            errors = "  ".join(f"{r['rel_error']:+6.1%} (spread {spread(r):4.0%})" for r in rs)
            print(f"{n:>5}  {name:>17}  {errors}")
        for k, records in enumerate(runs):
            lines = summary([r for r in records if r["world_size"] == n])
            print(f"{n:>5}  run {k + 1}: " + "; ".join(lines))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=1)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
