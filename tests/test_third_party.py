"""Real third-party models (``hf_models.py``: Hugging Face GPT-2 with tied embeddings, ResNet with
BatchNorm; tiny configs, nothing downloaded) through every strategy of the table, ``compare`` and
the command line, as an engineer would bring their own model.

GPT-2 equals one process. The ResNet equals torch's DDP at the same world size: BatchNorm
normalises by each rank's own slice of the batch (as torch's DDP does, by design), so no
data-parallel run equals one process there; its running statistics are buffers, which no strategy
but torch's DDP broadcasts each step, so parameters are compared, not buffers.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

import ddpkit  # noqa: E402
from ddpkit.experiment import max_abs_diff, run_strategy, train_batch, train_single_process, wrap  # noqa: E402
from ddpkit.strategies.table import NAMES, STRATEGIES  # noqa: E402
from hf_models import gpt2_tiny, resnet_tiny  # noqa: E402
from helpers import SMALL_CAP, TOL, ranks  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(ddpkit.__file__)))
STEPS, BATCH, MAX_NORM = 2, 8, 0.5
WORKLOADS = {"gpt2": gpt2_tiny, "resnet": resnet_tiny}


def _every_strategy(workload, names):
    """On every rank: each strategy in turn (built with seed=rank, so the broadcast matters), trained
    STEPS steps with clipping, through the public wrappers; {name: full parameters}. One job for all
    of them: a rank imports transformers once."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in names:
        module = workload.build(seed=rank)
        model, opt = wrap(name, module, "sgd", bucket_cap_mb=SMALL_CAP)  # several buckets
        for step in range(STEPS):
            train_batch(model, opt, workload.local_batch(step, BATCH, rank, world), workload.compute_loss,
                        max_norm=MAX_NORM)
        out[name] = {k: v.detach().cpu() for k, v in model.full_state_dict().items()}
    return out


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)], ids=ranks)
@pytest.mark.parametrize("model", WORKLOADS)
def test_every_strategy_trains_a_real_model_as_the_reference(cluster_of, model, n):
    workload = WORKLOADS[model]()
    names = [s for s in NAMES if STRATEGIES[s].fits(n)]
    per_rank = cluster_of(n).run(_every_strategy, workload, names)
    if model == "resnet":  # BatchNorm: the reference is torch's DDP at this world size (see above)
        reference = per_rank[0]["torch_ddp"]
    else:
        reference = train_single_process(workload, "sgd", steps=STEPS, global_batch_size=BATCH, max_norm=MAX_NORM)
    off = {name: max(max_abs_diff(states[name], reference) for states in per_rank) for name in names}
    assert all(diff < TOL for diff in off.values()), {k: f"{v:.1e}" for k, v in off.items() if v >= TOL}
    if model == "resnet":  # ... and none equals one process, which sees the whole batch's statistics
        alone = train_single_process(workload, "sgd", steps=STEPS, global_batch_size=BATCH, max_norm=MAX_NORM)
        assert max_abs_diff(reference, alone) > 1e-4


