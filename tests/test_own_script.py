"""A training script written for torch's DDP (``docs/examples/train_like_torch_ddp.py``: torchrun, a
small transformer, accumulation through ``require_backward_grad_sync``, clipping, AdamW, a checkpoint
saved and resumed) trains the same with each of ddpkit's wrappers swapped in as with torch's own:
the DDP family against ``DistributedDataParallel``, ZeRO-1/2 against ``ZeroRedundancyOptimizer``,
FSDP against ``fully_shard``, as ``docs/own_script.md`` documents the swaps."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import ddpkit
from ddpkit.experiment import max_abs_diff
from test_torchrun import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(ddpkit.__file__)))
SCRIPT = os.path.join(REPO, "docs", "examples", "train_like_torch_ddp.py")
# each of ours beside the torch wrapper it stands in for
SWAPS = {"naive": "torch_ddp", "bucketed": "torch_ddp", "overlapped": "torch_ddp",
         "zero1": "torch_zero", "zero2": "torch_zero", "fsdp": "torch_fsdp"}
WRAPPERS = ",".join(sorted(set(SWAPS) | set(SWAPS.values())))

# AdamW divides by the root of its second moment, so the order in which ranks' gradients are summed
# (per tensor, per bucket, per shard) shows in the parameters at about lr/100 after a few steps: torch's
# own fully_shard and DDP differ from each other by that much at 4 ranks. A missed average shows at lr.
PARAM_TOL = 1e-4

pytestmark = pytest.mark.slow


def run_script(world_size: int, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world_size),
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), SCRIPT,
                           "--wrapper", WRAPPERS, *args],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=400)
    assert done.returncode == 0, done.stdout[-4000:]
    return done.stdout


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_wrapper_swapped_into_a_torch_ddp_script_trains_as_torchs(tmp_path, world_size):
    ckpt, first, second = tmp_path / "ckpt", tmp_path / "first.pt", tmp_path / "second.pt"
    record = ["--record", str(tmp_path / "rec")] if world_size == 2 else []  # ddpkit.record, drawn below
    run_script(world_size, "--steps", "3", "--save", str(ckpt), "--out", str(first), *record)
    run_script(world_size, "--steps", "2", "--resume", str(ckpt), "--out", str(second))
    for out in (torch.load(first), torch.load(second)):
        for ours, theirs in SWAPS.items():
            assert out[ours]["losses"] == pytest.approx(out[theirs]["losses"], abs=1e-5), (ours, theirs)
            assert max_abs_diff(out[ours]["params"], out[theirs]["params"]) < PARAM_TOL, (ours, theirs)
        # and torch's three agree with each other: the script is one training run, whatever wraps it
        for theirs in ("torch_zero", "torch_fsdp"):
            assert max_abs_diff(out[theirs]["params"], out["torch_ddp"]["params"]) < PARAM_TOL
    # the resumed run went on from the checkpoint: its first loss is not the first run's first
    assert torch.load(second)["torch_ddp"]["losses"][0] != torch.load(first)["torch_ddp"]["losses"][0]
    if record:
        check_the_recording(tmp_path / "rec", world_size)


def check_the_recording(folder, world_size: int) -> None:
    """Each wrapper's ``ddpkit.record`` of the script: every step holds the loop's compute (timed by
    the wrapper: the script's loop times nothing), the gradients' readiness and the collectives
    (seen by ddpkit's process group); ``python -m ddpkit draw`` turns it into the pictures."""
    from ddpkit.torchrun import load

    for wrapper, collective in (("overlapped", "all_reduce"), ("fsdp", "reduce_scatter")):
        trace = load(str(folder / wrapper))
        assert trace.ranks == list(range(world_size))
        assert len(trace.steps) == 3 * 2  # 3 optimizer steps of 2 micro-batches: a step per forward
        for rank in trace.ranks:
            for step in trace.steps:
                names = {r.name for r in trace.select(rank=rank, step=step, cat="compute")}
                assert {"forward", "backward"} <= names, (wrapper, rank, step, names)
            synced = [s for s in trace.steps if trace.select(rank=rank, step=s, cat="comm", name=collective)]
            assert synced == trace.steps[1::2], (wrapper, synced)  # the last micro-batch of each step
        if wrapper == "overlapped":
            assert trace.select(rank=0, cat="grad_ready")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "ddpkit", "draw", str(folder / "overlapped")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for name in ("trace.json", "timeline.png", "bucket_fill.png"):
        assert (folder / "overlapped" / name).stat().st_size > 1000 and name in done.stdout


def test_draw_without_a_recording_is_a_clear_error(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ddpkit", "draw", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "no rank*.records files" in done.stderr and "ddpkit.record" in done.stderr
