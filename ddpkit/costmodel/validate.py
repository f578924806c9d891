"""The cost model against measurement on one cluster: calibrate, profile, time, predict; a table.

    with ddpkit.Cluster(2) as cluster:
        records, network, profile = validate(cluster, names)   # names from strategies.table.NAMES
    print(format_validation(records))

``python -m ddpkit predict --validate`` runs this once per world size; notebook 07 calls it.
"""
from __future__ import annotations

import dataclasses
import statistics
import textwrap

from ddpkit.costmodel.measure import (
    emulation_overhead, fit_link, measure_collectives, measure_emulated, median_profile,
    model_calibration_sizes, profile_job, slowest_profile, slowest_rank, wrapper_job,
)
from ddpkit.comm.emulator import OUTRAN_NOTE, outran_note, outran_share
from ddpkit.costmodel.simulate import Profile, simulate
from ddpkit.network import LINKS
from ddpkit.series import Series, timed_rounds
from ddpkit.strategies.table import STRATEGIES, CostStep, strategy
from ddpkit.workload import resolve


def validate(cluster, strategies, workload=None, model_kwargs=None, steps=10, rounds=3,
             global_batch_size=32, optimizer="sgd", bucket_cap_mb=None, progress=None, *, model=None):
    """See ``_validate``. ``strategies``: names, or ``{label: (name, {wrapper options})}`` for variants
    (an option named like a ``CostStep`` field goes into the model's step too). ``workload``: a
    ``Workload`` or a built-in's name (``model=``: its older keyword). ``progress``: a ``ProgressBar``."""
    runs = strategies if isinstance(strategies, dict) else {s: (s, {}) for s in strategies}
    wl = resolve(workload, model, model_kwargs)
    return _validate(cluster, runs, wl, steps, rounds, global_batch_size, optimizer, bucket_cap_mb, progress)


