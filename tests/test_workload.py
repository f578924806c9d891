"""``ddpkit.Workload``: a model, its batches and its loss, as the instruments take them; a
hand-written loop under ``cluster.recording()`` gets numbered steps and live frames; FSDP units by
module class. (Real third-party models: ``test_third_party.py``; clipping: ``test_equivalence.py``.)"""
from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.experiment import local_batch, max_abs_diff, run_strategy, train_single_process
from ddpkit.models import TinyGPT, build_model, make_batch
from ddpkit.strategies.table import NAMES
from ddpkit.workload import Workload, load, named, resolve, shard_batch
from helpers import SMALL_GPT, SMALL_MLP, TOL


# ----------------------------------------------------------------------------- batches
def test_a_batch_of_any_structure_is_sliced_on_dim_0():
    x, y = torch.arange(24).view(12, 2), torch.arange(12)
    nested = {"ids": x, "more": [y, (y * 2,)]}
    part = shard_batch(nested, 1, 3)
    assert torch.equal(part["ids"], x[4:8]) and torch.equal(part["more"][0], y[4:8])
    assert isinstance(part["more"][1], tuple) and torch.equal(part["more"][1][0], y[4:8] * 2)
    assert torch.equal(shard_batch(x, 2, 3), x[8:])
    with pytest.raises(ValueError, match="a global batch of 12 does not split evenly over 5 ranks"):
        shard_batch(nested, 0, 5)
    with pytest.raises(ValueError, match="must share dim 0"):
        shard_batch((x, y[:6]), 0, 2)


def _workload(batch, loss=lambda model, b: model(b).sum() * 0):
    return Workload(model=lambda: nn.Linear(2, 2), batch=batch, loss=loss, name="toy")


def test_a_batch_that_is_not_tensors_or_not_the_size_asked_is_a_clear_error():
    with pytest.raises(TypeError, match=r"workload 'toy': batch\['mask'\] is a str, not a tensor"):
        _workload(lambda step, size: {"x": torch.zeros(size, 2), "mask": "all"}).local_batch(0, 4, 0, 2)
    with pytest.raises(ValueError, match=r"batch\(0, 4\)\[1\] has 3 samples on dim 0; it must hold the 4"):
        _workload(lambda step, size: (torch.zeros(size, 2), torch.zeros(3))).global_batch(0, 4)
    with pytest.raises(ValueError, match="a global batch of 6 does not split evenly over 4 ranks"):
        _workload(lambda step, size: torch.zeros(size, 2)).local_batch(0, 6, 0, 4)
    wl = _workload(lambda step, size: torch.zeros(size, 2), loss=lambda model, b: model(b))
    with pytest.raises(TypeError, match=r"loss\(\) returned a tensor of shape \[4, 2\]; it must be a scalar"):
        wl.compute_loss(wl.build(), wl.global_batch(0, 4))
    with pytest.raises(TypeError, match=r"model= must build the model \(e.g. lambda: Linear\(...\)\), not be one"):
        Workload(model=nn.Linear(2, 2), batch=lambda s, n: None, loss=lambda m, b: None)
    with pytest.raises(TypeError, match="loss= must be callable, got str"):
        Workload(model=lambda: nn.Linear(2, 2), batch=lambda s, n: None, loss="mse")
    with pytest.raises(TypeError, match=r"model\(\) returned a int, not an nn.Module"):
        Workload(model=lambda: 3, batch=lambda s, n: None, loss=lambda m, b: None).build()


def test_the_builtins_are_workloads_of_the_course_models_and_data():
    wl = Workload.builtin("mlp", **SMALL_MLP)
    assert wl.name == "mlp" and wl.config == SMALL_MLP
    module = wl.build(seed=3)
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), build_model("mlp", seed=3, **SMALL_MLP)
                                                  .parameters(), strict=True))
    for rank in range(2):
        mine, theirs = wl.local_batch(5, 8, rank, 2), local_batch(module, 8, 5, rank, 2)
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    gpt = Workload.builtin("gpt", **SMALL_GPT)
    assert torch.equal(gpt.global_batch(1, 4)[0], make_batch(TinyGPT(**SMALL_GPT), 4, 1)[0])
    # the reference by name and by workload are one and the same
    by_name = train_single_process("gpt", steps=2, global_batch_size=4, **SMALL_GPT)
    assert max_abs_diff(by_name, train_single_process(gpt, steps=2, global_batch_size=4)) == 0
    with pytest.raises(ValueError, match="unknown model 'resnet'"):
        Workload.builtin("resnet")
    with pytest.raises(TypeError, match="model 'mlp': got an unexpected keyword argument 'dim'"):
        Workload.builtin("mlp", dim=3)


