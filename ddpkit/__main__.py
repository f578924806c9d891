"""The command line: the notebooks' experiments without a notebook.

    python -m ddpkit compare --world-size 2 --strategies naive,bucketed,overlapped,zero1,fsdp,torch_ddp,torch_fsdp
    python -m ddpkit trace --strategy overlapped --world-size 2 --out trace.json   # open in Perfetto
    python -m ddpkit predict --world-sizes 2,4,8 --network 100GbE                  # the cost model

Every argument is checked before a rank process starts: a typo costs no start-up time.
Bad arguments exit with code 2 and a message listing what is valid (argparse's convention).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from ddpkit.strategies.table import NAMES as STRATEGIES
from ddpkit.strategies.table import strategy as strategy_row

MODELS = ("mlp", "gpt")
BACKENDS = ("auto", "gloo", "nccl")


# --------------------------------------------------------------------------- argument types
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _int_list(text: str) -> list[int]:
    return [_positive_int(t) for t in text.split(",") if t.strip()]


def _strategy_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown strateg{'ies' if len(unknown) > 1 else 'y'} {', '.join(map(repr, unknown)) or '(none given)'}; "
            f"valid: {', '.join(STRATEGIES)}")
    return list(dict.fromkeys(names))  # keep order, drop repeats


def _bucket_cap(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of MiB >= 0, got {value}")
    return value


def _check_writable(parser, option: str, path: str | None) -> None:
    """Fail now, not after minutes of training, when an output file cannot be written."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        parser.error(f"{option} {path!r} is a directory; give a file name")
    if not os.path.isdir(folder):
        parser.error(f"{option} {path!r}: the folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        parser.error(f"{option} {path!r} is not writable")


def _check_run_args(parser, args) -> None:
    """Checks shared by compare and trace, before any process starts."""
    if args.threads_per_rank is not None and args.threads_per_rank < 0:
        parser.error(f"--threads-per-rank must be >= 0 (0: torch's default), got {args.threads_per_rank}")
    if args.global_batch_size % args.world_size:
        parser.error(f"--global-batch-size {args.global_batch_size} does not split evenly over "
                     f"--world-size {args.world_size} ranks")
    if args.backend == "nccl":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < args.world_size:
            parser.error(f"--backend nccl needs one GPU per rank: --world-size {args.world_size} but "
                         f"{gpus} CUDA GPU(s) are visible; use --backend gloo")


def _model_kwargs(args) -> dict:
    """--width/--depth in each model's own terms (MLP: width, depth; TinyGPT: dim, layers)."""
    out = {}
    if args.model == "mlp":
        if args.width:
            out["width"] = args.width
        if args.depth:
            out["depth"] = args.depth
    else:
        if args.width:
            out["dim"] = args.width
        if args.depth:
            out["layers"] = args.depth
    return out


def _add_run_args(p, steps: int) -> None:
    p.add_argument("--world-size", type=_positive_int, default=2, help="number of ranks (default 2)")
    p.add_argument("--model", choices=MODELS, default="mlp", help="model (default mlp)")
    p.add_argument("--width", type=_positive_int, default=None,
                   help="MLP width / TinyGPT dim (default: the model's)")
    p.add_argument("--depth", type=_positive_int, default=None,
                   help="MLP depth / TinyGPT layers (default: the model's)")
    p.add_argument("--steps", type=_positive_int, default=steps, help=f"timed steps per run (default {steps})")
    p.add_argument("--global-batch-size", type=_positive_int, default=32,
                   help="samples per step over all ranks (default 32)")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--bucket-cap-mb", type=_bucket_cap, default=25.0, help="bucket size cap in MiB (default 25)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="auto: nccl with one GPU per rank, else gloo")
    p.add_argument("--threads-per-rank", type=int, default=None,
                   help="torch CPU threads in each rank (default: cores / ranks, at least 1; "
                        "0 leaves torch's default, which oversubscribes the cores)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ddpkit", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{compare,trace,predict}")

    p = sub.add_parser("compare", help="time every strategy on the same model, data and optimizer")
    _add_run_args(p, steps=10)
    p.add_argument("--strategies", type=_strategy_list, default=list(STRATEGIES),
                   help=f"comma-separated, from: {','.join(STRATEGIES)} (default all)")
    p.add_argument("--rounds", type=_positive_int, default=3,
                   help="repeat the whole set this many times, interleaved (default 3)")
    p.add_argument("--json", metavar="PATH", help="write one record per strategy here")
    p.add_argument("--plot", metavar="PATH", help="write a bar chart (PNG) here")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("trace", help="record one strategy and write a Chrome trace (open in Perfetto)")
    _add_run_args(p, steps=3)
    p.add_argument("--strategy", choices=STRATEGIES, required=True)
    p.add_argument("--out", metavar="PATH", required=True, help="the trace file (.json)")
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("predict", help="the alpha-beta cost model: predicted ms/step per strategy")
    p.add_argument("--strategies", type=_strategy_list, default=None,
                   help="comma-separated (default all; with --validate all but torch_fsdp, whose "
                        "implementation overheads the model does not know)")
    p.add_argument("--world-sizes", type=_int_list, default=None,
                   help="comma-separated (default 2,4,8; with --validate 2,4)")
    p.add_argument("--network", default="loopback",
                   help="a preset (loopback, 100GbE, nvlink) or ALPHA_US,GBYTES_PER_S, e.g. 20,10")
    p.add_argument("--bucket-cap-mb", type=_bucket_cap, default=25.0)
    p.add_argument("--model", choices=MODELS, default="mlp")
    p.add_argument("--width", type=_positive_int, default=None)
    p.add_argument("--depth", type=_positive_int, default=None)
    p.add_argument("--global-batch-size", type=_positive_int, default=32,
                   help="split over each world size to profile one rank's compute (default 32)")
    p.add_argument("--batch-per-rank", type=_positive_int, default=None,
                   help="weak scaling: this many samples per rank at every size (overrides the global batch)")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch threads while profiling compute (default: torch's); ranks sharing one "
                        "machine's cores each get fewer, e.g. cores / ranks")
    p.add_argument("--profile-on-ranks", action="store_true",
                   help="profile compute inside N ranks at once (one Cluster per world size), so ranks "
                        "sharing this machine's cores slow each other down as in a real run")
    p.add_argument("--fit", action="store_true",
                   help="first fit alpha and beta on this machine (all_reduce timings on --fit-ranks ranks)")
    p.add_argument("--fit-ranks", type=_positive_int, default=2)
    p.add_argument("--plot", metavar="PATH", help="write the predicted scaling to 256 ranks (PNG) here")
    p.add_argument("--validate", action="store_true",
                   help="check the model on this machine: per world size, fit each collective and profile "
                        "compute on the ranks, time every strategy as compare does (interleaved), and "
                        "print predicted against measured ms/step")
    p.add_argument("--rounds", type=_positive_int, default=3, help="with --validate: rounds (default 3)")
    p.add_argument("--steps", type=_positive_int, default=10, help="with --validate: timed steps per run (default 10)")
    p.add_argument("--json", metavar="PATH", help="with --validate: write one record per strategy and size here")
    p.set_defaults(func=cmd_predict)
    return parser


# --------------------------------------------------------------------------- progress
class _Progress:
    """A one-line progress bar on stderr, fed by the cluster's progress events from rank 0."""

    def __init__(self, total_runs: int, stream=sys.stderr):
        self.total_runs, self.stream = total_runs, stream
        self.run, self.label = 0, ""
        self.tty = stream.isatty()

    def start(self, label: str) -> None:
        self.run += 1
        self.label = label
        self.show(0, 1)

    def show(self, done: int, total: int) -> None:
        width = 24
        fill = int(width * done / max(total, 1))
        line = (f"[{'#' * fill}{'.' * (width - fill)}] run {self.run}/{self.total_runs} "
                f"{self.label}: step {done}/{total}")
        if self.tty:
            self.stream.write("\r" + line.ljust(79))
        elif done in (0, total):  # not a terminal (a log): one line per start and end of a run
            self.stream.write(line + "\n")
        self.stream.flush()

    def __call__(self, kind, rank, **fields) -> None:
        if kind == "progress" and rank == 0:
            self.show(fields["done"], fields["total"])

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _run_or_fail(cluster, label: str, fn, *args, **kwargs):
    """Run a job; a failing strategy (e.g. not written yet) is reported and skipped, not fatal."""
    import ddpkit

    try:
        return cluster.run(fn, *args, **kwargs), None
    except ddpkit.RankError as exc:
        last = next(iter(exc.failures.values())).strip().splitlines()[-1]
        if any(r.status == "dead" for r in cluster.ranks):
            cluster.restart()
        return None, f"{label} failed: {last}"


def _start_cluster(args):
    """The Cluster for compare/trace; its ranks split the CPU cores between them (see Cluster)."""
    import ddpkit

    cluster = ddpkit.Cluster(args.world_size, backend=args.backend, threads_per_rank=args.threads_per_rank)
    args.threads_per_rank = cluster.threads_per_rank
    return cluster


# --------------------------------------------------------------------------- compare
def _time_round(cluster, strategies, r: int, steps: int, common: dict, per_round: dict, errors: dict,
                progress=None) -> None:
    """Round ``r`` of timing runs, recording off: each strategy once, the order rotated by ``r``
    so slow spells of a shared machine hit every strategy alike. Appends the slowest rank's
    median ms/step to ``per_round[s]``; a strategy that fails goes to ``errors`` and is skipped."""
    from ddpkit.experiment import run_strategy

    order = strategies[r % len(strategies):] + strategies[:r % len(strategies)]
    for s in order:
        if s in errors:
            continue
        if progress:
            progress.start(f"{s} (round {r + 1}, timing)")
        results, err = _run_or_fail(cluster, s, run_strategy, s, steps=steps, **common)
        if err:
            errors[s] = err
            continue
        per_round[s].append(max(res["ms_per_step"] for res in results))  # as slow as the slowest rank


def compare(cluster, strategies, model="mlp", model_kwargs=None, steps=10, rounds=3,
            global_batch_size=32, optimizer="sgd", bucket_cap_mb=25.0, record_steps=3,
            progress=None) -> list[dict]:
    """Every strategy on one cluster: ``rounds`` interleaved timing runs with recording off (the
    order rotates each round, so slow spells hit every strategy alike), then one short recorded
    run each for bytes, overlap, memory and equality with one process. One dict per strategy."""
    from ddpkit.experiment import run_strategy, train_single_process

    n = cluster.world_size
    common = dict(model=model, model_kwargs=model_kwargs, global_batch_size=global_batch_size,
                  optimizer=optimizer, bucket_cap_mb=bucket_cap_mb)
    per_round: dict = {s: [] for s in strategies}
    errors: dict = {}
    for r in range(rounds):
        _time_round(cluster, strategies, r, steps, common, per_round, errors, progress)

    warmup = 1
    reference = train_single_process(model, optimizer, steps=warmup + record_steps,
                                     global_batch_size=global_batch_size, **(model_kwargs or {}))
    records = []
    for s in strategies:
        if s in errors:
            records.append(dict(strategy=s, world_size=n, error=errors[s]))
            continue
        if progress:
            progress.start(f"{s} (recorded)")
        results, err = _run_or_fail(cluster, s, run_strategy, s, steps=record_steps, warmup=warmup,
                                    record=True, reference=reference, **common)
        if err:
            records.append(dict(strategy=s, world_size=n, error=err))
            continue
        r0 = results[0]
        # torch's own wrappers report spans only (their collectives run inside torch), so their
        # bytes and overlap are unknown here, not zero
        reported = bool(r0["collectives_per_step"]) or n == 1
        records.append(dict(
            strategy=s, world_size=n, model=model, steps=steps, rounds=len(per_round[s]),
            ms_per_step=statistics.median(per_round[s]),
            ms_per_step_rounds=per_round[s],
            ms_per_step_min=min(per_round[s]),
            comm_bytes_per_step=r0["comm_bytes_per_step"] if reported else None,
            collectives_per_step=r0["collectives_per_step"],
            model_state_bytes=max(res["model_state_bytes"] for res in results),
            peak_bytes=max(res["peak_bytes"] for res in results),
            overlap_fraction=statistics.mean(res["overlap_fraction"] for res in results) if reported else None,
            max_param_diff=max(res["max_param_diff"] for res in results),
        ))
    _add_ratios(records)
    return records


def _add_ratios(records: list[dict]) -> None:
    """ms_per_step relative to torch's own wrappers, where they ran (1.2 = 20% slower)."""
    ok = {r["strategy"]: r for r in records if "error" not in r}
    for ref in ("torch_ddp", "torch_fsdp"):
        if ref in ok and ok[ref]["ms_per_step"] > 0:
            for r in ok.values():
                r[f"vs_{ref}"] = r["ms_per_step"] / ok[ref]["ms_per_step"]


def _human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def format_table(records: list[dict]) -> str:
    """The compare results as a fixed-width text table (bytes per rank; sent = ring cost)."""
    cols = [("strategy", "{}"), ("ms_per_step", "{:.2f}"), ("vs_torch_ddp", "{:.2f}x"),
            ("vs_torch_fsdp", "{:.2f}x"), ("comm_bytes_per_step", "bytes"), ("model_state_bytes", "bytes"),
            ("peak_bytes", "bytes"), ("overlap_fraction", "{:.0%}"), ("max_param_diff", "{:.1e}")]
    heads = ["strategy", "ms/step", "vs torch_ddp", "vs torch_fsdp", "sent/step", "model state",
             "peak", "overlap", "max |diff|"]
    rows = []
    for r in records:
        if "error" in r:
            rows.append([r["strategy"], r["error"]])
            continue
        row = []
        for key, fmt in cols:
            v = r.get(key)
            row.append("-" if v is None else _human_bytes(v) if fmt == "bytes" else fmt.format(v))
        rows.append(row)
    widths = [max(len(h), *(len(row[i]) for row in rows if len(row) == len(heads))) for i, h in enumerate(heads)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(heads, widths))]
    for row in rows:
        if len(row) == len(heads):
            lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        else:
            lines.append(f"{row[0].rjust(widths[0])}  {row[1]}")
    return "\n".join(lines)


