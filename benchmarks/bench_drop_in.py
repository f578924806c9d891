"""ddpkit's DDP wrappers against torch's DistributedDataParallel on a stock process group, as in a
user's own script: one wrapper in a fresh process group, ``init_process_group("gloo")``, defaults.

    python benchmarks/bench_drop_in.py [--world-size 2] [--rounds 5] [--steps 20] [--models many,few]
                                       [--wrappers torch_ddp,bucketed,overlapped] [--profile DIR]

Each round starts, for every model and wrapper, ``--world-size`` fresh processes (the environment
torchrun gives: ``RANK``, ``MASTER_PORT``, ...) that build that one wrapper and train ``--steps``
steps (forward, backward, SGD step) after 3 warm-up steps; a step lasts as long as its slowest
rank, and the round's figure is the median step. Wrappers alternate within a round (their order
reversed every other round: a small machine's speed drifts from minute to minute). In one shared
process instead, what ddpkit adds to a process (a thread, a first-use cost) slows torch's steps too
and hides itself. Two models:

    many   an MLP of 33 Linear layers 256 wide: 66 small parameter tensors (2.1 M parameters)
    few    an MLP of 4 Linear layers 1024 wide: 8 tensors, 4 of them 4 MiB (4.2 M parameters)

Printed per model and wrapper: ms per step (median over rounds) and the ratio to torch's DDP of the
same round (median, and the rounds' range), with the load average. ``fsdp`` and ``torch_fsdp``
(``fully_shard`` on every Linear, then the root) compare the sharded wrappers; their ratio is
ours over ``torch_fsdp``. ``--profile DIR``: rank 0 of each run writes cProfile's stats of its timed
steps there. Goals (issue 57): overlapped <= 1.05x torch's DDP, bucketed <= 1.10x.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

MODELS = {"many": dict(width=256, depth=33), "few": dict(width=1024, depth=4)}
WRAPPERS = ("torch_ddp", "naive", "bucketed", "overlapped", "fsdp", "torch_fsdp")
WARMUP, BATCH = 3, 32  # warm-up steps; rows per rank


def build(name: str, module):
    from torch import nn

    if name == "torch_fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in module:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        return fully_shard(module)
    if name == "torch_ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module)
    import ddpkit

    if name == "fsdp":
        return ddpkit.FSDP(module, units=[nn.Linear])
    return {"naive": ddpkit.NaiveDDP, "bucketed": ddpkit.BucketedDDP, "overlapped": ddpkit.OverlappedDDP}[name](module)


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


def rank_main(args) -> None:
    """One rank of one run: one wrapper, fresh; rank 0 prints the slowest rank's step times."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # plain gloo: no ddpkit process group, as in a user's script
    spec = MODELS[args.models]
    torch.manual_seed(0)
    model = build(args.wrappers, mlp(spec["width"], spec["depth"]))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(BATCH, spec["width"], generator=g), torch.randn(BATCH, spec["width"], generator=g)
    for _ in range(WARMUP):
        train_step(model, opt, x, y)
    profile = None
    if args.profile and dist.get_rank() == 0:
        import cProfile

        profile = cProfile.Profile()
    times = []
    for _ in range(args.steps):
        dist.barrier()  # start every step together, as in training
        if profile:
            profile.enable()
        t0 = time.perf_counter()
        train_step(model, opt, x, y)
        times.append((time.perf_counter() - t0) * 1e3)
        if profile:
            profile.disable()
    if profile:
        profile.dump_stats(os.path.join(args.profile, f"{args.models}_{args.wrappers}.prof"))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    if dist.get_rank() == 0:
        print("RESULT", json.dumps(statistics.median(max(step) for step in zip(*gathered, strict=True))))
    dist.destroy_process_group()


def run_one(model: str, wrapper: str, args, tries: int = 2) -> float:
    """Median ms per step of one fresh run of ``wrapper`` on ``model``.

    A rank can abort in gloo's teardown as its process exits ("terminate called without an active
    exception", SIGABRT; torch's own DDP too, about one run in 15-20 here): after rank 0 reported, the
    figure stands (said on stderr); before, the run starts again, once."""
    for attempt in range(tries):
        out, codes = _launch(model, wrapper, args)
        if "RESULT" in out:
            if any(codes):
                print(f"  ({wrapper} on {model}: ranks exited with {codes} after reporting: kept)", file=sys.stderr)
            return json.loads(out.split("RESULT", 1)[1])
        print(f"  ({wrapper} on {model}: ranks exited with {codes} before reporting"
              f"{', again' if attempt + 1 < tries else ''})", file=sys.stderr)
    raise SystemExit(f"{wrapper} on {model}: ranks exited with {codes} in {tries} tries")


def _launch(model: str, wrapper: str, args) -> tuple[str, list[int]]:
    """One fresh run: rank 0's output and every rank's exit code."""
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, os.path.abspath(__file__), "--rank", "--models", model, "--wrappers", wrapper,
           "--steps", str(args.steps)] + (["--profile", args.profile] if args.profile else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WORLD_SIZE=str(args.world_size))
    ranks = [subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), text=True,
                              stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL)
             for r in range(args.world_size)]
    out = ranks[0].communicate()[0]
    return out, [r.wait() for r in ranks]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--models", default="many,few", help="comma-separated, from: " + ",".join(MODELS))
    p.add_argument("--wrappers", default="torch_ddp,bucketed,overlapped", help="from: " + ",".join(WRAPPERS))
    p.add_argument("--profile", help="a folder: rank 0 writes cProfile stats of its timed steps there")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # one rank of one run
    args = p.parse_args(argv)
    if args.rank:
        rank_main(args)
        return 0
    models, wrappers = args.models.split(","), args.wrappers.split(",")
    for name, valid in [(m, MODELS) for m in models] + [(w, WRAPPERS) for w in wrappers]:
        if name not in valid:
            p.error(f"unknown {name!r}; valid: {', '.join(valid)}")
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    times = {(m, w): [] for m in models for w in wrappers}
    loads = []
    for r in range(args.rounds):
        for m in models:
            for w in wrappers if r % 2 == 0 else wrappers[::-1]:
                times[m, w].append(run_one(m, w, args))
                print(f"round {r}: {m} {w} {times[m, w][-1]:.2f} ms/step (load {os.getloadavg()[0]:.1f})",
                      file=sys.stderr, flush=True)  # kept if a long run is cut short
        loads.append(os.getloadavg()[0])
    for m in models:
        spec = MODELS[m]
        print(f"\n{m}: MLP of {spec['depth']} Linear layers {spec['width']} wide, {args.world_size} ranks on plain "
              f"gloo, a fresh group per wrapper and round, {args.rounds} rounds x {args.steps} steps (after "
              f"{WARMUP}); load average {min(loads):.1f}-{max(loads):.1f}")
        print(f"{'wrapper':>11} {'ms/step':>8} {'ratio':>7}  rounds (ratio)")
        for w in wrappers:
            ref = "torch_fsdp" if w == "fsdp" else "torch_ddp"
            med = statistics.median(times[m, w])
            if ref in wrappers and w != ref:
                ratios = [a / b for a, b in zip(times[m, w], times[m, ref], strict=True)]
                line = (f"{statistics.median(ratios):6.2f}x  {min(ratios):.2f}-{max(ratios):.2f} of {ref}: "
                        + " ".join(f"{q:.2f}" for q in ratios))
            else:
                line = ""
            print(f"{w:>11} {med:8.2f} {line}".rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