def test_a_workload_by_name_or_function_and_what_is_refused():
    assert resolve().name == "mlp" and resolve(model="gpt").name == "gpt"
    assert resolve("mlp", model_kwargs=SMALL_MLP).config == SMALL_MLP
    assert load("hf_models:gpt2_tiny").name == "gpt2-tiny"
    assert named("gpt", width=16, depth=1).config == {"dim": 16, "layers": 1}
    with pytest.raises(ValueError, match=r"cannot import 'no_such_module' \(ModuleNotFoundError"):
        load("no_such_module:f")
    with pytest.raises(ValueError, match="hf_models has no function 'nope'"):
        load("hf_models:nope")
    with pytest.raises(ValueError, match=r"not_a_workload\(\) returned a dict, not a ddpkit.Workload"):
        load("hf_models:not_a_workload")
    with pytest.raises(ValueError, match="--width/--depth size the built-in models"):
        named("hf_models:gpt2_tiny", width=8)
    with pytest.raises(ValueError, match="model_kwargs .* size a built-in model"):
        resolve(Workload.builtin("mlp"), model_kwargs={"width": 3})
    with pytest.raises(TypeError, match="give workload= or model=, not both"):
        resolve("mlp", model="gpt")


def _toy_workload():
    """A model the kit has never seen: a dict batch, a loss of the engineer's own."""
    def batch(step, size):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(size, 6, generator=g)
        return {"x": x, "y": x.sum(dim=1, keepdim=True)}

    def loss(model, b):
        return nn.functional.mse_loss(model(b["x"]), b["y"])

    return Workload(model=lambda: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)),
                    batch=batch, loss=loss, name="toy")


@pytest.mark.parametrize("strategy", ["zero2", "fsdp", "torch_fsdp"])
def test_run_strategy_trains_a_notebook_workload_as_one_process(cluster_of, strategy):
    wl = _toy_workload()  # lambdas and closures: shipped to the ranks by value
    ref = train_single_process(wl, steps=3, global_batch_size=8)
    results = cluster_of(2).run(run_strategy, strategy, wl, steps=2, warmup=1, global_batch_size=8,
                                record=True, reference=ref, report_progress=False)
    assert all(r.model == "toy" and r.max_param_diff < TOL for r in results)
    assert results[0].comm_bytes_per_step > 0


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Labelled:
    x: torch.Tensor
    y: torch.Tensor