def plot_compare(records: list[dict]):
    """Bar charts of ms/step, comm bytes/step and model state per strategy (a matplotlib Figure).

    ddpkit's strategies in blue, torch's own in grey; a value a strategy does not report
    (torch's wrappers communicate out of our recorder's sight) is marked "not measured".
    """
    from ddpkit.viz._common import new_figure

    ok = [r for r in records if "error" not in r]
    fig = new_figure(3.4)
    axes = fig.subplots(1, 3)
    names = [r["strategy"] for r in ok]
    colours = ["tab:gray" if n.startswith("torch_") else "tab:blue" for n in names]
    for ax, key, label, scale in ((axes[0], "ms_per_step", "ms per step (median)", 1),
                                  (axes[1], "comm_bytes_per_step", "MB sent per rank per step", 1e6),
                                  (axes[2], "model_state_bytes", "model state MB per rank", 1e6)):
        values = [r[key] for r in ok]
        ax.bar(names, [(v or 0) / scale for v in values], color=colours)
        for i, v in enumerate(values):
            if v is None:
                ax.text(i, 0.03, "not measured", rotation=90, ha="center", va="bottom", fontsize=7,
                        color="dimgray", transform=ax.get_xaxis_transform())
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelrotation=45)
        for t in ax.get_xticklabels():
            t.set_horizontalalignment("right")
            t.set_rotation_mode("anchor")
    ws = ok[0]["world_size"] if ok else "?"
    fig.suptitle(f"ddpkit compare: {ws} ranks, model {ok[0]['model'] if ok else '?'} (grey: torch's own)")
    return fig


