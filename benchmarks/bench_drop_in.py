"""ddpkit's DDP wrappers against torch's DistributedDataParallel on a stock process group, as in a
user's own script: torchrun, ``init_process_group("gloo")``, torch's default buckets.

    python benchmarks/bench_drop_in.py [--world-size 2] [--rounds 5] [--steps 10] [--models many,few]

It starts torchrun on itself. Each rank builds every wrapper once, each on its own copy of the model,
then times them in rounds that alternate them (a small machine's speed drifts from minute to minute):
``--steps`` training steps each (forward, backward, SGD step), after two warm-up steps. Two models:

    many   an MLP of 33 Linear layers 256 wide: 66 small parameter tensors (2.1 M parameters)
    few    an MLP of 4 Linear layers 1024 wide: 8 tensors, 4 of them 4 MiB (4.2 M parameters)

Printed per model: ms per step (the median over rounds of the slowest rank's median step) and the
ratio to torch's DDP, and for ddpkit's wrappers their gradient hooks, timed inside the steps: how
many a step, µs per hook, and of it the hook's own Python (less the gradient's copy into its bucket
and the all-reduce launches it makes, which torch's C++ reducer makes too). The goal (issue 45):
overlapped <= 1.05x torch's DDP, bucketed <= 1.10x.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

MODELS = {"many": dict(width=256, depth=33), "few": dict(width=1024, depth=4)}
WRAPPERS = ("torch_ddp", "naive", "bucketed", "overlapped")
BATCH = 32  # rows per rank


def build(name: str, module):
    import ddpkit
    from torch.nn.parallel import DistributedDataParallel

    cls = {"torch_ddp": DistributedDataParallel, "naive": ddpkit.NaiveDDP, "bucketed": ddpkit.BucketedDDP,
           "overlapped": ddpkit.OverlappedDDP}[name]
    return cls(module)  # every one at its defaults: torch's buckets (25 MiB, the first 1 MiB)


class PythonCost:
    """Time spent in ddpkit's gradient hooks (the wrapper method every hook calls), and inside them
    in copying gradients into buckets (``Bucket.copy_in``) and launching all-reduces
    (``Bucket.all_reduce``): what is left of a hook is its own Python, the wrapper's bookkeeping."""

    def __init__(self):
        from ddpkit.strategies import buckets, ddp_module

        self.ns = {"hook": 0, "copy": 0, "launch": 0}
        self.calls = {"hook": 0, "copy": 0, "launch": 0}
        self.in_hook = False
        self._patch(ddp_module, "_call_owner", "hook")
        self._patch(buckets.Bucket, "copy_in", "copy")
        self._patch(buckets.Bucket, "all_reduce", "launch")

    def _patch(self, owner, name: str, what: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            outer = what == "hook"
            if not (outer or self.in_hook):  # a copy or launch after backward: not a hook's
                return original(*args, **kwargs)
            self.in_hook = True
            t0 = time.perf_counter_ns()
            try:
                return original(*args, **kwargs)
            finally:
                self.ns[what] += time.perf_counter_ns() - t0
                self.calls[what] += 1
                self.in_hook = not outer

        setattr(owner, name, timed)

    def per_step(self, steps: int) -> dict:
        """Hooks a step, and µs per hook: all of it, and its own Python (less copies and launches)."""
        hooks = max(self.calls["hook"], 1)
        own = self.ns["hook"] - self.ns["copy"] - self.ns["launch"]
        return {"hooks": self.calls["hook"] / steps, "hook": self.ns["hook"] / hooks / 1e3, "python": own / hooks / 1e3}

    def reset(self) -> None:
        for d in (self.ns, self.calls):
            for k in d:
                d[k] = 0


def mlp(width: int, depth: int):
    from torch import nn

    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def train_step(model, opt, x, y) -> None:
    loss = (model(x) - y).pow(2).mean()
    loss.backward()  # every wrapper has averaged the gradients when it returns
    opt.step()
    opt.zero_grad(set_to_none=True)


def time_model(spec: dict, args, cost) -> tuple[dict, dict]:
    """({wrapper: this rank's median ms per round}, {wrapper: its Python costs})."""
    import torch
    import torch.distributed as dist

    runs = {}
    for name in WRAPPERS:
        torch.manual_seed(0)
        model = build(name, mlp(spec["width"], spec["depth"]))
        runs[name] = (model, torch.optim.SGD(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(BATCH, spec["width"], generator=g), torch.randn(BATCH, spec["width"], generator=g)
    times = {name: [] for name in WRAPPERS}
    python = {name: [] for name in WRAPPERS}  # each round's PythonCost.per_step
    for _ in range(args.rounds):
        for name in WRAPPERS:  # alternated, round after round
            model, opt = runs[name]
            for _ in range(2):
                train_step(model, opt, x, y)
            dist.barrier()
            if cost:
                cost.reset()
            per_step = []
            for _ in range(args.steps):
                t0 = time.perf_counter_ns()
                train_step(model, opt, x, y)
                per_step.append((time.perf_counter_ns() - t0) / 1e6)
            times[name].append(statistics.median(per_step))
            if cost and name != "torch_ddp":
                python[name].append(cost.per_step(args.steps))
    return times, python


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # plain gloo: no ddpkit process group, as in a user's script
    cost = PythonCost() if args.costs else None
    results = {}
    for model_name in args.models.split(","):
        times, python = time_model(MODELS[model_name], args, cost)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, times)
        # the slowest rank's median, round by round
        slowest = {name: [max(r[name][i] for r in gathered) for i in range(args.rounds)] for name in WRAPPERS}
        results[model_name] = (slowest, python)
    if dist.get_rank() == 0:
        report(results, args)
    dist.destroy_process_group()


def report(results: dict, args) -> None:
    for model_name, (slowest, python) in results.items():
        spec = MODELS[model_name]
        print(f"\n{model_name}: MLP of {spec['depth']} Linear layers {spec['width']} wide, {args.world_size} ranks "
              f"on plain gloo, {args.rounds} rounds x {args.steps} steps (ms/step: median over rounds of the "
              "slowest rank)")
        ref = statistics.median(slowest["torch_ddp"])
        print(f"{'wrapper':>11} {'ms/step':>8} {'vs torch':>9} {'rounds (ratio)':>24}   hooks/step  us/hook  "
              "of it Python")
        for name in WRAPPERS:
            med = statistics.median(slowest[name])
            per_round = " ".join(f"{a / b:.2f}" for a, b in zip(slowest[name], slowest["torch_ddp"], strict=True))
            line = f"{name:>11} {med:8.2f} {med / ref:8.2f}x {per_round:>24}"
            if python[name]:  # medians over the rounds
                hooks, whole, own = (statistics.median(r[k] for r in python[name]) for k in ("hooks", "hook", "python"))
                line += f"   {hooks:10.0f} {whole:8.1f} {own:13.1f}"
            print(line)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--models", default="many,few", help="comma-separated, from: " + ",".join(MODELS))
    p.add_argument("--no-costs", dest="costs", action="store_false",
                   help="do not time the hooks and launches (their timers cost a little)")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # set when torchrun starts us
    args = p.parse_args(argv)
    for m in args.models.split(","):
        if m not in MODELS:
            p.error(f"unknown model {m!r}; valid: {', '.join(MODELS)}")
    if args.rank:
        rank_main(args)
        return 0
    import socket

    with socket.socket() as s:  # a free port for torchrun's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.world_size),
           "--master-addr", "127.0.0.1", "--master-port", str(port), os.path.abspath(__file__), "--rank",
           *(argv if argv is not None else sys.argv[1:])]
    return subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"))


if __name__ == "__main__":
    sys.exit(main())