def test_fsdp_units_of_gpt2_are_its_blocks_by_default_or_by_class():
    """The default for a model FSDP never saw: the blocks of its largest ModuleList (GPT-2's
    ``transformer.h``), not its children ``[transformer, lm_head]``; ``units={GPT2Block}`` names the
    same; ``{GPT2Model}`` is one unit holding everything but the tied embedding (the root keeps it:
    ``lm_head`` outside the unit uses it too)."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block, GPT2Model

    from ddpkit.strategies.flat_param import plan_units
    from ddpkit.strategies.table import fsdp_units

    module = gpt2_tiny().build()
    blocks = list(module.transformer.h)
    assert fsdp_units(module) == blocks == fsdp_units(module, {GPT2Block})
    assert [u.name for u in plan_units(module).units] == [f"transformer.h.{i}" for i in range(4)] + [""]
    coarse = plan_units(module, {GPT2Model})
    assert [u.name for u in coarse.units] == ["transformer", ""]


def _peak_gathered(units):
    """On every rank: one recorded fsdp run of GPT-2 with ``units``; the most bytes of gathered
    (unsharded) parameters it held at once, and its model state."""
    out = run_strategy("fsdp", gpt2_tiny(), steps=1, warmup=1, global_batch_size=BATCH, record=True,
                       return_records=True, options={} if units is None else {"units": units},
                       report_progress=False)
    peak = max(r.args.get("unsharded_parameters", 0) for r in out.records if r.kind == "counter")
    return peak, out.model_state_bytes


def test_fsdp_by_blocks_gathers_less_than_one_unit_for_the_whole_model(cluster_of):
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block, GPT2Model

    cluster = cluster_of(2)
    default, by_class, whole = (cluster.run(_peak_gathered, u)[0] for u in (None, {GPT2Block}, {GPT2Model}))
    assert default == by_class  # the default is the blocks
    params = 4 * sum(p.numel() for p in gpt2_tiny().build().parameters())
    assert whole[0] >= params > default[0]  # the whole model gathered at once, against a block and the root
    assert whole[1] == pytest.approx(default[1], rel=0.05)  # the state per rank is 1/N either way


def test_compare_runs_a_workload_with_bytes_state_and_diffs(cluster_of):
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from ddpkit.compare import compare, format_table

    runs = {"bucketed": ("bucketed", {}), "fsdp": ("fsdp", {}), "fsdp by block": ("fsdp", {"units": {GPT2Block}}),
            "torch_fsdp": ("torch_fsdp", {})}
    records = compare(cluster_of(2), runs, workload=gpt2_tiny(), steps=1, rounds=1, global_batch_size=BATCH,
                      record_steps=1)
    assert [r["strategy"] for r in records] == list(runs)
    for r in records:
        assert "error" not in r, r
        assert r["model"] == "gpt2-tiny" and r["max_param_diff"] < TOL
        assert r["comm_bytes_per_step"] > 0 and r["model_state_bytes"] > 0 and len(r["memory"]) == 2
    by = {r["strategy"]: r for r in records}
    assert by["fsdp"]["model_state_bytes"] < by["bucketed"]["model_state_bytes"]  # sharded: about half
    assert by["fsdp"]["comm_bytes_per_step"] == pytest.approx(1.5 * by["bucketed"]["comm_bytes_per_step"], rel=0.05)
    assert by["fsdp by block"]["name"] == "fsdp" and by["fsdp by block"]["torch_reference"] == "torch_fsdp"
    assert by["fsdp by block"]["comm_bytes_per_step"] == by["fsdp"]["comm_bytes_per_step"]  # the same units
    table = format_table(records)
    assert "fsdp by block" in table
    heads = format_table([dict(records[0], model="mlp")]).splitlines()[0].split()
    assert table.splitlines()[0].split() == heads  # the built-ins' columns


def _cli(*argv, timeout=240):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "ddpkit", *argv], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=timeout)


@pytest.mark.slow
def test_the_command_line_compares_and_traces_a_workload_by_its_function(tmp_path):
    out = tmp_path / "records.json"
    done = _cli("compare", "--model", "tests.hf_models:gpt2_tiny", "--strategies", "zero2,fsdp", "--steps", "1",
                "--rounds", "1", "--global-batch-size", "8", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "model gpt2-tiny" in done.stdout and "zero2" in done.stdout
    import json

    records = json.loads(out.read_text())
    assert all(r["model"] == "gpt2-tiny" and r["max_param_diff"] < TOL for r in records)
    trace = tmp_path / "trace.json"
    done = _cli("trace", "--model", "tests.hf_models:resnet_tiny", "--strategy", "fsdp", "--steps", "1",
                "--global-batch-size", "8", "--out", str(trace))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(trace.read_text())["traceEvents"]


@pytest.mark.slow
def test_torchrun_trains_a_workload_by_its_function_on_ddpkits_process_group(tmp_path):
    import re

    import torch

    from test_torchrun import finish, free_port, torchrun

    save = tmp_path / "final.pt"
    launcher = ["--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(free_port())]
    (out,) = finish([torchrun(launcher, ["--strategy", "fsdp", "--model", "tests.hf_models:gpt2_tiny", "--steps", "2",
                                         "--global-batch-size", str(BATCH), "--backend", "gloo", "--save", str(save)])])
    reference = train_single_process(gpt2_tiny(), "sgd", steps=2, global_batch_size=BATCH)
    assert max_abs_diff(torch.load(save), reference) < TOL
    sent = float(re.search(r"rank 0 sent ([0-9.]+) (?:B|KiB|MiB|GiB) through ddpkit's process group", out).group(1))
    assert sent > 0  # counted: the collectives ran through ddpkit's process group, not a plain gloo one