def _validate(cluster, runs: dict, wl, steps, rounds, global_batch_size, optimizer, bucket_cap_mb, progress):
    """Rounds interleaving calibration (the real transport), profiles, every strategy's timing and each
    wrapper alone (its host work); the model never sees a strategy's timing. Returns ``(records,
    transport, profile)``: per strategy ``predicted_ms``, ``predicted_phases_ms``, ``measured_ms``,
    ``rel_error``, ``measured_ms_rounds``, ``outran_link``, or ``error``."""
    n = cluster.world_size
    sizes = model_calibration_sizes(wl)
    common = dict(workload=wl, global_batch_size=global_batch_size, optimizer=optimizer,
                  bucket_cap_mb=bucket_cap_mb)
    calibrations, emulations, in_step, profiles, alone = [], [], [], [], []

    def calibrate_and_profile(r: int) -> None:  # first in each timing round, in its slow spells
        if n > 1:
            series.next(f"calibrating collectives (round {r + 1} of {rounds})")
            calibrations.append(slowest_rank(cluster.run(measure_collectives, sizes=sizes)))
            if cluster.network.emulated:  # and what the emulation adds to them, waited for: ranks apart, in step
                emulations.append(slowest_rank(cluster.run(measure_emulated)))
                if any_in_step:
                    in_step.append(slowest_rank(cluster.run(measure_emulated, compute_s=0.0)))
        series.next(f"profiling compute (round {r + 1} of {rounds})")
        ranks = cluster.run(profile_job, wl, global_batch_size // n, optimizer)
        profiles.append(slowest_profile(ranks))
        series.next(f"timing each wrapper alone (round {r + 1} of {rounds})")
        # each rank's lone steps beside its own profile of the same round (see _host_s)
        alone.extend(zip(ranks, cluster.run(wrapper_job, alone_runs, wl, global_batch_size // n, optimizer,
                                            bucket_cap_mb), strict=True))

    # One wrapper timed alone per strategy and options, the knobs the model simulates itself left
    # out (prefetch: variants differ by less than the noise of timing them apart)
    knobs = {f.name for f in dataclasses.fields(CostStep)}
    alone_runs, alone_of = {}, {}
    for label, (name, options) in runs.items():
        plain = (_alone_as(name), {k: v for k, v in options.items() if k not in knobs})
        alone_of[label] = next((key for key, run in alone_runs.items() if run == plain), label)
        alone_runs.setdefault(alone_of[label], plain)

    # the ranks meet in step (one collective right after another's wait) only where gradients go one
    # by one (naive's ``_ddp_step``): that calibration is left out of a run without such a strategy
    costs = {label: dataclasses.replace(strategy(name).cost, **{k: v for k, v in options.items() if k in knobs})
             for label, (name, options) in runs.items()}
    any_in_step = any(cost.algorithm == "ddp" and not cost.bucketed for cost in costs.values())
    jobs = {label: dict(strategy=name, options=options) for label, (name, options) in runs.items()}
    with Series(cluster, rounds * (len(runs) + (3 if n > 1 else 2)), follow=progress) as series:
        timings = timed_rounds(series, jobs, rounds, steps, each_round=calibrate_and_profile, **common)
    per_round, errors = timings.per_round, timings.errors

    transport = LINKS["loopback"]  # the real transport under any emulated link: fitted when we can
    if calibrations:  # per collective and size, the median over rounds
        transport = fit_link(_median_over_rounds(calibrations), n, name=f"fitted on {n} ranks",
                             host=cluster.backend != "nccl", transport=cluster.transport)
    profile = median_profile(profiles)
    emulated = cluster.network  # the cluster's own (emulated) links, known exactly
    if emulations:
        floored = emulated.with_floor(transport)
        emulated = emulated.with_floor(None, emulation_overhead(_median_over_rounds(emulations), floored, n),
                                       emulation_overhead(_median_over_rounds(in_step), floored, n) if in_step
                                       else None)
    records = []
    for label, (name, _options) in runs.items():
        if label in errors:
            records.append(dict(strategy=label, world_size=n, error=errors[label]))
            continue
        cost = costs[label]
        host_s = _host_s(alone, alone_of[label], alone_runs[alone_of[label]][0], bucket_cap_mb, cost)
        with_host = profile.with_host(host_s)
        pred = simulate(name, with_host, n, emulated.with_floor(transport), bucket_cap_mb, cost=cost)
        measured = statistics.median(per_round[label])
        records.append(dict(strategy=label, world_size=n, model=wl.name, predicted_ms=pred.ms_per_step,
                            predicted_phases_ms=pred.phases_ms,
                            measured_ms=measured, rel_error=pred.ms_per_step / measured - 1,
                            measured_ms_rounds=per_round[label], compute_ms=pred.compute_ms, host_ms=host_s * 1e3,
                            exposed_comm_ms=pred.exposed_comm_ms, emulation_ms=emulated.emulation_s * 1e3,
                            emulation_in_step_ms=emulated.emulation_step_s * 1e3,
                            outran_link=outran_share(timings.emulated.get(label))))
    return records, transport, profile


def _alone_as(name: str) -> str:
    """What ``wrapper_job`` times for ``name``: itself, or hybrid sharding's one-node row (same CostStep)."""
    row = strategy(name)
    if not row.hybrid:
        return name
    return next(other.name for other in STRATEGIES.values()
                if not other.hybrid and other.cost == row.cost and other.torch_native == row.torch_native)


def _host_s(alone: list, key: str, name: str, bucket_cap_mb, cost) -> float:
    """A wrapper's own work per step (>= 0): its lone step beyond the model's on the same rank's
    profile of the same round (not the slowest rank's), the median."""
    extra = [steps[key] - simulate(name, profile, 1, bucket_cap_mb=bucket_cap_mb, cost=cost).ms_per_step / 1e3
             for profile, steps in alone]
    return max(0.0, statistics.median(extra))


def _median_over_rounds(rounds: list[dict]) -> dict:
    """Several rounds' ``{op: [(bytes, seconds)]}`` -> one, each size's median."""
    return {op: [(rows[0][0], statistics.median(t for _, t in rows))
                 for rows in zip(*(r[op] for r in rounds), strict=True)] for op in rounds[0]}


def format_validation(records: list[dict]) -> str:
    """predict --validate's table: a row per strategy, ``summary`` under each world size."""
    w = max([10] + [len(r["strategy"]) for r in records])  # long labels ("fsdp (backward prefetch)") fit
    lines = [f"{'ranks':>5}  {'strategy':>{w}}  {'measured':>8}  {'rounds (min-max)':>16}  {'spread':>6}  "
             f"{'model':>8}  {'error':>6}  {'host work':>9}"]
    by_size: dict = {}
    for r in records:
        by_size.setdefault(r["world_size"], []).append(r)
    for n, rows in by_size.items():
        for r in rows:
            if "error" in r:
                lines.append(f"{n:>5}  {r['strategy']:>{w}}  {r['error']}")
                continue
            low, high = min(r["measured_ms_rounds"]), max(r["measured_ms_rounds"])
            lines.append(f"{n:>5}  {r['strategy']:>{w}}  {r['measured_ms']:8.2f}  {f'{low:.1f}-{high:.1f}':>16}  "
                         f"{spread(r):6.0%}  {r['predicted_ms']:8.2f}  {r['rel_error']:+6.0%}  "
                         f"{'+' + format(r['host_ms'], '.1f') + ' ms':>9}")
        lines += [textwrap.fill(line, 120, initial_indent=" " * 7, subsequent_indent=" " * 9) for line in summary(rows)]
    lines.append(textwrap.fill(
        f"measured: ms per step, the median of {max(len(r.get('measured_ms_rounds', ())) for r in records)} rounds "
        "(a round's figure: each rank's median step, the "
        "slowest rank's); rounds: the fastest and the slowest round; spread: (slowest - fastest) / measured, how "
        "far this machine moved the same run; model: the cost model's ms per step, from the calibration, the "
        "profile and the host work (it never sees these timings); error: model / measured - 1 (below 0: the "
        "model predicted less time); host work: the wrapper's own work per step (hooks, copies, launches), timed "
        "with the wrapper alone on every rank, which the model adds to the compute.", 120))
    outran = {f"{r['strategy']} ({r['world_size']} ranks)": r.get("outran_link") for r in records}
    note = outran_note(outran)
    if note:  # the table holds the model to this machine's transport there, not to the link
        note += (" The model takes each collective as the slower of the link and the transport fitted here: "
                 f"where {OUTRAN_NOTE:.0%} or more of a row's collectives outran the link, that row checks the "
                 "fitted transport (and how the ranks met) more than the link.")
        lines.append(textwrap.fill(note, 120, subsequent_indent="  "))
    return "\n".join(lines)


WIDE_SPREAD = 0.05  # rounds further apart than the error asked of the model cannot tell it


def spread(record: dict) -> float:
    """How far a record's rounds lie apart: (slowest - fastest) / their median."""
    rounds = record["measured_ms_rounds"]
    return (max(rounds) - min(rounds)) / record["measured_ms"]


def summary(records: list[dict]) -> list[str]:
    """How near the model came on one world size: mean and worst |error|, the two orders, the spread."""
    ok = [r for r in records if "error" not in r]
    if not ok:
        return []
    worst = max(ok, key=lambda r: abs(r["rel_error"]))
    mean = statistics.mean(abs(r["rel_error"]) for r in ok)
    measured = [r["strategy"] for r in sorted(ok, key=lambda r: r["measured_ms"])]
    modelled = [r["strategy"] for r in sorted(ok, key=lambda r: r["predicted_ms"])]
    order = "the model's the same" if measured == modelled else f"the model's {' < '.join(modelled)}"
    out = [f"mean |error| {mean:.1%}, worst {worst['rel_error']:+.1%} ({worst['strategy']}); measured order "
           f"{' < '.join(measured)}, {order}"]
    wide = [r for r in ok if spread(r) > WIDE_SPREAD]
    if wide:
        inside = [r["strategy"] for r in wide
                  if min(r["measured_ms_rounds"]) <= r["predicted_ms"] <= max(r["measured_ms_rounds"])]
        out.append(f"rounds spread wider than {WIDE_SPREAD:.0%}: {', '.join(r['strategy'] for r in wide)}; the "
                   f"model inside their range: {', '.join(inside) or 'none'}")
    return out


def format_profile(profile: Profile) -> str:
    """The compute the model was given: what every prediction of ``validate`` rests on."""
    return (f"compute {(profile.forward_s + profile.backward_s) * 1e3:.2f} ms "
            f"+ optimizer {profile.optimizer_s * 1e3:.2f} ms per step (slowest rank, all ranks computing), "
            f"gradient copies {1e-9 / profile.copy_s_per_byte if profile.copy_s_per_byte else float('inf'):.1f} GB/s")
