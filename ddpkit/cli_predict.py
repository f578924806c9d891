"""``python -m ddpkit predict``: the cost model's ms per step, or (``--validate``) beside measurement.

The command's checks (which flags go together, the world sizes the global batch splits over, the
cores ``--pin-cores`` needs) and its two runs; ``__main__`` builds its parser. What it calls is
``ddpkit.costmodel`` and ``ddpkit.costmodel.validate``, which a notebook imports too.
"""
from __future__ import annotations

import time

from ddpkit.cli_args import (check_comm_hook, check_writable, describe_workload, parse_network, parse_workload,
                             parser_checked, runnable_strategies, write_json)
from ddpkit.cluster import cores_per_rank
from ddpkit.strategies.table import NAMES
from ddpkit.strategies.table import strategy as strategy_row
from ddpkit.workload import samples_per_rank


def _cmd_validate(args, parser) -> int:
    """predict --validate: the model against measurement, one cluster per world size."""
    check_writable(parser, "--json", args.json)
    import ddpkit
    from ddpkit import costmodel
    from ddpkit.costmodel.validate import format_profile, format_validation, validate
    from ddpkit.progressbar import ProgressBar

    progress = ProgressBar()  # validate's series subscribes it and announces each run, counted
    t0 = time.perf_counter()
    records = []
    for n in args.world_sizes:
        with ddpkit.Cluster(n, backend="auto", network=args.network, transport=args.transport,
                            pin_cores=args.pin_cores) as cluster:
            recs, transport, profile = validate(
                cluster, _with_comm_hook(args.strategies, args.comm_hook), workload=args.workload, steps=args.steps,
                rounds=args.rounds, global_batch_size=args.global_batch_size, optimizer=args.optimizer,
                bucket_cap_mb=args.bucket_cap_mb, progress=progress)
        progress.close()
        records.extend(recs)
        pinned = ", each pinned to its cores" if cluster.cores else ""
        print(f"{n} ranks ({cluster.carried_by}{pinned}) on {args.network.describe()}: {format_profile(profile)}")
        if transport.measured:
            print(costmodel.format_fit(transport))
        emulation = next((r["emulation_ms"] for r in recs if r.get("emulation_ms")), None)
        if emulation:
            print(f"  emulated collectives, waited for: {emulation * 1e3:.0f} us more than the slower of link and "
                  "transport, each after a little compute (wake-ups, ranks arriving apart; the model adds it)")
    print(f"model {describe_workload(args.workload)}, global batch {args.global_batch_size}, {args.optimizer}, "
          f"{args.steps} steps x {args.rounds} rounds; {time.perf_counter() - t0:.0f} s")
    print(format_validation(records))
    for s in args.strategies:
        if not strategy_row(s).predictable:
            print(f"{s}: the model predicts the algorithm it runs ({strategy_row(s).summary}); what "
                  "the implementation adds on top on the host (hooks, copies per unit) is not in the model")
    if args.json:
        write_json(args.json, records)
    return 1 if all("error" in r for r in records) else 0


def _with_comm_hook(strategies, comm_hook):
    """The strategies as validate's variants, ``comm_hook`` in the options of those that take one."""
    return {s: (s, {"comm_hook": comm_hook} if comm_hook and strategy_row(s).takes_comm_hook else {})
            for s in strategies}


def cmd_predict(args, parser) -> int:
    from ddpkit import costmodel
    from ddpkit.network import NETWORKS, as_network

    if args.world_sizes is None:
        args.world_sizes = [2, 4] if args.validate else [2, 4, 8]
    network = parse_network(parser, args, args.world_sizes)  # --fit: the fitted transport instead
    args.network = network
    if args.pin_cores:  # the ranks --validate or --fit start: a core each, checked before any starts
        started = args.world_sizes if args.validate else [args.fit_ranks] if args.fit else []
        if not started:
            parser.error("--pin-cores pins the ranks that --validate or --fit start; without them predict "
                         "starts none (--profile-on-ranks shares the cores, as training would)")
        parser_checked(parser, cores_per_rank, max(started))
    default = [s for s in NAMES if not (args.validate and not strategy_row(s).predictable)]
    args.strategies = runnable_strategies(parser, args.strategies, default, args.world_sizes, network)
    check_comm_hook(parser, args.comm_hook, args.strategies)
    if args.validate and (args.fit or args.batch_per_rank or args.plot or args.threads or args.profile_on_ranks):
        parser.error("--validate fits the network and profiles compute on the ranks itself, with the "
                     "global batch split as compare does: leave out --fit, --batch-per-rank, --plot, "
                     "--threads and --profile-on-ranks")
    if args.json and not args.validate:
        parser.error("--json writes the records --validate measures; add --validate (predict alone prints its table, "
                     "--plot draws it)")
    if args.fit and args.fit_ranks < 2:
        parser.error(f"--fit-ranks must be >= 2 (one rank does not communicate), got {args.fit_ranks}")
    check_writable(parser, "--plot", args.plot)
    parse_workload(parser, args)
    if args.batch_per_rank is None:
        for n in args.world_sizes:
            try:
                samples_per_rank(args.global_batch_size, n)
            except ValueError as exc:
                parser.error(f"{exc}; use --batch-per-rank for weak scaling")
    if args.validate:
        return _cmd_validate(args, parser)
    if args.fit:
        import ddpkit

        sizes = costmodel.model_calibration_sizes(args.workload)
        with ddpkit.Cluster(args.fit_ranks, backend="auto", transport=args.transport,
                            pin_cores=args.pin_cores) as cluster:
            samples = costmodel.slowest_rank(cluster.run(costmodel.measure_collectives, sizes=sizes))
        fitted = costmodel.fit_link(samples, args.fit_ranks, name="fitted here", host=cluster.backend != "nccl")
        print(costmodel.format_fit(fitted))
        # the alpha-beta lines, for every world size alike, between every pair of ranks (the nodes kept)
        network = as_network(fitted, gpus_per_node=network.gpus_per_node)

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    cap = ("25 MiB, the first bucket 1 MiB (torch DDP's default: the last layers' gradients, ready first, "
           "go out in a small bucket)" if args.bucket_cap_mb is None else f"{args.bucket_cap_mb:g} MiB")
    hook = f"; comm hook {args.comm_hook} on the buckets that take one" if args.comm_hook else ""
    print(f"network {network.describe()}; bucket cap {cap}; model {describe_workload(args.workload)}{hook}")
    profiles: dict = {}  # one rank's compute per (batch per rank, ranks profiled at once)
    predictions = []
    for n in args.world_sizes:
        batch = args.batch_per_rank or args.global_batch_size // n
        key = (batch, n if args.profile_on_ranks else None)
        if key not in profiles:
            profiles[key] = costmodel.profile_for(args.workload, batch, args.optimizer, ranks=key[1],
                                                  threads=args.threads)
        predictions += costmodel.predict(profiles[key], args.strategies, [n], network, args.bucket_cap_mb,
                                         comm_hook=args.comm_hook)
    print(costmodel.format_predictions(predictions))
    if args.plot:
        from ddpkit.viz import plot_scaling

        # weak scaling (the same work per rank at every size): the first world size's profile
        profile = next(iter(profiles.values()))
        nets = {net.name: net for net in (network, NETWORKS["100GbE"], NETWORKS["nvlink"])}
        fig = plot_scaling(profile, strategies=args.strategies, networks=list(nets.values()))
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")
    return 0
