"""A PyTorch Lightning training, with ddpkit's DDP wrappers where Lightning's DDPStrategy builds torch's
(``docs/own_script.md``, "In the frameworks").

    torchrun --nproc-per-node 2 docs/examples/train_with_lightning.py --wrapper overlapped
    torchrun --nproc-per-node 2 docs/examples/train_with_lightning.py --wrapper torch_ddp,naive,bucketed,overlapped

What it does, as Lightning's examples do: a LightningModule around a small LayerNorm MLP, AdamW,
``Trainer(strategy="ddp", accumulate_grad_batches=2, gradient_clip_val=1.0)``; after ``--steps`` steps
``trainer.save_checkpoint``, then a fresh module resumes it (``fit(..., ckpt_path=)``) for ``--more``.
Each wrapper trains so, then again with manual optimization (``manual_backward``, ``clip_gradients``,
``DDPStrategy(static_graph=True)``: the path on which Lightning calls the DDP reducer itself; its results
are ``<wrapper>-manual``). The one ddpkit line is ``with ddpkit.frameworks.use(...)`` around it;
``torch_ddp`` leaves it out (torch's own).

``--wrapper`` may list several: each trains in turn from the same start (a name is one of ``WRAPPERS`` or
``package.module:Class``). ``--out FILE`` (rank 0) writes each one's losses and final parameters;
``--record DIR`` records each into ``DIR/<wrapper>`` for ``python -m ddpkit draw DIR/<wrapper>``. Without
torchrun, ``python docs/examples/train_with_lightning.py`` lets Lightning start the 2 ranks (no --record).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:  # the unified package's name, or the standalone one's: the same classes
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl

import ddpkit

WRAPPERS = {"torch_ddp": None, "naive": ddpkit.NaiveDDP, "bucketed": ddpkit.BucketedDDP,
            "overlapped": ddpkit.OverlappedDDP}
ACCUM = 2  # micro-batches per optimizer step


class Regression(pl.LightningModule):
    def __init__(self, seed: int, manual: bool = False):
        super().__init__()
        torch.manual_seed(seed)  # ranks may start apart: every wrapper broadcasts rank 0's parameters
        self.net = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64),
                                 nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 4))
        self.automatic_optimization = not manual
        self.losses, self.built = [], None

    def on_train_start(self):
        self.built = type(self.trainer.strategy.model).__name__  # the DDP wrapper the strategy built

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        if self.automatic_optimization:
            return loss
        self.manual_backward(loss / ACCUM)  # synchronised on every micro-batch, summed in .grad
        if (batch_idx + 1) % ACCUM == 0:
            opt = self.optimizers()
            self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=g)
    return DataLoader(TensorDataset(x, x[:, :4].sin() + 0.1 * torch.randn(256, 4, generator=g)), batch_size=4)


def train(steps: int, checkpoint: str, manual: bool, devices: int, resume: bool = False):
    """Fit ``steps`` optimizer steps and save ``checkpoint``; or, with ``resume``, fit on from it to
    ``steps`` in all. (losses, parameters, the wrapper's class)."""
    module = Regression(seed=int(os.environ.get("RANK", 0)) + (100 if resume else 0), manual=manual)
    automatic = {} if manual else dict(accumulate_grad_batches=ACCUM, gradient_clip_val=1.0)
    strategy = pl.strategies.DDPStrategy(static_graph=True) if manual else "ddp"
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, **automatic)
    trainer.fit(module, data(), ckpt_path=checkpoint if resume else None)
    if not resume:
        trainer.save_checkpoint(checkpoint)
    params = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
    return module.losses, params, module.built


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
    p.add_argument("--optimization", default="automatic,manual",
                   help="automatic, manual (with static_graph=True) or both: each wrapper trains each way")
    p.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 2)))
    p.add_argument("--checkpoint", default="checkpoints", metavar="DIR", help="save into DIR/<wrapper>.ckpt")
    p.add_argument("--bucket-cap-mb", type=float, help="ddpkit's bucketed wrappers: the cap (default torch's)")
    p.add_argument("--out", metavar="FILE", help="rank 0: every wrapper's losses and final parameters")
    p.add_argument("--record", metavar="DIR", help="record the run into DIR/<wrapper> (python -m ddpkit draw DIR/...)")
    args = p.parse_args()
    if args.record:  # ddpkit's process group under Lightning's (which finds it initialized): ddpkit.record
        ddpkit.init_process_group("gloo")  # sees every collective. Needs torchrun's environment
    results = {}
    for name, manual in [(n, m == "manual") for n in args.wrapper.split(",") for m in args.optimization.split(",")]:
        cls, key = wrapper_class(name), f"{name}-manual" if manual else name
        record = ddpkit.record(os.path.join(args.record, key)) if args.record else contextlib.nullcontext()
        checkpoint = os.path.join(args.checkpoint, f"{key}.ckpt")
        options = {"bucket_cap_mb": args.bucket_cap_mb} if args.bucket_cap_mb is not None else {}
        with ddpkit.frameworks.use(cls, **options) if cls else contextlib.nullcontext():  # torch_ddp: torch's
            with record:
                first = train(args.steps, checkpoint, manual, args.devices)
            second = train(args.steps + args.more, checkpoint, manual, args.devices, resume=True)
        results[key] = {"losses": first[0] + second[0], "params": second[1], "built": first[2]}
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"{key:>17}  built {first[2]:<24} losses {' '.join(f'{x:.4f}' for x in first[0] + second[0])}")
    if args.out and int(os.environ.get("RANK", 0)) == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
