"""A Hugging Face accelerate training loop, with ddpkit's DDP wrappers where accelerate builds torch's
(``docs/own_script.md``, "In the frameworks").

    torchrun --nproc-per-node 2 docs/examples/train_with_accelerate.py --wrapper overlapped
    torchrun --nproc-per-node 2 docs/examples/train_with_accelerate.py --wrapper torch_ddp,naive,bucketed,overlapped

What it does, as accelerate's own examples do: a small LayerNorm MLP, AdamW, ``accelerator.accumulate``
over 2 micro-batches a step, ``accelerator.clip_grad_norm_``; after ``--steps`` steps ``save_state``, then
a fresh model and optimizer ``load_state`` and train ``--more`` steps on the batches that follow. The one
ddpkit line is ``with ddpkit.frameworks.use(...)`` around it; ``torch_ddp`` leaves it out (torch's own).

``--wrapper`` may list several: each trains in turn from the same start, so one launch compares them (a
name is one of ``WRAPPERS`` or ``package.module:Class``, a wrapper of your own). ``--out FILE`` (rank 0)
writes each one's losses and final parameters; ``--record DIR`` records each into ``DIR/<wrapper>``, for
``python -m ddpkit draw DIR/<wrapper>``.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddpkit

WRAPPERS = {"torch_ddp": None, "naive": ddpkit.NaiveDDP, "bucketed": ddpkit.BucketedDDP,
            "overlapped": ddpkit.OverlappedDDP}
ACCUM = 2  # micro-batches per optimizer step


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)  # ranks may start apart: every wrapper broadcasts rank 0's parameters
    return nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64),
                         nn.GELU(), nn.Linear(64, 4))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=g)
    return TensorDataset(x, x[:, :4].sin() + 0.1 * torch.randn(256, 4, generator=g))


def train(steps: int, checkpoint: str, resume_after: int = 0):
    """``steps`` optimizer steps, then ``save_state(checkpoint)``; or, with ``resume_after`` (the steps the
    checkpoint holds), ``load_state(checkpoint)`` and ``steps`` more. (losses, parameters, the wrapper's class)."""
    # on CPU ranks accelerate wraps the model only when told cpu=True (accelerate launch tells it so)
    accelerator = Accelerator(gradient_accumulation_steps=ACCUM, cpu=not torch.cuda.is_available())
    model = mlp(seed=accelerator.process_index + 100 * resume_after)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    loader = DataLoader(data(), batch_size=4)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    if resume_after:
        accelerator.load_state(checkpoint)  # model, optimizer and random states, as saved
        loader = accelerator.skip_first_batches(loader, resume_after * ACCUM)
    losses = []
    for i, (x, y) in enumerate(loader):
        if i == steps * ACCUM:
            break
        with accelerator.accumulate(model):  # no_sync() on all but the last micro-batch of a step
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    if not resume_after:
        accelerator.save_state(checkpoint)
    params = accelerator.get_state_dict(model)  # unwrapped: the module's own names
    return losses, {k: v.detach().clone() for k, v in params.items()}, type(model).__name__


def wrapper_class(name: str):
    if name in WRAPPERS:
        return WRAPPERS[name]
    module, _, attribute = name.partition(":")
    return getattr(importlib.import_module(module), attribute)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wrapper", default="overlapped", help="one or several, comma-separated")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps before the checkpoint")
    p.add_argument("--more", type=int, default=2, help="optimizer steps after resuming it")
    p.add_argument("--checkpoint", default="checkpoints", metavar="DIR", help="save_state into DIR/<wrapper>")
    p.add_argument("--bucket-cap-mb", type=float, help="ddpkit's bucketed wrappers: the cap (default torch's)")
    p.add_argument("--out", metavar="FILE", help="rank 0: every wrapper's losses and final parameters")
    p.add_argument("--record", metavar="DIR", help="record the run into DIR/<wrapper> (python -m ddpkit draw DIR/...)")
    args = p.parse_args()
    # ddpkit's process group under accelerate's (which finds it initialized): it counts every collective,
    # which ddpkit.record needs; accelerate's own trains the same
    ddpkit.init_process_group("gloo")
    results = {}
    for name in args.wrapper.split(","):
        cls = wrapper_class(name)
        record = ddpkit.record(os.path.join(args.record, name)) if args.record else contextlib.nullcontext()
        checkpoint = os.path.join(args.checkpoint, name)
        options = {"bucket_cap_mb": args.bucket_cap_mb} if args.bucket_cap_mb is not None else {}
        with ddpkit.frameworks.use(cls, **options) if cls else contextlib.nullcontext():  # torch_ddp: torch's
            with record:
                first = train(args.steps, checkpoint)
            second = train(args.more, checkpoint, resume_after=args.steps)
        results[name] = {"losses": first[0] + second[0], "params": second[1], "built": first[2]}
        if torch.distributed.get_rank() == 0:
            print(f"{name:>10}  built {first[2]:<24} losses {' '.join(f'{x:.4f}' for x in first[0] + second[0])}")
    if args.out and torch.distributed.get_rank() == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