def cmd_compare(args, parser) -> int:
    _check_run_args(parser, args)
    _check_writable(parser, "--json", args.json)
    _check_writable(parser, "--plot", args.plot)
    progress = _Progress(total_runs=len(args.strategies) * (args.rounds + 1))
    t0 = time.perf_counter()
    with _start_cluster(args) as cluster:
        cluster.subscribe(progress)
        records = compare(cluster, args.strategies, model=args.model, model_kwargs=_model_kwargs(args),
                          steps=args.steps, rounds=args.rounds, global_batch_size=args.global_batch_size,
                          optimizer=args.optimizer, bucket_cap_mb=args.bucket_cap_mb, progress=progress)
    progress.close()
    print(f"{args.world_size} ranks ({cluster.backend}), model {args.model}, {args.steps} steps x "
          f"{args.rounds} rounds, global batch {args.global_batch_size}, {args.optimizer}, "
          f"{args.threads_per_rank} torch thread(s) per rank; "
          f"{time.perf_counter() - t0:.0f} s")
    print(format_table(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot_compare(records).savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")
    return 1 if all("error" in r for r in records) else 0


# --------------------------------------------------------------------------- trace
def _trace_job(strategy: str, **kwargs) -> dict:
    """run_strategy with recording on and the records returned (a Cluster job)."""
    from ddpkit.experiment import run_strategy

    return run_strategy(strategy, record=True, return_records=True, **kwargs)


def cmd_trace(args, parser) -> int:
    _check_run_args(parser, args)
    _check_writable(parser, "--out", args.out)
    from ddpkit.trace import to_chrome_trace

    progress = _Progress(total_runs=1)
    with _start_cluster(args) as cluster:
        cluster.subscribe(progress)
        progress.start(args.strategy)
        results = cluster.run(_trace_job, args.strategy, model=args.model, model_kwargs=_model_kwargs(args),
                              steps=args.steps, global_batch_size=args.global_batch_size,
                              optimizer=args.optimizer, bucket_cap_mb=args.bucket_cap_mb)
    progress.close()
    to_chrome_trace([r["records"] for r in results], path=args.out)
    r0 = results[0]
    print(f"wrote {args.out}: {args.strategy} on {args.world_size} ranks, {1 + args.steps} steps; "
          f"{r0['comm_bytes_per_step'] / 1e6:.2f} MB sent per rank per step, overlap "
          f"{r0['overlap_fraction']:.0%}. Open it at https://ui.perfetto.dev")
    return 0


# --------------------------------------------------------------------------- predict
def _network(parser, text: str):
    from ddpkit import costmodel

    if text in costmodel.NETWORKS:
        return costmodel.NETWORKS[text]
    try:
        alpha_us, gbps = (float(t) for t in text.split(","))
        if alpha_us < 0 or gbps <= 0:
            raise ValueError
        return costmodel.Network(f"alpha {alpha_us:g} us, {gbps:g} GB/s", alpha_us * 1e-6, 1 / (gbps * 1e9))
    except ValueError:
        parser.error(f"--network {text!r}: valid presets: {', '.join(costmodel.NETWORKS)}, "
                     "or ALPHA_US,GBYTES_PER_S with both > 0 (e.g. 20,10)")


def _median_profile(profiles):
    """The profile whose compute total is the median of ``profiles`` (one per round)."""
    ranked = sorted(profiles, key=lambda p: p.forward_s + p.backward_s + p.optimizer_s)
    return ranked[len(ranked) // 2]


def validate(cluster, strategies, model="mlp", model_kwargs=None, steps=10, rounds=3,
             global_batch_size=32, optimizer="sgd", bucket_cap_mb=25.0, progress=None):
    """The cost model against measurement on one cluster: each round calibrates the collectives
    (``measure_collectives``), profiles compute on every rank at once (``profile_job``) and
    times every strategy as ``compare`` does, all interleaved so that a slow spell of a shared
    machine hits calibration and measurement alike. The model sees only the calibration and
    the profile, never a strategy's timing. Returns ``(records, network, profile)``: one record
    per strategy with ``predicted_ms`` (each collective on its fitted alpha-beta line),
    ``measured_ms`` (median over rounds), ``rel_error`` (predicted / measured - 1),
    ``measured_ms_rounds`` and ``predicted_from_timings_ms`` (collectives interpolated between
    the calibration's timings instead, ``Network.measured``, which holds them). A strategy that
    fails has ``error`` instead."""
    from ddpkit import costmodel

    n = cluster.world_size
    sizes = _calibration_sizes(model, model_kwargs)
    common = dict(model=model, model_kwargs=model_kwargs, global_batch_size=global_batch_size,
                  optimizer=optimizer, bucket_cap_mb=bucket_cap_mb)
    per_round: dict = {s: [] for s in strategies}
    errors: dict = {}
    calibrations, profiles = [], []
    for r in range(rounds):
        if n > 1:
            if progress:
                progress.start(f"calibrating collectives (round {r + 1})")
            calibrations.append(costmodel.slowest_rank(cluster.run(costmodel.measure_collectives, sizes=sizes)))
        if progress:
            progress.start(f"profiling compute (round {r + 1})")
        ranks = cluster.run(costmodel.profile_job, model, global_batch_size // n, optimizer, model_kwargs)
        profiles.append(max(ranks, key=lambda p: p.forward_s + p.backward_s))  # the slowest rank
        _time_round(cluster, strategies, r, steps, common, per_round, errors, progress)

    network = costmodel.NETWORKS["loopback"]
    if calibrations:  # per collective and size, the median over rounds
        merged = {op: [(rows[0][0], statistics.median(t for _, t in rows))
                       for rows in zip(*(c[op] for c in calibrations))] for op in calibrations[0]}
        network = costmodel.fit_network(merged, n, name=f"fitted on {n} ranks")
    profile = _median_profile(profiles)
    records = []
    for s in strategies:
        if s in errors:
            records.append(dict(strategy=s, world_size=n, error=errors[s]))
            continue
        pred = costmodel.simulate(s, profile, n, network.line(), bucket_cap_mb)
        interpolated = costmodel.simulate(s, profile, n, network, bucket_cap_mb)
        measured = statistics.median(per_round[s])
        records.append(dict(strategy=s, world_size=n, model=model, predicted_ms=pred.ms_per_step,
                            predicted_from_timings_ms=interpolated.ms_per_step,
                            measured_ms=measured, rel_error=pred.ms_per_step / measured - 1,
                            measured_ms_rounds=per_round[s], compute_ms=pred.compute_ms,
                            exposed_comm_ms=pred.exposed_comm_ms))
    return records, network, profile


def _calibration_sizes(model: str, model_kwargs: dict | None) -> tuple:
    """The collective sizes worth timing for this model: up to its parameter bytes, and beyond."""
    from ddpkit import costmodel
    from ddpkit.models import build_model

    module = build_model(model, **(model_kwargs or {}))
    return costmodel.calibration_sizes(sum(p.numel() * p.element_size() for p in module.parameters()))


def _print_fit(network) -> None:
    """Each collective's fitted line, and the timings it was fitted to (``network.measured``)."""
    from ddpkit import costmodel

    n, line = network.measured_world_size, network.line()
    print(f"fitted on {n} ranks (collectives timed in a row, slowest rank):")
    for op, rows in network.measured.items():
        alpha, beta = network.alpha_beta(op)
        print(f"  {op:<14} alpha {alpha * 1e6:7.1f} us, {1e-9 / beta if beta else float('inf'):6.2f} GB/s;  "
              + "  ".join(f"{size / 1024:.0f} {sec * 1e3:.2f}/{costmodel.collective_time(op, size, n, line) * 1e3:.2f}"
                          for size, sec in rows) + "  (KiB measured/fitted ms)")


def _cmd_validate(args, parser) -> int:
    """predict --validate: the model against measurement, one cluster per world size."""
    import ddpkit

    _check_writable(parser, "--json", args.json)
    kwargs = _model_kwargs(args)
    progress = _Progress(total_runs=sum(args.rounds * (len(args.strategies) + (2 if n > 1 else 1))
                                        for n in args.world_sizes))
    t0 = time.perf_counter()
    records = []
    for n in args.world_sizes:
        with ddpkit.Cluster(n, backend="auto") as cluster:
            cluster.subscribe(progress)
            recs, network, profile = validate(
                cluster, args.strategies, model=args.model, model_kwargs=kwargs, steps=args.steps,
                rounds=args.rounds, global_batch_size=args.global_batch_size, optimizer=args.optimizer,
                bucket_cap_mb=args.bucket_cap_mb, progress=progress)
        progress.close()
        records.extend(recs)
        print(f"{n} ranks ({cluster.backend}): compute {(profile.forward_s + profile.backward_s) * 1e3:.2f} ms "
              f"+ optimizer {profile.optimizer_s * 1e3:.2f} ms per step (slowest rank, all ranks computing), "
              f"gradient copies {1e-9 / profile.copy_s_per_byte if profile.copy_s_per_byte else float('inf'):.1f} GB/s")
        if network.measured:
            _print_fit(network)
    print(f"model {args.model} {kwargs or ''}, global batch {args.global_batch_size}, {args.optimizer}, "
          f"{args.steps} steps x {args.rounds} rounds; {time.perf_counter() - t0:.0f} s")
    print(format_validation(records))
    if "torch_fsdp" in args.strategies:
        print("torch_fsdp: the model predicts the ZeRO-3 algorithm with prefetching, as for fsdp; "
              "what torch's fully_shard adds on top (its hooks and copies per unit, on the host) "
              "is not in the model")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {args.json}")
    return 1 if all("error" in r for r in records) else 0


def format_validation(records: list[dict]) -> str:
    """predict --validate's table: predicted (alpha-beta lines) and measured ms/step, the error,
    the rounds' spread; then the prediction from the calibration's timings, interpolated."""
    heads = (f"{'ranks':>5}  {'strategy':>10}  {'predicted':>9}  {'measured':>8}  {'error':>6}  "
             f"{'rounds (min-max)':>16}  {'from timings':>12}  {'error':>6}")
    lines = [heads]
    for r in records:
        if "error" in r:
            lines.append(f"{r['world_size']:>5}  {r['strategy']:>10}  {r['error']}")
            continue
        spread = f"{min(r['measured_ms_rounds']):.1f}-{max(r['measured_ms_rounds']):.1f}"
        lines.append(f"{r['world_size']:>5}  {r['strategy']:>10}  {r['predicted_ms']:9.2f}  {r['measured_ms']:8.2f}  "
                     f"{r['rel_error']:+6.0%}  {spread:>16}  {r['predicted_from_timings_ms']:12.2f}  "
                     f"{r['predicted_from_timings_ms'] / r['measured_ms'] - 1:+6.0%}")
    return "\n".join(lines)


def cmd_predict(args, parser) -> int:
    from ddpkit import costmodel
    from ddpkit.experiment import local_batch
    from ddpkit.models import build_model

    if args.world_sizes is None:
        args.world_sizes = [2, 4] if args.validate else [2, 4, 8]
    if args.strategies is None:
        args.strategies = [s for s in STRATEGIES if not (args.validate and not strategy_row(s).predictable)]
    network = _network(parser, args.network)  # replaced by the fitted one with --fit
    if args.validate and (args.fit or args.batch_per_rank or args.plot or args.threads or args.profile_on_ranks):
        parser.error("--validate fits the network and profiles compute on the ranks itself, with the "
                     "global batch split as compare does: leave out --fit, --batch-per-rank, --plot, "
                     "--threads and --profile-on-ranks")
    if args.fit and args.fit_ranks < 2:
        parser.error(f"--fit-ranks must be >= 2 (one rank does not communicate), got {args.fit_ranks}")
    _check_writable(parser, "--plot", args.plot)
    if args.batch_per_rank is None:
        bad = [n for n in args.world_sizes if args.global_batch_size % n]
        if bad:
            parser.error(f"--global-batch-size {args.global_batch_size} does not split evenly over "
                         f"{bad} ranks; use --batch-per-rank for weak scaling")
    if args.validate:
        return _cmd_validate(args, parser)
    if args.fit:
        import ddpkit

        sizes = _calibration_sizes(args.model, _model_kwargs(args))
        with ddpkit.Cluster(args.fit_ranks, backend="auto") as cluster:
            samples = costmodel.slowest_rank(cluster.run(costmodel.measure_collectives, sizes=sizes))
        network = costmodel.fit_network(samples, args.fit_ranks, name="fitted here")
        _print_fit(network)
        network = network.line()  # the alpha-beta lines, for every world size alike

    kwargs = _model_kwargs(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    print(f"network {network.name}: alpha {network.alpha * 1e6:.1f} us, {network.gbytes_per_s:.2f} GB/s; "
          f"bucket cap {args.bucket_cap_mb:g} MiB; model {args.model} {kwargs or ''}")
    heads = f"{'ranks':>5}  {'strategy':>10}  {'ms/step':>9}  {'compute':>8}  {'exposed comm':>12}  {'sent kB/step':>12}"
    print(heads)
    profiles: dict = {}
    for n in args.world_sizes:
        batch = args.batch_per_rank or args.global_batch_size // n
        key = (batch, n if args.profile_on_ranks else 1)
        if key not in profiles:  # one rank's compute at this per-rank batch
            if args.profile_on_ranks:
                import ddpkit

                with ddpkit.Cluster(n, backend="auto", threads_per_rank=args.threads) as cluster:
                    ranks = cluster.run(costmodel.profile_job, args.model, batch, args.optimizer, kwargs)
                profiles[key] = max(ranks, key=lambda p: p.forward_s + p.backward_s)  # the slowest rank
            else:
                module = build_model(args.model, **kwargs)
                x, y = local_batch(module, batch, 0, 0, 1)
                profiles[key] = costmodel.profile_model(module, x, y, optimizer=args.optimizer)
        for s in args.strategies:
            p = costmodel.simulate(s, profiles[key], n, network, args.bucket_cap_mb)
            print(f"{n:>5}  {s:>10}  {p.ms_per_step:9.2f}  {p.compute_ms:8.2f}  {p.exposed_comm_ms:12.2f}  "
                  f"{p.comm_bytes_per_step / 1e3:12.1f}")
    if args.plot:
        # weak scaling (the same work per rank at every size): the first world size's profile
        profile = next(iter(profiles.values()))
        nets = {net.name: net for net in (network, costmodel.NETWORKS["100GbE"], costmodel.NETWORKS["nvlink"])}
        fig = costmodel.plot_scaling(profile, strategies=args.strategies, networks=list(nets.values()))
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args, parser)


if __name__ == "__main__":
    sys.exit(main())