class Net(nn.Module):
    """Takes the whole batch object: the wrapper's forward (and torch's) sees the structure."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 1)

    def forward(self, batch):
        return self.b(torch.tanh(self.a(batch.x)))


def _structured_workload(kind):
    def batch(step, size):
        g = torch.Generator().manual_seed(step)
        return kind(torch.randn(size, 6, generator=g), torch.randn(size, 1, generator=g))

    return Workload(model=Net, batch=batch, loss=lambda model, b: nn.functional.mse_loss(model(b), b.y),
                    name=kind.__name__)


def _every_strategy_on(workloads):
    """On every rank: each strategy of the table trains each workload 3 steps; its full parameters."""
    import torch.distributed as dist

    from ddpkit.experiment import wrap
    from ddpkit.step import train_batch
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for wl in workloads:
        for name in NAMES:
            model, opt = wrap(name, wl.build())
            for step in range(3):
                train_batch(model, opt, wl.local_batch(step, 8, rank, world), wl.compute_loss)
            out[wl.name, name] = {k: v.detach().cpu() for k, v in model.full_state_dict().items()}
    return out


def test_named_tuple_and_dataclass_batches_train_as_one_process_under_every_strategy(cluster_of):
    # one tree walker, torch's pytree: the namedtuple failed to rebuild ("missing 'y'") and the
    # dataclass was no batch at all ("is a Labelled, not a tensor") in the kit's own walker
    workloads = [_structured_workload(Pair), _structured_workload(Labelled)]
    part = workloads[1].local_batch(0, 8, 1, 2)
    assert isinstance(part, Labelled) and part.x.shape == (4, 6)
    assert torch.equal(part.y, workloads[1].global_batch(0, 8).y[4:])
    out = cluster_of(2).run(_every_strategy_on, workloads)[0]
    for wl in workloads:
        ref = train_single_process(wl, steps=3, global_batch_size=8)
        for name in NAMES:
            assert max_abs_diff(out[wl.name, name], ref) < TOL, (wl.name, name)


def test_fsdp_mixed_precision_casts_named_tuples_and_dataclasses_in_place():
    from ddpkit.strategies.flat_param import cast_floats

    ids = torch.arange(4)
    pair, labelled = cast_floats(Pair(torch.ones(2), ids), torch.bfloat16), cast_floats(
        Labelled(torch.ones(2), ids), torch.bfloat16)
    assert isinstance(pair, Pair) and pair.x.dtype == torch.bfloat16 and pair.y is ids
    assert isinstance(labelled, Labelled) and labelled.x.dtype == torch.bfloat16 and labelled.y is ids


def test_dropout_is_found_where_it_drops_out():
    from ddpkit.experiment import active_dropout

    net = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Dropout(0.0), nn.Linear(4, 4))
    assert active_dropout(net) == ["1 (p=0.5)"]
    assert active_dropout(net.eval()) == []  # evaluation drops nothing
    attention = nn.Module()
    attention.attention_dropout = 0.1  # Hugging Face's attention: a float handed to a function, no module
    assert active_dropout(attention) == ["attention_dropout (p=0.1)"]
    attention.attention_dropout = 0.0
    assert active_dropout(attention) == [] and active_dropout(build_model("mlp")) == []


def test_compare_says_that_dropout_makes_a_run_differ_from_one_process_by_design(cluster_of):
    from ddpkit.compare import compare, format_table

    toy = _toy_workload()
    wl = Workload(model=lambda: nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 1)),
                  batch=toy.batch, loss=toy.loss, name="toy-dropout")
    (r,) = compare(cluster_of(2), ["bucketed"], workload=wl, steps=1, rounds=1, global_batch_size=8, record_steps=1)
    assert r["dropout"] == ["1 (p=0.5)"] and r["max_param_diff"] > TOL  # other masks on 2 ranks than in one
    table = " ".join(format_table([r]).split())  # its notes are wrapped
    assert f"{r['max_param_diff']:.1e} (dropout)" in table
    assert "dropout is on: masks differ from one process by design; set dropout to 0 to compare" in table
    assert "dropout" not in format_table([dict(r, dropout=[])])  # a model without: a plain difference


def test_memory_counts_a_workloads_parameters_for_the_zero_formulas():
    from ddpkit.memory_formulas import parameter_count, predicted_model_state

    gpt = Workload.builtin("gpt", **SMALL_GPT)
    psi = parameter_count(gpt)
    assert psi == parameter_count(gpt.build()) == sum(p.numel() for p in TinyGPT(**SMALL_GPT).parameters())
    assert predicted_model_state("fsdp", psi, 2)["total"] == 16 * psi / 2  # fp32 Adam, ZeRO-3


def test_the_cost_model_profiles_a_workloads_layers():
    from ddpkit import costmodel

    profile = costmodel.profile_job(_toy_workload(), batch_per_rank=8, repeats=1)
    assert [layer.name for layer in profile.layers] == ["0", "2"]
    assert profile.param_bytes == 4 * (6 * 8 + 8 + 8 + 1)
    assert costmodel.model_calibration_sizes(_toy_workload())[0] == 1024
    (pred,) = costmodel.predict(profile, ["fsdp"], [2], "10GbE")
    assert pred.ms_per_step > 0


# ----------------------------------------------------------------------------- steps in any loop
def test_a_wrappers_forward_begins_a_step_unless_the_loop_began_one():
    from ddpkit.trace import Recorder

    rec = Recorder(rank=0, world_size=1)
    assert rec.step is None
    assert [rec.begin_forward() for _ in range(3)] == [0, 1, 2]   # a hand-written loop: one per forward
    rec.next_step()                                                 # by hand, then a forward: the same step
    assert rec.begin_forward() == 3 and rec.begin_forward() == 4
    assert rec.begin_step() == 5 and rec.begin_forward() == 5       # train_step, then its forward
    assert rec.begin_step() == 6                                    # a wrapper that marks nothing
    rec.next_step()
    assert rec.begin_step() == 7 and rec.begin_forward() == 7       # next_step + train_step + forward
    assert rec.begin_forward() == 8


def _my_loop(wrapper, steps=40, sleep=0.04):
    """An engineer's loop: no train_step, no next_step, clipping, a dict batch."""
    import torch.distributed as dist

    from ddpkit.strategies.reference import TorchDDP

    wl = _toy_workload()
    wrap = {"OverlappedDDP": lambda m: ddpkit.OverlappedDDP(m, bucket_cap_mb=0),  # a bucket per parameter
            "FSDP": lambda m: ddpkit.FSDP(m, units={nn.Linear}), "TorchDDP": TorchDDP}[wrapper]
    model = wrap(wl.build())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        loss = wl.loss(model, wl.local_batch(step, 8, dist.get_rank(), dist.get_world_size()))
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        time.sleep(sleep)
    return loss.item()


