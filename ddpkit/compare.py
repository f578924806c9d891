"""Compare every strategy on one cluster: interleaved timing rounds, one recorded run each, a table.

    with ddpkit.Cluster(2) as cluster:
        records = compare(cluster, names, steps=10, rounds=3)   # names from strategies.table.NAMES
        records = compare(cluster, names, workload=wl)          # on your own model: a ddpkit.Workload
    print(format_table(records))       # or ddpkit.viz.plot_compare(records)

``python -m ddpkit compare`` is this with arguments; ``interleaved`` times any set of configurations.
"""
from __future__ import annotations

import statistics
import textwrap
import warnings

from ddpkit.comm.emulator import outran_note, outran_share
from ddpkit.series import Series, run_or_fail, timed_rounds
from ddpkit.units import human_bytes


def interleaved(cluster, runs: dict, rounds: int = 7, steps: int = 5, warmup: int = 1, **common) -> dict:
    """Time several configurations fairly on a noisy machine: ``rounds`` rounds, each running every
    configuration once in a rotated order; ``{label: [ms/step of each round]}`` (the slowest rank's
    median). ``runs``: label -> ``run_strategy`` keywords on top of ``common``. A failing one is
    warned about and left out."""
    with Series(cluster, rounds * len(runs)) as series:
        timings = timed_rounds(series, runs, rounds, steps, warmup, **common)
    for err in timings.errors.values():
        warnings.warn(err, RuntimeWarning, stacklevel=2)
    return {label: times for label, times in timings.per_round.items() if label not in timings.errors}


def spread(times: list[float]) -> str:
    """``"median ms (min-max over n rounds)"``: how a timing from ``interleaved`` should be shown."""
    return f"{statistics.median(times):.1f} ms ({min(times):.1f}-{max(times):.1f} over {len(times)} rounds)"


def compare(cluster, strategies, workload=None, model_kwargs=None, steps=10, rounds=3,
            global_batch_size=32, optimizer="sgd", bucket_cap_mb=None, record_steps=3,
            progress=None, *, model=None, max_norm=None, comm_hook=None) -> list[dict]:
    """Every strategy on one cluster: ``rounds`` interleaved timing runs with recording off (the
    order rotates each round: ``series.timed_rounds``), then one short recorded run each for
    bytes, overlap, memory and equality with one process. One dict per strategy.

    ``strategies``: names, or ``{label: (name, {wrapper options})}`` to compare variants too.
    ``workload``: a ``ddpkit.Workload``, a built-in's name sized by ``model_kwargs`` (``model=`` is
    the older name) or ``"package.module:function"``; default the MLP. ``max_norm``: clip the
    gradients every step. ``comm_hook``: a hook's name (``comm_hooks.COMM_HOOKS``) for every
    strategy that takes one. ``progress``: a ``ddpkit.progressbar.ProgressBar``, or None."""
    from ddpkit.strategies.table import NAMES
    from ddpkit.strategies.table import strategy as strategy_row
    from ddpkit.workload import resolve

    if not strategies or not isinstance(strategies, (list, tuple, dict)):
        raise ValueError(f"compare needs a list of strategy names (or {{label: (name, options)}}), got {strategies!r}; "
                         f"the names: {', '.join(NAMES)}")
    for what, n in (("steps", steps), ("rounds", rounds), ("record_steps", record_steps)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"compare: {what} must be a whole number >= 1, got {n!r}")
    runs = strategies if isinstance(strategies, dict) else {s: (s, {}) for s in strategies}
    for name, _ in runs.values():
        strategy_row(name)  # an unknown name: a ValueError listing the valid ones, before any run
    wl = resolve(workload, model, model_kwargs)
    if comm_hook is not None:  # on every strategy whose buckets take one
        runs = {label: (name, {**options, "comm_hook": comm_hook} if strategy_row(name).takes_comm_hook else options)
                for label, (name, options) in runs.items()}
    with Series(cluster, len(runs) * (rounds + 1), follow=progress) as series:
        try:
            return _compare(cluster, runs, wl, steps, rounds, global_batch_size, optimizer,
                            bucket_cap_mb, record_steps, max_norm, series)
        except BaseException as exc:  # Ctrl-C on the command line: the table of what was timed until then
            timed = getattr(getattr(series, "timings", None), "per_round", {})
            exc.records = [dict(strategy=s, name=runs[s][0], world_size=cluster.world_size, rounds=len(t),
                                ms_per_step=statistics.median(t)) for s, t in timed.items() if t]
            _add_ratios(exc.records)
            raise


