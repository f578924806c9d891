"""Where overlap's saving goes on this machine: bucketed against overlapped DDP, timed inside the ranks.

    python benchmarks/bench_overlap.py [--networks loopback,10GbE,paper] [--bucket-cap-mb 1] [--rounds 3]
                                       [--steps 8] [--world-size 2]

Same buckets, same bytes: ``BucketedDDP`` fills and launches every bucket after backward,
``OverlappedDDP`` from the gradient hooks, during backward. On each emulated network, in rounds
that alternate the two (a small machine's speed drifts from minute to minute), every rank times
its own steps of the course's MLP and, inside them, the four calls DDP makes on a bucket
(``ddpkit.strategies.buckets.Bucket``):

    step       ms per step (each rank's median over the steps; the slowest rank)
    backward   backward alone: the same model in steps under ``no_sync()``, where no hook does anything
    DDP        what the wrapper adds: backward + sync - backward alone
    copy-in    the gradients into their buckets (scaled by 1/N)
    launch     the all-reduces' launches: the process group's Python, the copy into shared memory,
               the sums of pieces whose peers are already in
    wait       waiting for the all-reduces: the link's time left exposed, and a late peer
    copy-out   the averaged buckets back into .grad
    other      DDP - the four: the hooks' Python, and backward's kernels slowed beside the copies
               (overlapped's line "gradient hooks" gives the hooks' own Python, per hook)
    moved      of the waits, the time the rank spent moving the bytes itself (waiting there for a late
               peer included): on an emulated network the shared-memory transport moves them when
               the rank waits (``at_wait``, ``ddpkit.comm.emulator``), not during backward

(the parts: the mean over the ranks of each rank's median; everything the median over the rounds).
Bucketed DDP does its DDP work after backward, while the emulated link's time runs anyway;
overlapped DDP does it inside backward, where, with a core per rank, it has no idle core to go to.
Overlap takes waiting for the link off the step; it pays where that is more than what its DDP work
grows by inside backward. Each network's lines say both (the waits' difference, and the difference
of DDP work without the waits), and what a perfect overlap would reach. Bucketed waits less than
the link's time: the link runs from each all-reduce's launch, under the copies and sums that follow
it. The perfect-overlap bound is the larger of two limits. Backward's: bucketed's step without its
waiting (its DDP work kept: with a core per rank it stays CPU work beside backward, wherever it
runs), plus what no overlap can hide after backward, the last bucket's link time or, if longer, the
rank moving the bytes. The link's: it carries the buckets one after another, each from when
backward has filled it, so it cannot be done before ``link_done_ms`` into backward; the step adds
what is not backward nor DDP work (forward, loss, optimizer) and the last bucket's copy out. On a
link slower than backward the second decides. The last line says what overlapped reaches of it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

PARTS = ("copy_in", "all_reduce", "wait", "copy_out")  # the Bucket calls timed, in the order of a step
COLUMNS = ("step", "backward", "ddp", "copy_in", "all_reduce", "wait", "copy_out", "other", "moved")
HEADERS = ("step", "backward", "DDP", "copy-in", "launch", "wait", "copy-out", "other", "moved")
STRATEGIES = ("bucketed", "overlapped")


def _job(strategy: str, cap_mb: float, steps: int, global_batch_size: int, warmup: int = 2) -> dict:
    """This rank's medians, ms: its steps and the Bucket calls inside them, then backward alone."""
    import ddpkit
    from ddpkit.experiment import wrap
    from ddpkit.strategies.buckets import Bucket
    from ddpkit.strategies.overlapped import OverlappedDDP

    rank, world, dev = ddpkit.rank(), ddpkit.world_size(), ddpkit.device()
    wl = ddpkit.Workload.builtin("mlp")
    model, opt = wrap(strategy, wl.build(0), "sgd", cap_mb)
    spent = dict.fromkeys(PARTS, 0.0)
    originals = {name: getattr(Bucket, name) for name in PARTS}

    def timed(name, call):
        def bucket_call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t
        return bucket_call

    # overlapped's gradient hook: its calls, and its own Python (the Bucket calls inside it apart)
    hooks = {"calls": 0, "own": 0.0}
    hook = OverlappedDDP._grad_ready_hook

    def timed_hook(self, bucket, j):
        t, inside = time.perf_counter(), sum(spent.values())
        try:
            return hook(self, bucket, j)
        finally:
            hooks["calls"] += 1
            hooks["own"] += time.perf_counter() - t - (sum(spent.values()) - inside)

    rows, alone = [], []
    for name, call in originals.items():  # this rank's process only, for this job only
        setattr(Bucket, name, timed(name, call))
    OverlappedDDP._grad_ready_hook = timed_hook
    try:
        for step in range(warmup + steps):
            batch = wl.local_batch(step, global_batch_size, rank, world, dev)
            spent.update(dict.fromkeys(PARTS, 0.0))
            hooks.update(calls=0, own=0.0)
            moved = ddpkit.rankside.comm().transport_seconds()
            t0 = time.perf_counter()
            loss = wl.compute_loss(model, batch)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            model.finish_gradient_synchronization()
            t3 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t4 = time.perf_counter()
            if step >= warmup:
                rows.append(dict(step=t4 - t0, backward=t2 - t1, sync=t3 - t2, **spent,
                                 moved=ddpkit.rankside.comm().transport_seconds() - moved,
                                 hook_calls=hooks["calls"], hook_own=hooks["own"]))
        for step in range(warmup + steps):  # the same backward, hooks idle: no bucket is touched
            batch = wl.local_batch(step, global_batch_size, rank, world, dev)
            with model.no_sync():
                loss = wl.compute_loss(model, batch)
                t = time.perf_counter()
                loss.backward()
                if step >= warmup:
                    alone.append(time.perf_counter() - t)
            opt.zero_grad(set_to_none=True)
    finally:
        for name, call in originals.items():
            setattr(Bucket, name, call)
        OverlappedDDP._grad_ready_hook = hook

    def ms(values):
        return 1e3 * statistics.median(values)

    out = {key: ms([r[key] for r in rows]) for key in ("step", "moved", *PARTS)}
    out["backward"] = ms(alone)
    out["ddp"] = ms([r["backward"] + r["sync"] for r in rows]) - out["backward"]
    out["other"] = out["ddp"] - sum(out[p] for p in PARTS)
    out["hook_calls"] = statistics.median(r["hook_calls"] for r in rows)
    out["hook_ms"] = ms([r["hook_own"] for r in rows])  # a step's hooks, their own Python
    return out


