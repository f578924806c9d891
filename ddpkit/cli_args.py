"""The command line's argument types, its shared options and the checks it makes before any rank
starts (``ddpkit/__main__.py`` parses with them and calls the library). A bad argument is the
parser's error (exit 2) naming what is valid; the checks themselves are the library's, whose
ValueError becomes that error."""
from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap

from ddpkit.cluster import BACKENDS, TRANSPORTS, check_arguments, check_network
from ddpkit.models import MODELS
from ddpkit.strategies.comm_hooks import COMM_HOOKS
from ddpkit.strategies.table import NAMES, TAKES_COMM_HOOK, unfit
from ddpkit.strategies.table import strategy as strategy_row
from ddpkit.workload import samples_per_rank


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, but a help text wraps between words only (``sharded_optimizer`` is never cut)."""

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_long_words=False, break_on_hyphens=False)


# --------------------------------------------------------------------------- argument types
def number_type(convert, lowest, what: str):
    """An argparse type: ``convert(text)``, at least ``lowest``; the message says ``what``."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not value >= lowest:  # `not >=` also refuses NaN
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value
    return parse


positive_int = number_type(int, 1, "a whole number >= 1")
bucket_cap = number_type(float, 0, "a number of MiB >= 0")


def int_list(text: str) -> list[int]:
    numbers = [positive_int(t) for t in text.split(",") if t.strip()]
    if not numbers:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers >= 1 (e.g. 2,4,8), got {text!r}")
    return numbers


def strategy_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown strateg{'ies' if len(unknown) > 1 else 'y'} {', '.join(map(repr, unknown)) or '(none given)'}; "
            f"valid: {', '.join(NAMES)}")
    return list(dict.fromkeys(names))  # keep order, drop repeats


def check_writable(parser, option: str, path: str | None) -> None:
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


def parser_checked(parser, call, *args, **kwargs):
    """``call(*args, **kwargs)``; a ValueError from the library becomes the parser's error (exit 2)."""
    try:
        return call(*args, **kwargs)
    except ValueError as exc:
        parser.error(str(exc))


def parse_network(parser, args, world_sizes):
    """``--network`` and ``--gpus-per-node`` as a ``ddpkit.Network``, checked at every world size."""
    from ddpkit.network import Network

    network = parser_checked(parser, Network.of, args.network, gpus_per_node=args.gpus_per_node)
    for n in world_sizes:
        parser_checked(parser, check_network, network, n)
    return network


def runnable_strategies(parser, given, default, world_sizes, network) -> list[str]:
    """The strategies to run (those ``given`` by name, else ``default``) that can lay out every
    world size on the network (hybrid sharding: whole nodes). One given by name that cannot is
    an error; of the default ones, those that cannot are left out, saying so."""
    names = given if given is not None else default
    why = unfit(names, world_sizes, network)
    if why and given is not None:
        parser.error("; ".join(why.values()))
    for reason in why.values():
        print(f"left out: {reason}", file=sys.stderr)
    return [s for s in names if s not in why]


def check_comm_hook(parser, comm_hook: str | None, strategies) -> None:
    """``--comm-hook`` reduces the buckets of the strategies that take one: at least one must run."""
    if comm_hook is not None and not any(strategy_row(s).takes_comm_hook for s in strategies):
        parser.error(f"--comm-hook {comm_hook}: none of {', '.join(strategies)} takes a communication hook; "
                     f"those that do: {', '.join(TAKES_COMM_HOOK)}")


def check_run_args(parser, args) -> None:
    """Checks shared by compare and trace, before any process starts: the Cluster's own, the
    workload (``--model``), and whether the global batch splits over the ranks."""
    args.network = parse_network(parser, args, [args.world_size])
    settings = parser_checked(parser, check_arguments, args.world_size, args.backend,
                              threads_per_rank=args.threads_per_rank, network=args.network, gpus=args.gpus,
                              transport=args.transport, pin_cores=args.pin_cores)
    args.threads_per_rank = settings.threads_per_rank
    parse_workload(parser, args)
    parser_checked(parser, samples_per_rank, args.global_batch_size, args.world_size)


