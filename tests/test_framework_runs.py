"""accelerate and Lightning training with ddpkit's DDP wrappers put in by ``ddpkit.frameworks.use``: the
command lines of ``docs/own_script.md`` ("In the frameworks"), run as written under torchrun at 2 ranks,
train as torch's DDP does (losses and parameters, before and after the framework's checkpoint is resumed),
and Lightning's ``fit`` ends clean. A wrapper that does not average (``unaveraged.py``) is added to each
run: it must fail the same comparison. One Lightning run is recorded and drawn."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest
import torch

import ddpkit
from ddpkit.experiment import max_abs_diff
from test_torchrun import free_port

pytest.importorskip("accelerate")
pytest.importorskip("pytorch_lightning")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(ddpkit.__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))
CONTROL = "unaveraged:Unaveraged"
PARAM_TOL = 1e-4  # test_own_script.py's: the order of the ranks' sums shows at lr/100 under AdamW
pytestmark = pytest.mark.slow


def page_commands() -> list[str]:
    """The lines of the page section's first ```bash block (the examples), as a reader pastes them."""
    section = open(os.path.join(REPO, "docs", "own_script.md")).read().split("## In the frameworks", 1)[1]
    return section.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()


def run(line: str, tmp_path, *extra: str, control: bool = True) -> str:
    """``line`` under torchrun at a free port in ``tmp_path``, with the control added to its wrappers."""
    words = shlex.split(line)
    assert words[:3] == ["torchrun", "--nproc-per-node", "2"], line
    words = [os.path.join(REPO, w) if w.startswith("docs/") else w for w in words[3:]]
    if control:
        words[words.index("--wrapper") + 1] += "," + CONTROL
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([REPO, TESTS, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                           "127.0.0.1", "--master-port", str(free_port()), *words, *extra],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
                          timeout=400)
    assert done.returncode == 0, done.stdout[-4000:]  # Lightning: fit and its teardown ended clean
    return done.stdout


def check_each_wrapper_trains_as_torchs(out: dict, suffix: str = "") -> None:
    """``out``: the example's results; ``suffix``: "" (automatic optimization) or "-manual"."""
    theirs = out["torch_ddp" + suffix]
    assert theirs["built"] == "DistributedDataParallel"
    for name, built in {"naive": "NaiveDDP", "bucketed": "BucketedDDP", "overlapped": "OverlappedDDP"}.items():
        ours = out[name + suffix]
        assert ours["built"] == built  # ours, not torch's, trained
        assert ours["losses"] == pytest.approx(theirs["losses"], abs=1e-5), name
        assert max_abs_diff(ours["params"], theirs["params"]) < PARAM_TOL, name
        assert not any(k.startswith("module.") for k in ours["params"])  # the framework unwrapped ours
    control = out[CONTROL + suffix]
    assert control["built"] == "Unaveraged"
    assert max_abs_diff(control["params"], theirs["params"]) > 100 * PARAM_TOL  # the comparison can fail
    # the second half of the losses came after the resume, from the checkpoint: not a fresh start
    assert len(theirs["losses"]) == 2 * (3 + 2) and theirs["losses"][6] != theirs["losses"][0]


def test_accelerate_trains_each_wrapper_as_torchs_ddp(tmp_path):
    [line] = [c for c in page_commands() if "train_with_accelerate.py" in c]
    run(line, tmp_path, "--out", "out.pt")
    check_each_wrapper_trains_as_torchs(torch.load(tmp_path / "out.pt"))


def test_lightning_trains_each_wrapper_as_torchs_ddp_and_its_run_is_drawn(tmp_path):
    """One launch (Lightning's import is most of its time): automatic and manual optimization, each
    wrapper recorded; then the page's ``draw`` line on one recording."""
    from ddpkit.torchrun import draw, load

    [line] = [c for c in page_commands() if "train_with_lightning.py" in c]
    run(line, tmp_path, "--out", "out.pt", "--record", "rec")
    out = torch.load(tmp_path / "out.pt")
    check_each_wrapper_trains_as_torchs(out)
    check_each_wrapper_trains_as_torchs(out, "-manual")  # Lightning calls the reducer, reads the flags

    trace = load(str(tmp_path / "rec" / "overlapped"))
    assert trace.ranks == [0, 1] and trace.steps == list(range(3 * 2))  # a step per micro-batch
    for rank in trace.ranks:  # the buckets' all-reduces in the micro-batch that ends each step
        synced = [s for s in trace.steps if trace.select(rank=rank, step=s, cat="comm", name="all_reduce")]
        assert synced == [1, 3, 5], synced
        assert trace.select(rank=rank, step=3, cat="grad_ready")
    section = open(os.path.join(REPO, "docs", "own_script.md")).read().split("### Seeing a framework's run", 1)[1]
    record, draw_line = section.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert "train_with_lightning.py --wrapper overlapped" in record and "--record run" in record
    words = shlex.split(draw_line)
    assert words[:4] == ["python", "-m", "ddpkit", "draw"] and words[4] == "run/overlapped", draw_line
    pictures = draw(str(tmp_path / "rec" / "overlapped"), step=int(words[words.index("--step") + 1]))
    assert all(os.path.getsize(path) > 1000 for path in pictures.values())