def _compare(cluster, runs, wl, steps, rounds, global_batch_size, optimizer,
             bucket_cap_mb, record_steps, max_norm, series) -> list[dict]:
    from ddpkit.experiment import run_strategy, train_single_process

    n = cluster.world_size
    tiers = getattr(cluster.network, "gpus_per_node", None) is not None
    common = dict(workload=wl, global_batch_size=global_batch_size, optimizer=optimizer,
                  bucket_cap_mb=bucket_cap_mb, max_norm=max_norm)
    jobs = {label: dict(strategy=name, options=options) for label, (name, options) in runs.items()}
    timings = timed_rounds(series, jobs, rounds, steps, **common)
    per_round, errors = timings.per_round, timings.errors

    warmup = 1
    reference = train_single_process(wl, optimizer, steps=warmup + record_steps,
                                     global_batch_size=global_batch_size, max_norm=max_norm)
    records = []
    for s, (name, options) in runs.items():
        if s in errors:
            records.append(dict(strategy=s, world_size=n, error=errors[s]))
            continue
        series.next(f"{s}: one recorded run (bytes, memory, equality)")
        results, err = run_or_fail(cluster, s, run_strategy, name, steps=record_steps, warmup=warmup,
                                    record=True, reference=reference, options=options, **common)
        if err:
            records.append(dict(strategy=s, world_size=n, error=err))
            continue
        r0 = results[0]
        # every collective passes through ddpkit's process group, torch's wrappers' too; without
        # it (a plain gloo group) torch's collectives run out of sight: unknown, not zero
        reported = bool(r0.collectives_per_step) or n == 1
        records.append(dict(
            strategy=s, name=name, world_size=n, model=wl.name, model_kwargs=dict(wl.config), steps=steps,
            comm_hook=_hook_name(options.get("comm_hook")),
            rounds=len(per_round[s]),
            ms_per_step=statistics.median(per_round[s]),
            ms_per_step_rounds=per_round[s],
            ms_per_step_min=min(per_round[s]),
            comm_bytes_per_step=r0.comm_bytes_per_step if reported else None,
            # nodes only where the network has two tiers: else every byte would read as crossing nodes
            inter_node_bytes_per_step=(r0.inter_node_bytes_per_step if reported and tiers else None),
            collectives_per_step=r0.collectives_per_step,
            comm_ms_per_step=r0.comm_ms_per_step if reported else None,
            model_state_bytes=max(res.model_state_bytes for res in results),
            peak_bytes=max(res.peak_bytes for res in results),
            memory=[res.memory for res in results],  # per rank, by category (ddpkit.viz.plot_memory)
            overlap_fraction=statistics.mean(res.overlap_fraction for res in results) if reported else None,
            max_param_diff=max(res.max_param_diff for res in results),
            dropout=r0.dropout,  # where the model drops out: then it differs from one process by design
            outran_link=outran_share(timings.emulated.get(s)),
            # on an emulated network: of the step, ms the rank spent moving bytes itself (at_wait)
            transport_ms_per_step=(statistics.median(timings.transport[s]) if timings.emulated.get(s, [0])[0]
                                   else None),
        ))
    _add_ratios(records)
    return records


def _hook_name(hook) -> str | None:
    """A record's communication hook: its name, or a function's (records stay plain data)."""
    return hook if hook is None or isinstance(hook, str) else getattr(hook, "__name__", repr(hook))


def torch_reference(strategy: str) -> str:
    """The torch wrapper a strategy is compared with: the table's torch-native row of its ``family``."""
    from ddpkit.strategies.table import STRATEGIES

    family = STRATEGIES[strategy].family
    return next(name for name, row in STRATEGIES.items() if row.torch_native and row.family == family)


def _add_ratios(records: list[dict]) -> None:
    """``vs_torch`` (and ``vs_<its name>``): ms_per_step over torch's wrapper of the same family,
    where it ran (1.20 = 20% slower than torch's); a variant is compared with its row's."""
    ok = {r["strategy"]: r for r in records if "error" not in r}
    for r in ok.values():
        ref = ok.get(torch_reference(r.get("name", r["strategy"])))
        if ref is not None and ref["ms_per_step"] > 0:
            r["vs_torch"] = r[f"vs_{ref['strategy']}"] = r["ms_per_step"] / ref["ms_per_step"]
            r["torch_reference"] = ref["strategy"]