def parse_workload(parser, args):
    """--model NAME (with --width/--depth for a built-in) as a ``ddpkit.Workload``: a built-in, or
    ``package.module:function`` imported and called here, before any rank starts."""
    from ddpkit.workload import named

    args.workload = parser_checked(parser, named, args.model, args.width, args.depth)
    return args.workload


MODEL_HELP = (f"a built-in ({', '.join(MODELS)}; default mlp) or package.module:function returning a "
               "ddpkit.Workload (your model, its data and loss), importable from here")


def add_run_args(p, steps: int) -> None:
    p.add_argument("--world-size", type=positive_int, default=2, help="number of ranks (default 2)")
    p.add_argument("--model", default="mlp", metavar="NAME", help=MODEL_HELP)
    p.add_argument("--width", type=positive_int, default=None,
                   help="MLP width / TinyGPT dim (default: the model's)")
    p.add_argument("--depth", type=positive_int, default=None,
                   help="MLP depth / TinyGPT layers (default: the model's)")
    p.add_argument("--steps", type=positive_int, default=steps, help=f"timed steps per run (default {steps})")
    p.add_argument("--global-batch-size", type=positive_int, default=32,
                   help="samples per step over all ranks (default 32)")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--bucket-cap-mb", type=bucket_cap, default=None,
                   help="bucket size cap in MiB (default: torch DDP's, 25 with the first bucket at 1)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="auto: nccl with one GPU per rank; with fewer GPUs, the ranks share them (gloo underneath); "
                        "without a GPU, gloo on the CPU")
    add_gpus_arg(p)
    p.add_argument("--threads-per-rank", type=int, default=None,
                   help="torch CPU threads in each rank (default: cores / ranks, at least 1; "
                        "0 leaves torch's default, which oversubscribes the cores)")
    add_transport_arg(p)
    add_network_args(p)
    add_comm_hook_arg(p)


def add_comm_hook_arg(p) -> None:
    p.add_argument("--comm-hook", choices=COMM_HOOKS, default=None, metavar="NAME",
                   help=f"reduce the buckets with this communication hook ({', '.join(COMM_HOOKS)}; "
                        f"ddpkit/strategies/comm_hooks.py) in the strategies that take one "
                        f"({', '.join(TAKES_COMM_HOOK)}); the others run as they are")


def add_gpus_arg(p) -> None:
    gpu_index = number_type(int, 0, "a CUDA device index >= 0")
    p.add_argument("--gpus", default=None, type=lambda t: [gpu_index(x) for x in t.split(",") if x.strip()],
                   help="comma-separated CUDA device indices, one per rank (e.g. 4,5); the same one for several "
                        "ranks shares it (0,0,0,0: 4 ranks on GPU 0)")


def add_transport_arg(p) -> None:
    p.add_argument("--transport", choices=TRANSPORTS, default="auto",
                   help="what moves the ranks' bytes. CPU ranks: shm (shared memory; auto picks it) or gloo (its "
                        "sockets over loopback). A GPU each: NCCL. Ranks sharing a GPU: cuda-ipc (auto: a buffer "
                        "on the GPU), shm (staged through pinned host memory), gloo, or nccl (NCCL 2.30.3+)")
    p.add_argument("--pin-cores", action="store_true",
                   help="bind each rank to cores of its own (needs a core per rank): steadier timings on a "
                        "quiet machine, slower where something else keeps a core busy")


def add_network_args(p) -> None:
    from ddpkit.network import LINKS

    p.add_argument("--network", default="loopback",
                   help=f"the emulated network: a preset ({', '.join(LINKS)}) or ALPHA_US,GBYTES_PER_S, "
                        "e.g. 20,10 (default loopback: no emulated delay)")
    p.add_argument("--gpus-per-node", type=positive_int, default=None,
                   help="two tiers: this many ranks share a node (nvlink inside a node, --network between)")


def describe_workload(workload) -> str:
    """"mlp {'width': 64}": a workload's name, and a built-in's size when given."""
    return f"{workload.name} {workload.config}" if workload.config else workload.name


def write_json(path: str, records: list[dict]) -> None:
    """``records`` into ``path`` (``--json``), and a line saying so."""
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
    print(f"wrote {path}")
