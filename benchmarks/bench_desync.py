"""What desync detection costs: the default MLP's step with the flight recorder on vs off, in one run.

    python benchmarks/bench_desync.py [--world-size 2] [--rounds 20] [--steps 5]

Detection is always on: ddpkit's process group hands every collective to the rank's flight
recorder (``ddpkit.comm.flight``: a 32-byte slot, written as four int64 stores into a ring the parent can
read, and a weak reference for the watchdog) before launching it. The parent reads nothing while
a job goes well, and the watchdog thread wakes four times a second. Inside one Cluster, every rank
trains the default MLP (256x32) with a strategy, switching the recorder off and on in alternating
blocks (off/on, then on/off, ...) so machine noise hits both alike, with recording off and on.

Two figures per case: the measured difference of the median steps (overall, and the median over
rounds of each round's pair of blocks), noisy on a shared machine: its sign says little below a few
percent; and the accounted cost: the time spent inside ``issue`` and ``launched`` during real steps
(timed on the rank, from the stacks collectives are really issued from) over the step, the median
over steps (``_time_flight``). Each call's time is less what reading the clock costs at that spot:
read twice back to back just before the call, in the same cold caches (between two collectives an
FSDP step runs enough other code to evict them, and a clock read there costs several times what it
costs in a loop). Target: <= 1% of the step.
"""
from __future__ import annotations

import argparse
import statistics


def job(strategy: str, rounds: int, steps: int, batch: int):
    """A Cluster job: median ms/step with the flight recorder off and on, recording off and on, and
    the time spent issuing into it."""
    import time

    import torch.distributed as dist

    from ddpkit import rankside
    from ddpkit.experiment import local_batch, train_step, wrap
    from ddpkit.models import build_model
    from ddpkit.trace import Recorder, seam

    rank, world = dist.get_rank(), dist.get_world_size()
    flight = rankside.comm().flight
    out = {}
    for recorded in (False, True):
        recorder = Recorder(rank=rank, world_size=world) if recorded else seam.recorder()
        with seam.recording(recorder):
            module = build_model("mlp")
            model, opt = wrap(strategy, module, recorder=recorder)
            x, y = local_batch(module, batch, 0, rank, world)
            times = {False: [], True: []}  # per round, the block's step times (ms)
            for r in range(rounds):
                for on in ((False, True) if r % 2 == 0 else (True, False)):
                    flight.enabled = on
                    block = []
                    for _ in range(steps):
                        dist.barrier()  # start every step together, as in training
                        if recorded:
                            recorder.next_step()
                        t = time.perf_counter()
                        train_step(model, opt, x, y, recorder)
                        block.append((time.perf_counter() - t) * 1e3)
                    times[on].append(block)
            flight.enabled = True
            n = rounds * steps
            share, calls, per_call = _time_flight(flight, train_step, (model, opt, x, y, recorder), n)
        # drop each mode's first block (allocation, first-touch); the paired figure compares the
        # two blocks of each round (next to each other in time: slow drifts of a shared machine cancel)
        off = statistics.median(t for block in times[False][1:] for t in block)
        on = statistics.median(t for block in times[True][1:] for t in block)
        paired = statistics.median(statistics.median(a) / statistics.median(b)
                                   for a, b in zip(times[True][1:], times[False][1:], strict=True))
        out["recording" if recorded else "plain"] = dict(off=off, on=on, paired=paired, collectives=calls,
                                                        issue_us=per_call, share=share)
    return out


def _time_flight(flight, step, args: tuple, steps: int) -> tuple[float, float, float]:
    """The accounted cost over ``steps`` real steps: the time spent inside ``flight.issue`` and
    ``flight.launched`` (timed on the rank, from the stacks collectives are really issued from:
    autograd's, ...). Returns the median over steps of each step's share of it (a median, like the
    step times: a rank descheduled inside one call, which a shared machine does now and then, is
    one step's outlier, not every step's cost), collectives per step, and the median us per call.
    A call's time leaves out one clock read, measured just before it (``t1 - t0``)."""
    import time

    spent, calls = [0.0], ([], [])

    def timed(method, times):
        def call(*args):
            t0 = time.perf_counter()
            t1 = time.perf_counter()  # t1 - t0: what reading the clock costs here, in these caches
            p = method(*args)
            t = time.perf_counter() - t1 - (t1 - t0)
            spent[0] += t
            times.append(t)
            return p
        return call

    # instance attributes, in front of the methods
    flight.issue, flight.launched = timed(flight.issue, calls[0]), timed(flight.launched, calls[1])
    shares = []
    try:
        for _ in range(steps):
            spent[0] = 0.0
            t = time.perf_counter()
            step(*args)
            shares.append(spent[0] / (time.perf_counter() - t))
    finally:
        del flight.issue, flight.launched
    per_call = sum(statistics.median(times) for times in calls) if calls[0] and calls[1] else 0.0
    return statistics.median(shares), len(calls[0]) / steps, 1e6 * per_call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=32, help="global batch size")
    p.add_argument("--strategies", default="overlapped,fsdp")
    args = p.parse_args()
    if args.rounds < 2 or args.steps < 1 or args.world_size < 1:
        p.error(f"need --rounds >= 2 (the first block of each mode is warm-up, dropped), --steps >= 1 and "
                f"--world-size >= 1; got --rounds {args.rounds} --steps {args.steps} --world-size {args.world_size}")

    import ddpkit

    with ddpkit.Cluster(args.world_size, backend="gloo") as cluster:
        for strategy in args.strategies.split(","):
            results = cluster.run(job, strategy, args.rounds, args.steps, args.batch)
            for case in ("plain", "recording"):
                # a step lasts as long as its slowest rank
                off = max(r[case]["off"] for r in results)
                on = max(r[case]["on"] for r in results)
                paired = max(r[case]["paired"] for r in results)
                n = max(r[case]["collectives"] for r in results)
                issue_us = max(r[case]["issue_us"] for r in results)
                accounted = 100 * max(r[case]["share"] for r in results)
                print(f"{strategy:>10}, recording {'on ' if case == 'recording' else 'off'}: median step "
                      f"{off:.2f} ms without the flight recorder, {on:.2f} ms with it "
                      f"(measured {100 * (on / off - 1):+.1f}%, round by round {100 * (paired - 1):+.1f}%); "
                      f"detection costs {accounted:.2f}% of the step "
                      f"({n:.0f} collectives/step x {issue_us:.1f} us, medians; MLP 256x32, {args.world_size} ranks; "
                      "target <= 1%)")

if __name__ == "__main__":
    main()
