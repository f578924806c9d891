"""The command line: the notebooks' experiments without a notebook.

    python -m ddpkit compare --world-size 2 --strategies naive,bucketed,overlapped,zero1,fsdp,torch_ddp,torch_fsdp
    python -m ddpkit trace --strategy overlapped --world-size 2 --out trace.json   # open in Perfetto
    python -m ddpkit predict --world-sizes 2,4,8 --network 100GbE                  # the cost model
    python -m ddpkit compare --model mypackage.models:gpt2_tiny    # your own ddpkit.Workload
    python -m ddpkit draw run1                       # pictures of your torchrun script's ddpkit.record("run1")
    python -m ddpkit ledger                          # your predictions against your runs (a table, a picture)
    python -m ddpkit ledger ana.jsonl ben.jsonl ...   # a class's: one row per question
    ddpkit lab                                       # JupyterLab on the course's first notebook

Every argument is checked before a rank starts; bad ones exit with code 2 and what is valid.
This file only parses (``cli_args``, ``cli_predict``) and calls library code a notebook imports too.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
import time

from ddpkit.cli_args import (HelpFormatter, positive_int, bucket_cap, int_list, strategy_list, check_writable,
                              runnable_strategies, check_run_args, MODEL_HELP, add_run_args, add_gpus_arg,
                              add_transport_arg, add_network_args, add_comm_hook_arg, check_comm_hook,
                              describe_workload, write_json)
from ddpkit.cli_predict import cmd_predict
from ddpkit.cluster.placement import SHARED_GPU_NOTE, shares
from ddpkit.strategies.table import NAMES
from ddpkit.strategies.table import strategy as strategy_row
from ddpkit.units import human_bytes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ddpkit", description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{compare,trace,predict,doctor,ledger,lab,draw}")

    def add(name, **kwargs):
        return sub.add_parser(name, formatter_class=HelpFormatter, **kwargs)

    p = add("compare", help="time every strategy on the same model, data and optimizer")
    add_run_args(p, steps=10)
    p.add_argument("--strategies", type=strategy_list, default=None,
                   help=f"comma-separated, from: {', '.join(NAMES)} (default all that fit the world size)")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="repeat the whole set this many times, interleaved (default 3)")
    p.add_argument("--json", metavar="PATH", help="write one record per strategy here")
    p.add_argument("--plot", metavar="PATH", help="write a bar chart (PNG) here")
    p.set_defaults(func=cmd_compare)

    p = add("trace", help="record one strategy and write a Chrome trace (open in Perfetto)")
    add_run_args(p, steps=3)
    p.add_argument("--strategy", choices=NAMES, required=True, metavar="NAME",
                   help=f"one of: {', '.join(NAMES)}")
    p.add_argument("--out", metavar="PATH", required=True, help="the trace file (.json)")
    p.set_defaults(func=cmd_trace)

    p = add("draw", help="the widget's pictures and a Perfetto trace from a recording of your own script "
                         "(ddpkit.record, docs/own_script.md)")
    p.add_argument("folder", help="the folder given to ddpkit.record (one rank<r>.records file per rank)")
    p.add_argument("--step", type=int, default=-1, help="the recorded step to draw (default: the last)")
    p.set_defaults(func=cmd_draw)

    p = add("predict", help="the alpha-beta cost model: predicted ms/step per strategy")
    p.add_argument("--strategies", type=strategy_list, default=None,
                   help=f"comma-separated, from: {', '.join(NAMES)} (default all; with --validate all but "
                        f"{', '.join(s for s in NAMES if not strategy_row(s).predictable)}, whose "
                        "implementation overheads the model does not know)")
    p.add_argument("--world-sizes", type=int_list, default=None,
                   help="comma-separated (default 2,4,8; with --validate 2,4)")
    add_network_args(p)
    p.add_argument("--bucket-cap-mb", type=bucket_cap, default=None,
                   help="bucket size cap in MiB (default: torch DDP's, 25 with the first bucket at 1)")
    add_comm_hook_arg(p)
    p.add_argument("--model", default="mlp", metavar="NAME", help=MODEL_HELP)
    p.add_argument("--width", type=positive_int, default=None)
    p.add_argument("--depth", type=positive_int, default=None)
    p.add_argument("--global-batch-size", type=positive_int, default=32,
                   help="split over each world size to profile one rank's compute (default 32)")
    p.add_argument("--batch-per-rank", type=positive_int, default=None,
                   help="weak scaling: this many samples per rank at every size (overrides the global batch)")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads while profiling compute (default: torch's); ranks sharing one "
                        "machine's cores each get fewer, e.g. cores / ranks")
    p.add_argument("--profile-on-ranks", action="store_true",
                   help="profile compute inside N ranks at once (one Cluster per world size), so ranks "
                        "sharing this machine's cores slow each other down as in a real run")
    p.add_argument("--fit", action="store_true",
                   help="first fit alpha and beta on this machine (all_reduce timings on --fit-ranks ranks)")
    p.add_argument("--fit-ranks", type=positive_int, default=2)
    add_transport_arg(p)  # --fit and --validate time this machine's transport
    p.add_argument("--plot", metavar="PATH", help="write the predicted scaling to 256 ranks (PNG) here")
    p.add_argument("--validate", action="store_true",
                   help="check the model on this machine: per world size, fit each collective and profile "
                        "compute on the ranks, time every strategy as compare does (interleaved), and "
                        "print predicted against measured ms/step")
    p.add_argument("--rounds", type=positive_int, default=5,
                   help="with --validate: interleaved rounds, each strategy's median (default 5)")
    p.add_argument("--steps", type=positive_int, default=10, help="with --validate: timed steps per run (default 10)")
    p.add_argument("--json", metavar="PATH", help="with --validate: write one record per strategy and size here")
    p.set_defaults(func=cmd_predict)

    p = add("doctor", help="check every feature on this machine's real backend (run it first in a lab)")
    p.add_argument("--world-size", type=positive_int, default=2)
    add_gpus_arg(p)
    p.add_argument("--only", type=lambda t: [x.strip() for x in t.split(",") if x.strip()], default=None,
                   help="comma-separated check names, as printed (e.g. 'cluster,compare')")
    p.set_defaults(func=cmd_doctor)

    p = add("ledger", help="the predictions you made in the notebooks against your runs; several files: a class's",
            description="One ledger (default: predictions.jsonl here or in notebooks/): its table, and a picture "
                        "of predicted against measured. Several: one row per question over the class (median miss, "
                        "its spread, how many named the right winner), and one picture of everyone's misses.")
    p.add_argument("ledgers", nargs="*", metavar="FILE", help="JSONL ledgers, one per learner")
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="where to draw the picture (PNG; default: beside the ledger, predictions.png for "
                        "predictions.jsonl, or class_predictions.png beside the first of several)")
    p.set_defaults(func=cmd_ledger)

    p = add("lab", help="JupyterLab on the course's first notebook (adds --allow-root as root)",
            description="Start JupyterLab on notebooks/00_start_here.ipynb of this checkout. Any other "
                        "argument goes to jupyter lab as it is (e.g. --port 8890 --no-browser); as root, "
                        "--allow-root is added, and a line says so.")
    p.set_defaults(func=cmd_lab)
    return parser


def _start_cluster(args):
    """The Cluster for compare/trace; its ranks split the CPU cores between them (see Cluster)."""
    import ddpkit

    return ddpkit.Cluster(args.world_size, backend=args.backend, threads_per_rank=args.threads_per_rank,
                          network=args.network, gpus=args.gpus, transport=args.transport, pin_cores=args.pin_cores)


def cmd_compare(args, parser) -> int:
    check_run_args(parser, args)
    args.strategies = runnable_strategies(parser, args.strategies, list(NAMES), [args.world_size], args.network)
    check_comm_hook(parser, args.comm_hook, args.strategies)
    check_writable(parser, "--json", args.json)
    check_writable(parser, "--plot", args.plot)
    from ddpkit.compare import compare, format_table
    from ddpkit.progressbar import ProgressBar

    progress = ProgressBar()  # compare's series subscribes it and announces each run, counted
    t0 = time.perf_counter()
    try:
        with _start_cluster(args) as cluster:
            records = compare(cluster, args.strategies, workload=args.workload, steps=args.steps,
                              rounds=args.rounds, global_batch_size=args.global_batch_size,
                              optimizer=args.optimizer, bucket_cap_mb=args.bucket_cap_mb, progress=progress,
                              comm_hook=args.comm_hook)
    finally:
        progress.close()
    print(f"{args.world_size} ranks ({cluster.carried_by}) on {args.network.describe()}, "
          f"model {describe_workload(args.workload)}, {args.steps} steps x {args.rounds} rounds, "
          f"global batch {args.global_batch_size}, {args.optimizer}, "
          f"{args.threads_per_rank} torch thread(s) per rank"
          f"{', each rank pinned to its cores' if cluster.cores else ''}; {time.perf_counter() - t0:.0f} s")
    print(format_table(records))
    if shares(cluster.gpus):
        print(SHARED_GPU_NOTE)
    if args.json:
        write_json(args.json, records)
    if args.plot:
        from ddpkit.viz import plot_compare

        plot_compare(records).savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")
    return 1 if all("error" in r for r in records) else 0


def cmd_trace(args, parser) -> int:
    check_run_args(parser, args)
    runnable_strategies(parser, [args.strategy], None, [args.world_size], args.network)
    check_comm_hook(parser, args.comm_hook, [args.strategy])
    check_writable(parser, "--out", args.out)
    from ddpkit.experiment import run_strategy
    from ddpkit.progressbar import ProgressBar
    from ddpkit.trace import to_chrome_trace

    progress = ProgressBar()  # one run, which no series announces: started here
    with _start_cluster(args) as cluster:
        cluster.subscribe(progress)
        progress.start(args.strategy)
        results = cluster.run(run_strategy, args.strategy, record=True, return_records=True,
                              workload=args.workload, steps=args.steps,
                              global_batch_size=args.global_batch_size, optimizer=args.optimizer,
                              bucket_cap_mb=args.bucket_cap_mb,
                              options={"comm_hook": args.comm_hook} if args.comm_hook else None)
    progress.close()
    to_chrome_trace([r.records for r in results], path=args.out)
    r0 = results[0]
    print(f"wrote {args.out}: {args.strategy} on {args.world_size} ranks, {1 + args.steps} steps; "
          f"{human_bytes(r0.comm_bytes_per_step)} sent per rank per step, overlap "
          f"{r0.overlap_fraction:.0%}. Open it at https://ui.perfetto.dev")
    return 0


def cmd_draw(args, parser) -> int:
    from ddpkit.torchrun import draw

    try:
        paths = draw(args.folder, args.step)
    except (OSError, ValueError) as exc:  # no recording there, a rank's file missing or damaged, no such step
        parser.error(str(exc))
    for what, path in paths.items():
        print(f"wrote {path}: {what}")
    print("Open trace.json at https://ui.perfetto.dev")
    return 0


def cmd_doctor(args, parser) -> int:
    from ddpkit.doctor import doctor

    try:
        return doctor(args.world_size, gpus=args.gpus, only=args.only)
    except ValueError as exc:  # bad --only, --gpus
        parser.error(str(exc))


def cmd_ledger(args, parser) -> int:
    from ddpkit.predictions.report import picture_path, report

    missing = [p for p in args.ledgers if not os.path.isfile(p)]
    if missing:
        parser.error(f"no ledger at {', '.join(missing)}")
    try:
        plot = args.plot or str(picture_path(args.ledgers))
        check_writable(parser, "--plot", plot)
        text, fig = report(args.ledgers)
    except (FileNotFoundError, ValueError) as exc:
        parser.error(str(exc))
    print(text)
    fig.savefig(plot, dpi=110)
    print(f"wrote {plot}")
    return 0


def cmd_lab(args, parser) -> int:
    from ddpkit.lab import lab

    try:
        return lab(args.jupyter_args)
    except FileNotFoundError as exc:  # not a checkout: no notebooks beside the package
        print(f"ddpkit lab: {exc}", file=sys.stderr)
        return 1


def main(argv=None) -> int:
    parser = build_parser()
    # a value that starts with "-" but is no option (--network -1,5): argparse would take it for one
    argv = list(sys.argv[1:] if argv is None else argv)
    for i in range(len(argv) - 1, 0, -1):
        if argv[i - 1].startswith("--") and "=" not in argv[i - 1] and re.match(r"-[\d.]", argv[i]):
            argv[i - 1:i + 1] = [f"{argv[i - 1]}={argv[i]}"]
    # lab passes what it does not know to jupyter lab; every other command refuses it
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "lab":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.jupyter_args = extra
    # Ctrl-C: Interrupted (jupyter lab handles its own; a caller's thread cannot take signals)
    own = args.command != "lab" and threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, _interrupt) if own else None
    try:
        return args.func(args, parser)
    except Interrupted as exc:  # one line, what was measured until then, and no restart of the ranks
        print("interrupted", file=sys.stderr)
        if getattr(exc, "records", None):
            from ddpkit.compare import format_table

            print(format_table(exc.records))
        return 130
    finally:
        if own:
            signal.signal(signal.SIGINT, previous)


class Interrupted(BaseException):
    """Ctrl-C on the command line. Not a KeyboardInterrupt: a notebook's stop button leaves the
    cluster ready for its next run (``cluster.jobs``), a command line has none; the ranks are shut
    down as the command's ``with`` block ends."""


def _interrupt(signum, frame):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
    raise Interrupted


if __name__ == "__main__":
    sys.exit(main())
