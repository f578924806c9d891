"""A training script written the way scripts for torch's DDP are written, with ddpkit's wrappers
swapped in where torch's are built (``docs/own_script.md`` walks through it).

    torchrun --nproc-per-node 2 docs/examples/train_like_torch_ddp.py --wrapper overlapped
    torchrun --nproc-per-node 2 docs/examples/train_like_torch_ddp.py --wrapper torch_ddp   # torch's own

What it does, as such scripts do: a small causal transformer trained with AdamW; each optimizer step
accumulates ``--accum`` micro-batches by setting ``model.require_backward_grad_sync`` on all but the
last (nanoGPT's way); gradients clipped to norm 1; ``model.module`` for the checkpoint; ``--save DIR``
writes a checkpoint at the end, ``--resume DIR`` continues from one. It never calls
``finish_gradient_synchronization()``: ``loss.backward()`` returns with the gradients averaged.

``--wrapper`` may list several (``naive,bucketed,torch_ddp``): each trains in turn from the same
initial model, so one launch compares them. ``--out FILE`` (rank 0) writes every wrapper's losses and
final parameters, which ``tests/test_own_script.py`` compares with torch's.
"""
from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddpkit

VOCAB, CONTEXT = 64, 16


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP; (B, T, C) -> (B, T, C)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)  # each (B, T, C) -> (B, heads, T, C/heads)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, dim), nn.Embedding(CONTEXT, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch(step: int, micro: int, size: int, rank: int, world: int):
    """This rank's rows of the global micro-batch (``size`` rows per rank), the same on any world size."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    data = torch.randint(VOCAB, (size * world, CONTEXT + 1), generator=g)
    rows = data[rank * size:(rank + 1) * size]
    return rows[:, :-1], rows[:, 1:]


def build(wrapper: str, model: nn.Module, lr: float):
    """(the wrapped model, its optimizer): the one place where the script names a wrapper."""
    adamw = dict(lr=lr, weight_decay=0.1)
    if wrapper == "torch_ddp":
        model = DistributedDataParallel(model)
        return model, torch.optim.AdamW(model.parameters(), **adamw)
    if wrapper in ("naive", "bucketed", "overlapped"):  # the drop-in: same arguments, same loop
        cls = {"naive": ddpkit.NaiveDDP, "bucketed": ddpkit.BucketedDDP, "overlapped": ddpkit.OverlappedDDP}[wrapper]
        model = cls(model, broadcast_buffers=True)
        return model, torch.optim.AdamW(model.parameters(), **adamw)
    if wrapper == "torch_zero":  # torch's ZeRO: its sharded optimizer over its DDP
        from torch.distributed.optim import ZeroRedundancyOptimizer
        model = DistributedDataParallel(model)
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **adamw)
    if wrapper in ("zero1", "zero2"):  # ddpkit's ZeRO: the wrapper shards, it builds the optimizer
        model = (ddpkit.ZeRO1 if wrapper == "zero1" else ddpkit.ZeRO2)(model)
        return model, model.make_optimizer(torch.optim.AdamW, **adamw)
    if wrapper == "torch_fsdp":
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), **adamw)
    if wrapper == "fsdp":  # ddpkit's: the same units (the blocks), the optimizer over the shards
        model = ddpkit.FSDP(model, units={Block})
        return model, torch.optim.AdamW(model.parameters(), **adamw)
    raise SystemExit(f"unknown --wrapper {wrapper!r}")


def accumulate_without_sync(model, wrapper: str, last: bool) -> None:
    """Gradient accumulation: torch's DDP (and ddpkit's DDP family) read require_backward_grad_sync;
    ``fully_shard`` (and ddpkit's FSDP) spell it set_requires_gradient_sync."""
    if wrapper in ("torch_fsdp", "fsdp"):
        model.set_requires_gradient_sync(last)
    else:
        model.require_backward_grad_sync = last


def clip(model, wrapper: str) -> None:
    """Clip the whole gradient to norm 1. A replicated wrapper holds it on every rank: torch's function.
    A sharded one of ddpkit's holds 1/N of it: its own clip_grad_norm_ combines the ranks' norms."""
    if wrapper in ("zero1", "zero2", "fsdp"):
        model.clip_grad_norm_(1.0)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def checkpoint(model, opt, wrapper: str):
    """(model state with the module's own names, this rank's optimizer state)."""
    if wrapper == "torch_fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
        return get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    if wrapper == "torch_zero":
        opt.consolidate_state_dict(to=0)  # torch's: the whole optimizer state gathered on rank 0
        return model.module.state_dict(), opt.state_dict() if dist.get_rank() == 0 else None
    if wrapper == "fsdp":
        return model.full_state_dict(), opt.state_dict()
    return model.module.state_dict(), opt.state_dict()  # ZeRO-1/2: opt.state_dict() is this rank's shard


def restore(model, opt, wrapper: str, state) -> None:
    model_state, opt_state = state
    if wrapper == "torch_fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
        set_state_dict(model, opt, model_state_dict=model_state, optim_state_dict=opt_state,
                       options=StateDictOptions(full_state_dict=True))
        return
    if wrapper == "fsdp":
        model.load_full_state_dict(model_state)
    else:
        model.module.load_state_dict(model_state)
    opt.load_state_dict(opt_state)


def train(wrapper: str, args, rank: int, world: int) -> dict:
    torch.manual_seed(0)  # every rank builds the same model; the wrappers broadcast rank 0's anyway
    model, opt = build(wrapper, TinyTransformer(), args.lr)
    start = 0
    if args.resume:
        start, state = torch.load(os.path.join(args.resume, f"{wrapper}.rank{rank}.pt"), weights_only=False)
        if wrapper == "torch_zero":  # torch's consolidated optimizer state was saved by rank 0 alone
            state = (state[0], torch.load(os.path.join(args.resume, f"{wrapper}.rank0.pt"), weights_only=False)[1][1])
        restore(model, opt, wrapper, state)
    losses = []
    for step in range(start, start + args.steps):
        total = 0.0
        for micro in range(args.accum):
            accumulate_without_sync(model, wrapper, last=micro == args.accum - 1)
            x, y = batch(step, micro, args.micro_batch, rank, world)
            loss = model(x, y) / args.accum
            loss.backward()  # averaged across ranks when it returns, on the last micro-batch
            total += loss.item()
        clip(model, wrapper)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    state = checkpoint(model, opt, wrapper)  # every rank takes part (FSDP and ZeRO gather)
    if args.save:
        os.makedirs(args.save, exist_ok=True)
        torch.save((start + args.steps, state), os.path.join(args.save, f"{wrapper}.rank{rank}.pt"))
    return {"losses": losses, "params": {k: v.detach().cpu().clone() for k, v in state[0].items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wrapper", default="overlapped", help="one or several, comma-separated")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--micro-batch", type=int, default=4, help="rows per rank per micro-batch")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--save", metavar="DIR")
    p.add_argument("--resume", metavar="DIR")
    p.add_argument("--out", metavar="FILE", help="rank 0: every wrapper's losses and final parameters")
    p.add_argument("--record", metavar="DIR", help="record the run into DIR/<wrapper> (python -m ddpkit draw DIR/...)")
    args = p.parse_args()
    # torchrun's environment gives RANK, WORLD_SIZE, MASTER_ADDR, ...; ddpkit's process group (over
    # gloo) counts every collective and lets ddpkit.record see them; dist.init_process_group("gloo")
    # trains the same
    ddpkit.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for wrapper in args.wrapper.split(","):
        with ddpkit.record(os.path.join(args.record, wrapper)) if args.record else contextlib.nullcontext():
            results[wrapper] = train(wrapper, args, rank, world)
        if rank == 0:
            print(f"{wrapper:>11}: " + " ".join(f"{v:.4f}" for v in results[wrapper]["losses"]), flush=True)
    if args.out and rank == 0:
        torch.save(results, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
