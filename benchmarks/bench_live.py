"""What the live widget costs a step: recording and streaming on vs off, interleaved in one run.

    python benchmarks/bench_live.py [--world-size 2] [--rounds 20] [--steps 5] [--no-widget]

One Cluster job trains the default MLP (32 x Linear(256, 256) + head, OverlappedDDP, SGD, global
batch 32) on every rank, in alternating blocks of ``--steps`` steps: recording off (the rank's
recorder is the do-nothing one), then on -- exactly what ``cluster.recording()`` does: a
``Recorder`` as the rank's recorder, drained by the streaming thread every 0.25 s and sent to
the notebook, where the cluster collects the batches and a headless ``ClusterWidget`` draws the
live plots (``--no-widget`` leaves it out). Blocks alternate off/on, on/off, ... so noise on a
shared machine hits both alike; each step starts after a barrier, as in training. The figure:
the median over rounds of each on block's median step against its neighbouring off block's, on
the slowest rank (adjacent blocks see the same machine). Target: on costs <= 5 % of a step.
"""
from __future__ import annotations

import argparse
import functools
import statistics


def job(rounds: int, steps: int, bucket_cap_mb: float):
    """A Cluster job: each step's ms with recording+streaming off and on, and records per step."""
    import time

    import torch.distributed as dist

    import ddpkit
    from ddpkit.experiment import local_batch, make_optimizer, train_step
    from ddpkit.models import build_model
    from ddpkit.cluster.worker import report
    from ddpkit.trace import Recorder
    from ddpkit.trace.live import Streamer
    from ddpkit.trace.seam import NULL_RECORDER, recording

    rank, world = dist.get_rank(), dist.get_world_size()
    rec = Recorder()
    rec.align_clocks()
    module = build_model("mlp")
    model = ddpkit.OverlappedDDP(module, bucket_cap_mb=bucket_cap_mb)  # one model for both modes
    opt = make_optimizer(model.parameters(), "sgd")
    x, y = local_batch(module, 32, 0, rank, world)
    times = {"off": [], "on": []}

    def block(mode):
        for _ in range(steps):
            dist.barrier()  # start every step together, as in training
            t = time.perf_counter()
            train_step(model, opt, x, y)
            times[mode].append((time.perf_counter() - t) * 1e3)

    send = functools.partial(report, "records")
    for r in range(rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            if mode == "off":
                block("off")
            else:
                # the wrapper keeps the recorder it was built with: swap it; train_step reads the rank's
                model.recorder = rec
                with Streamer(rec, send), recording(rec):
                    block("on")
                model.recorder = NULL_RECORDER
    warm = steps  # drop each mode's first block (allocation, first touch, first imports)
    return dict(off=times["off"][warm:], on=times["on"][warm:], steps=steps,
                records_per_step=len(rec.records) / (rounds * steps))


def paired_cost(results) -> float:
    """The median over rounds of (on block / off block - 1), each block's median step taken on
    the slowest rank: blocks side by side see the same machine, so its drift cancels."""
    steps = results[0]["steps"]
    blocks = lambda times: [statistics.median(times[i:i + steps]) for i in range(0, len(times), steps)]  # noqa: E731
    on = [max(b) for b in zip(*(blocks(r["on"]) for r in results), strict=True)]
    off = [max(b) for b in zip(*(blocks(r["off"]) for r in results), strict=True)]
    return statistics.median(a / b - 1 for a, b in zip(on, off, strict=True))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--no-widget", action="store_true", help="leave out the notebook's live plots")
    args = p.parse_args()
    if args.rounds < 2 or args.steps < 1 or args.world_size < 1:
        p.error(f"need --rounds >= 2 (the first block of each mode is warm-up, dropped), --steps >= 1 and "
                f"--world-size >= 1; got --rounds {args.rounds} --steps {args.steps} --world-size {args.world_size}")

    import ddpkit
    from ddpkit.trace.live import Collector

    with ddpkit.Cluster(args.world_size, backend="gloo") as cluster:
        collector = Collector(cluster.world_size, cluster.backend)
        cluster.subscribe(collector)
        widget = None
        if not args.no_widget:
            from ddpkit.widget import ClusterWidget

            widget = ClusterWidget(cluster, cell_output=None)
            widget.live.start(cluster.world_size)  # as at the start of a recorded run
        results = cluster.run(job, args.rounds, args.steps, args.bucket_cap_mb)
        frames = widget.live.painter.calls if widget else 0
        if widget:
            widget.close()
    on = [statistics.median(r["on"]) for r in results]
    off = [statistics.median(r["off"]) for r in results]
    for rank, r in enumerate(results):
        print(f"rank {rank}: median step off {off[rank]:.2f} ms, on {on[rank]:.2f} ms "
              f"({r['records_per_step']:.0f} records/step)")
    # a step lasts as long as its slowest rank
    cost, paired = max(on) / max(off) - 1, paired_cost(results)
    print(f"recording + streaming{'' if args.no_widget else ' + live widget'}: {100 * paired:+.1f}% of a step "
          f"(median over {args.rounds - 1} pairs of adjacent blocks; medians of all steps: {100 * cost:+.1f}%; "
          f"{args.steps} steps a block; {len(collector.records):,} records streamed, {frames} widget frames; "
          "target <= 5%)")


if __name__ == "__main__":
    main()