def format_table(records: list[dict]) -> str:
    """The compare results as a fixed-width text table (bytes per rank; sent = ring cost)."""
    moving = any(r.get("transport_ms_per_step") is not None for r in records)  # an emulated network
    nodes = any(r.get("inter_node_bytes_per_step") is not None for r in records)  # a two-tier network
    cols = [("strategy", "{}"), ("ms_per_step", "{:.2f}"), ("vs_torch", "ratio"),
            ("comm_bytes_per_step", "bytes"), ("inter_node_bytes_per_step", "bytes"), ("model_state_bytes", "bytes"),
            ("peak_bytes", "bytes"), ("overlap_fraction", "{:.0%}"), ("max_param_diff", "{:.1e}")]
    heads = ["strategy", "ms/step", "vs torch", "sent/step", "inter-node", "model state",
             "peak", "overlap", "max |diff|"]
    if not nodes:  # one tier: no bytes cross a node boundary that the network knows of
        del cols[4], heads[4]
    if moving:
        cols.insert(2, ("transport_ms_per_step", "{:.2f}"))
        heads.insert(2, "moving bytes")
    rows = []
    for r in records:
        if "error" in r:
            rows.append([r["strategy"], r["error"]])
            continue
        row = []
        for key, fmt in cols:
            v = r.get(key)
            if v is None:  # no torch wrapper of its family ran: blank
                row.append("" if key.startswith("vs_") else "-")
            elif fmt == "ratio":
                row.append(f"{v:.2f}x {r['torch_reference']}")
            elif key == "max_param_diff" and r.get("dropout"):  # not a failure: see the note
                row.append(f"{v:.1e} (dropout)")
            else:
                row.append(human_bytes(v) if fmt == "bytes" else fmt.format(v))
        rows.append(row)
    widths = [max(len(h), *(len(row[i]) for row in rows if len(row) == len(heads))) for i, h in enumerate(heads)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True))]
    for row in rows:
        if len(row) == len(heads):
            lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        else:
            lines.append(f"{row[0].rjust(widths[0])}  {row[1]}")
    notes = ["ms/step: the median over the timing rounds, of the slowest rank (recording off)."]
    if any("vs_torch" in r for r in records):
        notes.append("vs torch: ms/step divided by that of torch's own wrapper of the same family (named), "
                     "a time ratio: lower is faster; 1.20x = 20% slower.")
    notes.append("peak: the most one rank held at once during a step (parameters, gradients, optimizer "
                 "state, communication buffers, activations; on CUDA the allocator's peak).")
    notes.append("sent/step: bytes one rank sends per step (ring algorithms; a broadcast of S, whose root sends "
                 "the most, as the ranks' average, (N-1)/N S, as for an all-gather of S); \"-\": not recorded."
                 + (" inter-node: the part that crosses nodes (the network's two tiers)." if nodes else ""))
    if moving:
        notes.append("moving bytes: ms a step the slowest rank spent in its waits moving the bytes of its "
                     "collectives itself (at the wait: the emulated network card, ddpkit.comm.emulator), waiting there "
                     "for a peer that came late included: the transport's part; the rest was the emulated link's. "
                     "torch's wrappers and communication hooks chain work on their collectives' futures, so their "
                     "bytes move on the link's thread when the link delivers them, counted nowhere here.")
    hooked = [r["strategy"] for r in records if r.get("comm_hook")]
    if hooked:
        hooks = sorted({r["comm_hook"] for r in records if r.get("comm_hook")})
        notes.append(f"comm hook: {', '.join(hooks)} reduced the buckets of {', '.join(hooked)} "
                     "(ddpkit.strategies.comm_hooks): its bytes in sent/step, its rounding in max |diff|.")
    dropping = next((r for r in records if r.get("dropout")), None)
    if dropping is not None:
        from ddpkit.experiment import DROPOUT_NOTE

        where = ", ".join(dropping["dropout"][:3]) + (", ..." if len(dropping["dropout"]) > 3 else "")
        notes.append(f"max |diff| (dropout): {DROPOUT_NOTE} ({dropping.get('model', 'the model')}: {where}).")
    outran = outran_note({r["strategy"]: r.get("outran_link") for r in records})
    if outran:
        notes.append(outran)
    # each note wrapped to the table's width, or 120 columns (a notebook in a 1400 px window)
    width = max(120, len(lines[0]))
    notes = [textwrap.fill(note, width, subsequent_indent="  ") for note in notes]
    return "\n".join(lines + [""] + notes)
