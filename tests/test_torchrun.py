"""ddpkit.train under torchrun: two "nodes" (two torchrun launchers, one process each) on
loopback give the same parameters as one process; hybrid sharding lays the ranks out in
torchrun's nodes; a checkpoint resumed equals a straight run."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

import ddpkit
from ddpkit.experiment import max_abs_diff, train_single_process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(ddpkit.__file__)))
MODEL = ["--model", "mlp", "--width", "16", "--depth", "3", "--global-batch-size", "8", "--backend", "gloo"]

pytestmark = pytest.mark.slow


def free_port() -> int:
    # The OS picks a free port; torchrun's rendezvous binds it a moment later (a small race,
    # but no fixed port shared by concurrent test runs).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(launcher_args: list[str], train_args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *launcher_args,
                             "-m", "ddpkit.train", *train_args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)


def finish(procs, timeout=240) -> list[str]:
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-4000:]
    return outs


@pytest.mark.parametrize("strategy", ["overlapped", "fsdp", "hsdp"])
def test_two_nodes_on_loopback_equal_one_process(tmp_path, strategy):
    port = free_port()
    save = tmp_path / "final.pt"
    steps = 4
    procs = [torchrun(["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                       "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "ddpkit-test"],
                      ["--strategy", strategy, "--steps", str(steps), "--save", str(save), *MODEL])
             for node in (0, 1)]
    outs = finish(procs)
    combined = "\n".join(outs)
    assert "final checksum" in combined and "step    3" in combined
    # the layout is torchrun's (LOCAL_WORLD_SIZE=1 on each node), not the default nodes of 2:
    # hsdp shards inside a node of 1 rank and replicates across the 2 nodes
    assert f"2 ranks (gloo) as 2 nodes x 1: {strategy}" in combined
    ref = train_single_process("mlp", "sgd", steps=steps, global_batch_size=8, width=16, depth=3)
    assert max_abs_diff(torch.load(save), ref) < 1e-5


@pytest.mark.parametrize("strategy", ["overlapped", "zero1", "fsdp"])  # replicated, sharded state
def test_checkpoint_k_then_resume_m_equals_k_plus_m(tmp_path, strategy):
    ckpt, save = tmp_path / "ckpt", tmp_path / "final.pt"
    launcher = lambda: ["--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",  # noqa: E731
                        "--master-port", str(free_port())]
    common = ["--strategy", strategy, "--optimizer", "adamw", *MODEL]
    # 3 steps, checkpoint every 2 (and at the end: step 3); then resume from step 3 to 5
    finish([torchrun(launcher(), [*common, "--steps", "3", "--checkpoint", str(ckpt), "--save-every", "2"])])
    outs = finish([torchrun(launcher(), [*common, "--steps", "5", "--resume", str(ckpt), "--save", str(save)])])
    assert "step    3" in outs[0] and "step    0" not in outs[0]  # continued, did not restart
    ref = train_single_process("mlp", "adamw", steps=5, global_batch_size=8, width=16, depth=3)
    assert max_abs_diff(torch.load(save), ref) < 1e-5
