"""A series of Cluster runs: each one counted and announced, timed in rotated rounds.

    with Series(cluster, runs=6) as series:                 # the one counter of a series of jobs
        timings = timed_rounds(series, {"a": dict(strategy=name_a), "b": dict(strategy=name_b)},
                               rounds=3, steps=5)
    timings.per_round["a"]    # [ms/step of each round]: the slowest rank's median over the steps
    timings.errors            # {label: "a failed: <the rank's last error line>"}: skipped after

``compare``, ``interleaved`` and ``costmodel.validate`` all time through ``timed_rounds``, so they
rotate, skip failures and announce (``cluster.announce``: "run 9 of 28") alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def run_or_fail(cluster, label: str, fn, *args, **kwargs):
    """Run a job, a failing one reported, not fatal: ``(results, None)`` or ``(None, "<label>
    failed: <the rank's last error line>")``."""
    from ddpkit.cluster import RankError

    try:
        return cluster.run(fn, *args, **kwargs), None
    except RankError as exc:
        last = next(iter(exc.failures.values())).strip().splitlines()[-1]
        if any(r.status == "dead" for r in cluster.ranks):
            cluster.restart()
        return None, f"{label} failed: {last}"


class Series:
    """Counts the runs of a series and announces each to the cluster (label, run i of n); ``follow``:
    a callback subscribed to the cluster for the series (e.g. a ``ProgressBar``)."""

    def __init__(self, cluster, runs: int, follow=None):
        self.cluster, self.runs, self.done = cluster, runs, 0
        self.follow = follow
        if follow is not None:
            cluster.subscribe(follow)

    def next(self, label: str) -> None:
        """The next run of the series is about to start: count it, and say what it is."""
        self.done += 1
        self.cluster.announce(label, run=self.done, runs=self.runs)

    def close(self) -> None:
        self.cluster.announce(None)
        if self.follow is not None:
            self.cluster.unsubscribe(self.follow)

    def __enter__(self) -> Series:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class Timings:
    """What ``timed_rounds`` measured: per label, each round's ms/step, and the labels that failed."""

    per_round: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)
    emulated: dict = field(default_factory=dict)   # label -> [collectives on an emulated link, outran it]
    transport: dict = field(default_factory=dict)  # label -> per round, the slowest rank's ms a step moving bytes


def timed_rounds(series: Series, runs: dict, rounds: int, steps: int, warmup: int = 1,
                 each_round=None, **common) -> Timings:
    """Time several configurations fairly on a noisy machine: ``rounds`` rounds, each running every
    configuration once (recording off) in a rotated order. ``runs``: label -> ``run_strategy``
    keywords on top of ``common``; ``each_round(r)``, if given, runs first in every round."""
    from ddpkit.experiment import run_strategy

    timings = series.timings = Timings({label: [] for label in runs})  # also what was timed if interrupted
    labels = list(runs)
    for r in range(rounds):
        if each_round is not None:
            each_round(r)
        k = r % len(labels)
        for label in labels[k:] + labels[:k]:
            if label in timings.errors:
                continue
            series.next(f"{label}: timing round {r + 1} of {rounds}")
            results, err = run_or_fail(series.cluster, label, run_strategy, steps=steps, warmup=warmup,
                                       **{**common, **runs[label]})
            if err:
                timings.errors[label] = err
            else:  # as slow as the slowest rank
                timings.per_round[label].append(max(res.ms_per_step for res in results))
                timings.transport.setdefault(label, []).append(max(res.transport_ms_per_step for res in results))
                counts = timings.emulated.setdefault(label, [0, 0])
                for res in results:
                    counts[0] += res.emulated_collectives
                    counts[1] += res.outran_link
    return timings