def link_ms(network, cap_mb: float, world_size: int) -> tuple[list[float], list[float]]:
    """The emulated link's ms for each of one step's all-reduces, in launch order (one link carries
    them one after another), and each bucket's share of the gradients' bytes."""
    from ddpkit.models import build_model
    from ddpkit.strategies.buckets import assign_buckets, bucket_cap_bytes

    sizes = [p.numel() * p.element_size() for p in build_model("mlp").parameters()]
    buckets = [sum(sizes[i] for i in b) for b in assign_buckets(sizes, bucket_cap_bytes(cap_mb))]
    return ([1e3 * network.emulated_time("all_reduce", s, range(world_size)) for s in buckets],
            [s / sum(buckets) for s in buckets])


def link_done_ms(links: list[float], shares: list[float], backward_ms: float) -> float:
    """The earliest one link can deliver the last bucket, in ms from backward's start, however well
    the all-reduces overlap: bucket k is full once backward has produced its share of the gradients
    and those of the buckets before it (backward taken as even over the bytes, as for the course's
    MLP), and the link then carries it and every later one back to back."""
    done, filled = 0.0, 0.0
    for k in range(len(links)):
        filled += shares[k]
        done = max(done, filled * backward_ms + sum(links[k:]))
    return done


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--networks", default="loopback,10GbE,paper")
    p.add_argument("--bucket-cap-mb", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=32)
    a = p.parse_args()
    if a.rounds < 1 or a.steps < 1 or a.world_size < 2 or not a.bucket_cap_mb > 0:
        p.error(f"need --rounds >= 1, --steps >= 1, --world-size >= 2 and --bucket-cap-mb > 0; got --rounds "
                f"{a.rounds} --steps {a.steps} --world-size {a.world_size} --bucket-cap-mb {a.bucket_cap_mb}")

    import ddpkit

    try:  # a bad name is refused here, before any rank starts
        networks = [ddpkit.Network.of(name) for name in a.networks.split(",")]
    except ValueError as exc:
        p.error(f"--networks {a.networks}: {exc}")
    print(f"{os.cpu_count()} cores, {a.world_size} ranks of one torch thread; the course's MLP, "
          f"{a.bucket_cap_mb:g} MiB buckets; {a.rounds} rounds of {a.steps} steps; ms per step")
    print(f"{'network':<10} {'':<10} " + " ".join(f"{h:>8}" for h in HEADERS))
    with ddpkit.Cluster(a.world_size, backend="gloo", threads_per_rank=1) as cluster:
        for net in networks:
            cluster.network = net
            rounds = {s: [] for s in STRATEGIES}
            for r in range(a.rounds):
                for s in STRATEGIES if r % 2 == 0 else STRATEGIES[::-1]:
                    per_rank = cluster.run(_job, s, a.bucket_cap_mb, a.steps, a.global_batch_size)
                    row = {k: statistics.mean(x[k] for x in per_rank) for k in COLUMNS}
                    row["step"] = max(x["step"] for x in per_rank)
                    row.update({k: statistics.mean(x[k] for x in per_rank) for k in ("hook_ms", "hook_calls")})
                    rounds[s].append(row)
            med = {s: {k: statistics.median(row[k] for row in rounds[s]) for k in COLUMNS} for s in STRATEGIES}
            hook_ms = statistics.median(row["hook_ms"] for row in rounds["overlapped"])
            hook_calls = statistics.median(row["hook_calls"] for row in rounds["overlapped"])
            for i, s in enumerate(STRATEGIES):
                print(f"{net.name if i == 0 else '':<10} {s:<10} " + " ".join(f"{med[s][k]:8.2f}" for k in COLUMNS))
            hid = med["bucketed"]["wait"] - med["overlapped"]["wait"]
            work = {s: med[s]["ddp"] - med[s]["wait"] for s in STRATEGIES}  # DDP's own work, the waits left out
            grew = work["overlapped"] - work["bucketed"]
            links, shares = link_ms(net, a.bucket_cap_mb, a.world_size)
            print(f"{'':<10} bucketed/overlapped {med['bucketed']['step'] / med['overlapped']['step']:.2f}; "
                  f"link {sum(links):.1f} ms a step: overlap took {hid:.1f} ms of "
                  f"waiting off the step, and its DDP work but the waits grew by {grew:+.1f} ms")
            # The limits (the module docstring): backward's -- bucketed's step without its waiting,
            # plus the last bucket's link time or the rank moving the bytes after backward (the
            # at_wait: "moved", overlapped's) -- and the link's, carrying the buckets back to back
            b, o = med["bucketed"], med["overlapped"]
            after = max(links[-1] if links and net.emulated else 0.0, o["moved"])
            rest = b["step"] - b["backward"] - b["ddp"]  # forward, loss, optimizer
            carried = link_done_ms(links, shares, b["backward"]) if links and net.emulated else 0.0
            bound = max(b["step"] - b["wait"] + after, rest + carried + shares[-1] * b["copy_out"])
            print(f"{'':<10} the perfect-overlap bound: {bound:.1f} ms a step (bucketed/bound "
                  f"{b['step'] / bound:.2f}); overlapped reaches {bound / o['step']:.0%} of it "
                  f"(the link done {carried:.1f} ms into backward at the earliest; moving the bytes: "
                  f"{o['moved']:.1f} ms)")
            if hook_calls:
                print(f"{'':<10} overlapped's gradient hooks: {hook_calls:.0f} a step, {hook_ms:.2f} ms of their "
                      f"own Python ({1e3 * hook_ms / hook_calls:.0f} us each; copy-in and launches apart), "
                      f"part of 'other'")

if __name__ == "__main__":
    main()
