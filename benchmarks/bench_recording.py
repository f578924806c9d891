"""What recording costs: OverlappedDDP step time with the recorder on vs off, in one run.

    python benchmarks/bench_recording.py [--world-size 2] [--rounds 20] [--steps 5]

Two copies of the same model are wrapped on every rank, one with ``ddpkit.trace.Recorder``
and one with the default do-nothing recorder, and they train in alternating blocks
(off/on, then on/off, ...) so that machine noise hits both alike. Target: recording on costs
<= 5% of step time (the 256x32 MLP, 2 gloo ranks); recording off costs nothing by design
(the null recorder's calls return at once).
"""
from __future__ import annotations

import argparse
import statistics


def job(rounds: int, steps: int, width: int, depth: int, batch: int):
    """A Cluster job: median ms/step with recording off and on, and records kept per step."""
    import time

    import torch.distributed as dist

    import ddpkit
    from ddpkit.experiment import local_batch, make_optimizer, train_step
    from ddpkit.models import build_model
    from ddpkit.trace.seam import NULL_RECORDER
    from ddpkit.trace import Recorder

    rank, world = dist.get_rank(), dist.get_world_size()
    recorder = Recorder(rank=rank, world_size=world)
    runs = {}
    for mode, rec in (("off", NULL_RECORDER), ("on", recorder)):
        module = build_model("mlp", width=width, depth=depth)
        model = ddpkit.OverlappedDDP(module, recorder=rec)
        runs[mode] = (model, make_optimizer(model.parameters(), "sgd"), rec, [])
    x, y = local_batch(runs["off"][0].module, batch, 0, rank, world)
    for r in range(rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            model, opt, rec, times = runs[mode]
            for _ in range(steps):
                dist.barrier()  # start every step together, as in training
                if rec.enabled:
                    rec.next_step()
                t = time.perf_counter()
                train_step(model, opt, x, y, rec)
                times.append((time.perf_counter() - t) * 1e3)
    warm = steps  # drop each mode's first block (allocation, first-touch)
    off = statistics.median(runs["off"][3][warm:])
    on = statistics.median(runs["on"][3][warm:])
    return dict(off=off, on=on, records_per_step=len(recorder.records) / (rounds * steps))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=32)
    p.add_argument("--batch", type=int, default=32, help="global batch size")
    args = p.parse_args()
    if args.rounds < 2 or args.steps < 1 or args.world_size < 1:
        p.error(f"need --rounds >= 2 (the first block of each mode is warm-up, dropped), --steps >= 1 and "
                f"--world-size >= 1; got --rounds {args.rounds} --steps {args.steps} --world-size {args.world_size}")

    import ddpkit

    with ddpkit.Cluster(args.world_size, backend="gloo") as cluster:
        results = cluster.run(job, args.rounds, args.steps, args.width, args.depth, args.batch)
    for rank, r in enumerate(results):
        print(f"rank {rank}: OverlappedDDP MLP {args.width}x{args.depth}, median step "
              f"off {r['off']:.2f} ms, on {r['on']:.2f} ms -> recording costs "
              f"{100 * (r['on'] / r['off'] - 1):+.1f}% ({r['records_per_step']:.0f} records/step; target <= 5%)")


if __name__ == "__main__":
    main()
