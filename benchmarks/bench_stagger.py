"""How much link time the emulator lets ranks that reach a collective apart hide.

    python benchmarks/bench_stagger.py [--world-sizes 2,4] [--strategies bucketed,overlapped,fsdp]
                                       [--steps 12] [--network 10GbE]

On a real network a collective starts moving once the last rank of its group has joined, and ends
about a link's time later. The emulator times the link from each rank's own issue
(``ddpkit.network.LinkClock``; the real collective underneath still waits for every rank), so where
the ranks reach a collective apart (on a shared machine they do, the more so with more ranks than
cores, taking turns on them), a collective may end sooner than the last rank's issue plus the link's
time: the early ranks' link time ran while the late ones computed.

Every rank trains the default MLP with a strategy and a ``Recorder``; after two warm-up steps each
collective is matched across the ranks by its place in their sequences. Per collective: the stagger
(the last rank's issue less the first's) and the lead, (the first completion less the last issue)
over the link's time (``Network.emulated_time``): 1 or more where the link ran after everyone had
joined, as on a real network; below 1, link time hidden in the stagger. Printed per world size and
strategy: the medians, the share of collectives with a lead below 0.9, and the smallest lead.
"""
from __future__ import annotations

import argparse
import statistics

WARMUP = 2  # steps left out: allocation, first use


def job(strategy: str, steps: int, batch: int) -> list[tuple]:
    """A Cluster job: this rank's collectives after the warm-up, ``(issue ns, completion ns, op,
    bytes, group size)`` in issue order."""
    import torch.distributed as dist

    from ddpkit.experiment import local_batch, train_step, wrap
    from ddpkit.models import build_model
    from ddpkit.trace import Recorder, seam

    rank, world = dist.get_rank(), dist.get_world_size()
    recorder = Recorder(rank=rank, world_size=world)
    with seam.recording(recorder):
        module = build_model("mlp")
        model, opt = wrap(strategy, module, recorder=recorder)
        x, y = local_batch(module, batch, 0, rank, world)
        for _ in range(WARMUP + steps):
            recorder.next_step()
            train_step(model, opt, x, y, recorder)
    return [(r.start_ns, r.end_ns, r.name, r.nbytes, r.args.get("group_size", world))
            for r in recorder.records if r.cat == "comm" and r.step is not None and r.step >= WARMUP]


def leads(per_rank: list[list[tuple]], network, world: int) -> tuple[list[float], list[float]]:
    """(stagger in ms, lead) of every collective of the whole world that every rank completed."""
    staggers, out = [], []
    for calls in zip(*per_rank, strict=False):  # the i-th collective of every rank
        if any(c[1] is None or c[4] != world for c in calls) or len({(c[2], c[3]) for c in calls}) > 1:
            continue  # not completed, a subgroup's, or the ranks parted (not this benchmark's question)
        op, nbytes = calls[0][2], calls[0][3]
        link_s = network.emulated_time(op, nbytes, range(world))
        if link_s <= 0:
            continue
        last_issue = max(c[0] for c in calls)
        staggers.append((last_issue - min(c[0] for c in calls)) / 1e6)
        out.append((min(c[1] for c in calls) - last_issue) / 1e9 / link_s)
    return staggers, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--strategies", default="bucketed,overlapped,fsdp")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=32, help="global batch size")
    p.add_argument("--network", default="10GbE")
    a = p.parse_args()

    import ddpkit
    from ddpkit.strategies.table import strategy

    try:
        sizes = [int(n) for n in a.world_sizes.split(",")]
        network = ddpkit.Network.of(a.network)
        names = a.strategies.split(",")
        [strategy(s) for s in names]
    except ValueError as exc:
        p.error(str(exc))
    if a.steps < 1 or min(sizes) < 2 or not network.emulated:
        p.error(f"need --steps >= 1, world sizes >= 2 and an emulated --network; got --steps {a.steps}, "
                f"--world-sizes {a.world_sizes}, --network {a.network}")
    for n in sizes:
        with ddpkit.Cluster(n, network=network) as cluster:
            for name in names:
                staggers, lead = leads(cluster.run(job, name, a.steps, a.batch), network, n)
                if not lead:
                    print(f"{n} ranks {name:>10}: no collective of all {n} ranks on the link")
                    continue
                hidden = sum(x < 0.9 for x in lead) / len(lead)
                print(f"{n} ranks {name:>10}: {len(lead)} collectives, stagger {statistics.median(staggers):.2f} ms "
                      f"(median); lead (first completion - last issue) / link: median {statistics.median(lead):.2f}, "
                      f"below 0.9 for {hidden:.0%}, least {min(lead):.2f} ({network.name})", flush=True)


if __name__ == "__main__":
    main()
