"""Train with any strategy under torchrun: the same code on one machine or several.

    torchrun --nproc-per-node 2 -m ddpkit.train --strategy overlapped --steps 20
    torchrun --nproc-per-node 2 -m ddpkit.train --strategy fsdp --model mypackage.models:gpt2_tiny
    # two machines, one process each (run the same line on both, --node-rank 0 and 1):
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 \\
        --rdzv-backend c10d --rdzv-endpoint HOST0:29500 -m ddpkit.train --strategy fsdp

torchrun's environment (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, ...) gives the rank layout once
(``Topology.from_torchrun``: NCCL where a node has a GPU per rank; hybrid sharding inside real
nodes); the process group is ddpkit's over that backend, so rank 0 prints the bytes it sent.

Checkpoints (``--checkpoint DIR``, every ``--save-every`` steps and at the end): rank 0 writes the
full model (``full_state_dict()``), every rank its own optimizer state. ``--resume DIR`` loads the
model before wrapping and each rank's optimizer after: k steps + resume for m equals k + m straight.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import torch.distributed as dist

import ddpkit
from ddpkit.comm import process_group
from ddpkit.cluster import BACKENDS, resolve_backend
from ddpkit.experiment import wrap
from ddpkit.models import MODELS
from ddpkit import rankside
from ddpkit.rankside import set_device, set_topology
from ddpkit.step import train_batch
from ddpkit.strategies.table import DEFAULT, NAMES
from ddpkit.topology import Topology
from ddpkit.units import human_bytes
from ddpkit.workload import named, samples_per_rank


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m ddpkit.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", choices=NAMES, default=DEFAULT)
    p.add_argument("--model", default="mlp", metavar="NAME",
                   help=f"a built-in ({', '.join(MODELS)}) or package.module:function returning a ddpkit.Workload")
    p.add_argument("--width", type=int, default=None, help="MLP width / TinyGPT dim")
    p.add_argument("--depth", type=int, default=None, help="MLP depth / TinyGPT layers")
    p.add_argument("--steps", type=int, default=10, help="train until this step count (total, resumed included)")
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="bucket size cap in MiB (default: torch DDP's, 25 with the first bucket at 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="auto: nccl when this machine has a GPU per local rank, else gloo")
    p.add_argument("--save", metavar="PATH", help="write the final full state dict here (torch.save, rank 0)")
    p.add_argument("--checkpoint", metavar="DIR", help="write checkpoints into this folder")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every K steps (0: only at the end)")
    p.add_argument("--resume", metavar="DIR", help="continue from the checkpoint in this folder")
    args = p.parse_args(argv)
    for name in ("steps", "global_batch_size", "width", "depth"):
        v = getattr(args, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.save_every < 0:
        p.error(f"--save-every must be >= 0, got {args.save_every}")
    if args.save_every and not args.checkpoint:
        p.error("--save-every needs --checkpoint DIR")
    if args.resume and not os.path.isfile(os.path.join(args.resume, "model.pt")):
        p.error(f"--resume {args.resume!r}: no checkpoint there (model.pt is missing)")
    try:  # imported here, before the process group: a bad --model fails fast, on every rank alike
        args.workload = named(args.model, args.width, args.depth, args.seed)
    except ValueError as exc:
        p.error(str(exc))
    return args


def load_full(module, full: dict) -> None:
    """Load ``{name: tensor}`` into ``module``; a tied parameter may come under one of its names."""
    names_of: dict = {}
    for name, t in module.state_dict(keep_vars=True).items():
        names_of.setdefault(id(t), []).append(name)
    covered = {n for names in names_of.values() if any(x in full for x in names) for n in names}
    missing, unexpected = module.load_state_dict(full, strict=False)
    missing = [k for k in missing if k not in covered]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing}, unexpected {unexpected}")


def save_checkpoint(folder: str, step: int, model, optimizer, rank: int) -> None:
    """Rank 0: the full model and the step; every rank: its own optimizer state."""
    full = model.full_state_dict()  # collective for FSDP: every rank must call it
    os.makedirs(folder, exist_ok=True)
    torch.save(optimizer.state_dict(), os.path.join(folder, f"optimizer.rank{rank}.pt"))
    if rank == 0:
        torch.save({k: v.cpu() for k, v in full.items()}, os.path.join(folder, "model.pt"))
        with open(os.path.join(folder, "meta.json"), "w") as f:
            json.dump({"step": step, "world_size": dist.get_world_size()}, f)
    dist.barrier()  # nobody reads a half-written checkpoint


def main(argv=None) -> int:
    args = parse_args(argv)
    try:  # torchrun's contract: WORLD_SIZE ranks, LOCAL_WORLD_SIZE of them on each node
        topology = Topology.from_torchrun(os.environ)
        backend = resolve_backend(args.backend, topology.ranks_per_node)  # alike on every rank of a node
    except ValueError as exc:
        raise SystemExit(f"ddpkit.train: {exc}") from None
    if backend == "nccl":  # the node's GPU of this rank, on every thread ddpkit starts too
        set_device(int(os.environ["LOCAL_RANK"]))
    # ddpkit's process group over the real backend, as in a Cluster (no emulated delay): every
    # collective, torch's wrappers' too, is counted (and recorded, when a recorder is on)
    process_group.install("loopback", backend)
    dist.init_process_group(process_group.BACKEND_NAME)  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    set_topology(topology)  # hybrid sharding, built by name below, shards inside these nodes
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"{world} ranks ({backend}) as {topology.describe()}: {args.strategy}", flush=True)
    try:
        samples_per_rank(args.global_batch_size, world)
    except ValueError as exc:
        raise SystemExit(f"ddpkit.train: --global-batch-size: {exc}") from None

    wl = args.workload
    module = wl.build(args.seed)
    start = 0
    if args.resume:
        with open(os.path.join(args.resume, "meta.json")) as f:
            meta = json.load(f)
        if meta["world_size"] != world:
            raise SystemExit(f"the checkpoint in {args.resume} was written by {meta['world_size']} ranks, "
                             f"this run has {world}: optimizer state is per rank")
        # Loaded before wrapping: every wrapper broadcasts rank 0's module and FSDP shards it.
        load_full(module, torch.load(os.path.join(args.resume, "model.pt")))
        start = meta["step"]
    model, opt = wrap(args.strategy, module, args.optimizer, args.bucket_cap_mb)
    if args.resume:
        opt.load_state_dict(torch.load(os.path.join(args.resume, f"optimizer.rank{rank}.pt")))

    dev = ddpkit.device()  # this rank's GPU under NCCL, else the CPU
    for step in range(start, args.steps):
        loss = train_batch(model, opt, wl.local_batch(step, args.global_batch_size, rank, world, dev), wl.compute_loss)
        # the loss printed is the mean over all ranks' slices, i.e. the global batch's loss
        dist.all_reduce(loss)
        if rank == 0:
            print(f"step {step:4d}  loss {loss.item() / world:.6f}", flush=True)
        if args.checkpoint and args.save_every and (step + 1) % args.save_every == 0:
            save_checkpoint(args.checkpoint, step + 1, model, opt, rank)
    if args.checkpoint:
        save_checkpoint(args.checkpoint, args.steps, model, opt, rank)

    full = model.full_state_dict()
    checksum = sum(float(v.double().sum()) for v in full.values())
    if rank == 0:
        sent = sum(count[1] for count in rankside.comm().snapshot().values())  # every collective this rank took part in
        print(f"final checksum {checksum:.10f} ({args.strategy}, {world} ranks, {args.steps} steps); "
              f"rank 0 sent {human_bytes(sent)} through ddpkit's process group", flush=True)
        if args.save:
            torch.save({k: v.cpu() for k, v in full.items()}, args.save)
    # Leave together, and free the wrapper while the process group still exists: freed at exit,
    # FSDP's objects aborted a loaded rank in 2 of 6 two-node runs; freed here, 0 of 8.
    dist.barrier()
    del model, opt, full
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