@pytest.mark.parametrize("wrapper", ["OverlappedDDP", "FSDP", "TorchDDP"])
def test_a_hand_written_loop_under_recording_gives_numbered_steps_and_live_frames(cluster_of, wrapper):
    pytest.importorskip("ipywidgets")
    from ddpkit.widget import ClusterWidget

    cluster = cluster_of(2)
    cluster.run(int)
    widget = ClusterWidget(cluster, log_lines=10, cell_output=None)
    frames, running = {"fill": [], "timeline": [], "summary": []}, {"on": False}
    for name in frames:
        pane = widget.live.summary if name == "summary" else widget.live.panes[name]
        pane.observe(lambda ch, name=name: frames[name].append((running["on"], ch["new"])), names="value")
    try:
        with cluster.recording():
            running["on"] = True
            cluster.run(_my_loop, wrapper)
            running["on"] = False
        trace = cluster.last_trace
        assert trace.steps == list(range(40))
        comm = [r for r in trace.records if r.cat == "comm"]
        assert {r.step for r in comm} == set(range(40)) | {None}  # None: construction's broadcasts
        per_step = [len([r for r in comm if r.step == s and r.rank == 0]) for s in range(40)]
        assert min(per_step) > 0 and per_step[-1] == per_step[2]  # each step its collectives (torch's DDP
        # adds a broadcast of its rebuilt bucket order once, early on)
        assert not any("step None" in v for seen in frames.values() for _, v in seen)
        for name in ("fill", "timeline"):
            live = {v for during, v in frames[name] if during}
            assert len(live) >= 2, f"{name}: {len(live)} frame(s) while the loop ran"
    finally:
        widget.close()
        cluster.record = False


# ----------------------------------------------------------------------------- FSDP units
def test_units_by_class_are_every_submodule_of_it_in_the_modules_order():
    from ddpkit.models import Block
    from ddpkit.strategies.common import default_units, resolve_units

    gpt = build_model("gpt", **dict(SMALL_GPT, layers=3))
    assert resolve_units(gpt, {Block}) == list(gpt.blocks) == resolve_units(gpt, Block)
    # classes and modules together, whatever order a set iterates in: the module's order
    assert resolve_units(gpt, {nn.LayerNorm, gpt.head}) == [gpt.blocks[0].ln1, gpt.blocks[0].ln2, gpt.blocks[1].ln1,
                                                            gpt.blocks[1].ln2, gpt.blocks[2].ln1, gpt.blocks[2].ln2,
                                                            gpt.ln, gpt.head]
    with pytest.raises(ValueError, match="no submodule of TinyGPT is a Conv2d"):
        resolve_units(gpt, {nn.Conv2d})
    with pytest.raises(TypeError, match="nn.Modules or module classes, got str"):
        resolve_units(gpt, ["blocks"])

    class Stack(nn.Module):  # a model the kit never saw: its blocks in a ModuleList
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(4, 8)
            self.small = nn.ModuleList([nn.Linear(1, 1)])
            self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
            self.layers[1].requires_grad_(False)
            self.out = nn.Linear(8, 2)

    stack = Stack()
    assert default_units(stack) == [stack.layers[0], stack.layers[2]]  # the largest list's trainable blocks
    assert default_units(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))[1].in_features == 2  # children


def _fsdp_units_by_class(wrapper):
    import torch.distributed as dist

    from ddpkit.experiment import make_optimizer
    from ddpkit.models import Block
    from ddpkit.strategies.reference import TorchFSDP
    from helpers import train_on_rank

    module = build_model("gpt", seed=dist.get_rank(), **dict(SMALL_GPT, layers=2))
    model = {"FSDP": ddpkit.FSDP, "TorchFSDP": TorchFSDP}[wrapper](module, units={Block})
    names = [u.name for u in model.units] if wrapper == "FSDP" else None
    train_on_rank(model, module, make_optimizer(model.parameters(), "sgd"), 2, 8)
    return names, {k: v.detach().cpu() for k, v in model.full_state_dict().items()}


@pytest.mark.parametrize("wrapper", ["FSDP", "TorchFSDP"])
def test_fsdp_and_torchs_take_units_by_class_and_train_as_one_process(cluster_of, wrapper):
    ref = train_single_process("gpt", steps=2, global_batch_size=8, **dict(SMALL_GPT, layers=2))
    for names, full in cluster_of(2).run(_fsdp_units_by_class, wrapper):
        assert names in (None, ["blocks.0", "blocks.1", "(root)"])
        assert max_abs_diff(full, ref) < TOL
