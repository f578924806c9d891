"""Every strategy equals single-process training: the table of strategies x world sizes x models x optimizers.

Each case is its own named test (``fsdp-4ranks-gpt-adamw``): on every rank the model is built
with ``seed=rank`` (ranks start different, so the wrapper's rank-0 broadcast is exercised),
wrapped by ``experiment.wrap`` from ``ddpkit.strategies.table``, trained ``STEPS`` steps with
``train_step`` on the rank's slice of each global batch, and its ``full_state_dict()`` compared
with ``train_single_process`` on the whole batch. The strategies are read from the table, so a
new row there gets its cases here without an edit. A second matrix clips the gradients every step
(``clip_grad_norm_``, the 2-norm and, where the gradients are sharded, the inf-norm): the norm
each wrapper returns and the parameters it leaves equal one process's. What is particular to one strategy (no_sync,
frozen and tied parameters, collective counts, options such as FSDP's resharding) is tested in
its own file.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

import ddpkit

from ddpkit.experiment import local_batch, max_abs_diff, optimizer_class, wrap
from ddpkit.models import build_model, loss_fn, make_batch
from ddpkit.strategies.table import NAMES, STRATEGIES
from helpers import SMALL_CAP, SMALL_GPT, SMALL_MLP, TOL, ranks, reference_params, train_on_rank

MODELS = {"mlp": SMALL_MLP, "gpt": SMALL_GPT}
OPTIMIZERS = ("sgd", "adamw")
STEPS = 3
BATCH = 24  # splits evenly over 1, 2, 3 and 4 ranks


class Case(NamedTuple):
    strategy: str
    world_size: int
    model: str
    optimizer: str

    def __str__(self):
        return f"{self.strategy}-{ranks(self.world_size)}-{self.model}-{self.optimizer}"


def _world_sizes(name):
    """1, 2 and 4 for every strategy; 3 as well where ddpkit's own code splits state across ranks
    (ShardedOptimizer partitions whole parameters, ZeRO-1/2 and FSDP pad flat buffers to a
    multiple of N): 3 leaves uneven partitions and padding that 2 and 4 may not. (torch's own
    sharding is torch's to test.) Hybrid sharding only where its node size divides the world size
    (4 ranks: 2 nodes x 2; 2 ranks: one node, i.e. FSDP)."""
    row = STRATEGIES[name]
    sizes = (1, 2, 3, 4) if row.zero_stage != "DDP" and not row.torch_native else (1, 2, 4)
    return tuple(n for n in sizes if row.fits(n))


CASES = [Case(s, n, m, o) for s in NAMES for n in _world_sizes(s) for m in MODELS for o in OPTIMIZERS]


def _train(strategy, model_name, optimizer):
    """On every rank: build with seed=rank, wrap as the table says, train, return full parameters."""
    module = build_model(model_name, seed=dist.get_rank(), **MODELS[model_name])
    model, opt = wrap(strategy, module, optimizer, bucket_cap_mb=SMALL_CAP)  # several buckets
    train_on_rank(model, module, opt, STEPS, BATCH)
    return {k: v.detach().cpu() for k, v in model.full_state_dict().items()}


# AdamW on TinyGPT: attention's key bias (the middle third of each ``qkv.bias``) has a gradient
# that is exactly zero in exact arithmetic, because softmax ignores a shift shared by all keys
# (q . (k_j + b) = q . k_j + q . b for every key j). Its fp32 gradient is rounding noise, which
# Adam normalises to a step of about +-lr; N processes sum in another order than one process, so
# the noise and the step differ, in every correct implementation alike (torch's own included).
# So that slice is checked apart: it may differ by at most what Adam can move it in STEPS steps
# (2 x STEPS x lr: each side about lr per step), and everything else must equal one process
# within TOL as in every other case. ``test_key_bias_gradient_is_zero`` shows the premise; with
# SGD the slice moves by lr x noise (~1e-10) and is checked within TOL with the rest.
def _without_key_bias(params: dict) -> tuple[dict, dict]:
    """(params with each key-bias slice zeroed, {name: that slice})."""
    dim = SMALL_GPT["dim"]
    rest, key_bias = dict(params), {}
    for name, t in params.items():
        if name.endswith("qkv.bias"):
            key_bias[name] = t[dim:2 * dim]
            rest[name] = torch.cat([t[:dim], torch.zeros(dim), t[2 * dim:]])
    return rest, key_bias


@pytest.mark.parametrize("case", CASES, ids=str)
def test_equal_to_single_process(cluster_of, case):
    per_rank = cluster_of(case.world_size).run(_train, case.strategy, case.model, case.optimizer)
    reference = reference_params(case.model, case.optimizer, steps=STEPS, batch=BATCH, **MODELS[case.model])
    adam_on_gpt = case.model == "gpt" and case.optimizer == "adamw"
    if adam_on_gpt:
        reference, reference_key_bias = _without_key_bias(reference)
    for rank, full in enumerate(per_rank):
        assert list(full) == list(reference), f"rank {rank}: not the original names in their order"
        if adam_on_gpt:
            full, key_bias = _without_key_bias(full)
            diff = max_abs_diff(key_bias, reference_key_bias)
            reach = 2 * STEPS * optimizer_class("adamw")[1]["lr"]
            assert diff <= reach, f"{case}: rank {rank}'s key bias off by {diff}, more than Adam's noise moves it"
        diff = max_abs_diff(full, reference)
        assert diff < TOL, f"{case}: rank {rank} off by {diff}"


def test_key_bias_gradient_is_zero():
    """The premise of the AdamW-on-TinyGPT check above, in one process: in float64 the key
    bias's gradient is zero up to float64 rounding; in float32 it is rounding noise, tiny but
    not zero, so Adam (which divides by its root mean square) turns it into steps of ~lr."""
    dim = SMALL_GPT["dim"]
    grads = {}
    for dtype in (torch.float64, torch.float32):
        model = build_model("gpt", **SMALL_GPT).to(dtype)
        x, y = make_batch(model, BATCH, 0)
        loss_fn(model(x), y).backward()
        grads[dtype] = model.blocks[0].qkv.bias.grad
    g64, g32 = grads[torch.float64], grads[torch.float32]
    assert g64[dim:2 * dim].abs().max() < 1e-15               # keys: zero in exact arithmetic
    assert g64[:dim].abs().min() > 1e-6 and g64[2 * dim:].abs().max() > 1e-3  # queries, values: not
    assert 0 < g32[dim:2 * dim].abs().max() < 1e-6             # fp32: rounding noise


# ----------------------------------------------------------------------------- clipping
# ``model.clip_grad_norm_(max_norm)`` after the sync, before the step: the norm of the *whole*
# gradient, also where each rank holds only shards of it (ZeRO-1/2, FSDP, HSDP: all-reduced across
# the shards; the inf-norm takes their max). MAX_NORM is below the gradients' norm, so every step
# clips (the test checks it does).
MAX_NORM = 0.05


def _sharded(name):
    return STRATEGIES[name].zero_stage in ("ZeRO-2", "ZeRO-3") or name == "zero1"


CLIP_CASES = [(s, n, 2.0) for s in NAMES for n in (1, 2, 4) if STRATEGIES[s].fits(n)]
CLIP_CASES += [(s, n, float("inf")) for s in NAMES for n in (2, 4) if _sharded(s) and STRATEGIES[s].fits(n)]


def _clipped_loop(model, module, opt, norm_type, world, rank):
    norms = []
    for step in range(STEPS):
        x, y = local_batch(module, BATCH, step, rank, world)
        loss_fn(model(x), y).backward()
        norms.append(float(model.clip_grad_norm_(MAX_NORM, norm_type)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms


def _train_clipped(strategy, norm_type):
    """On every rank: the tied GPT with seed=rank, a hand-written loop that clips; (norms, parameters)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    module = build_model("gpt", seed=rank, **SMALL_GPT)
    model, opt = wrap(strategy, module, "sgd", bucket_cap_mb=SMALL_CAP)
    norms = _clipped_loop(model, module, opt, norm_type, world, rank)
    return norms, {k: v.detach().cpu() for k, v in model.full_state_dict().items()}


@functools.cache
def _clipped_reference(norm_type):
    """One process, the whole batch, ``torch.nn.utils.clip_grad_norm_``: (norms, parameters)."""
    module = build_model("gpt", seed=0, **SMALL_GPT)
    opt = torch.optim.SGD(module.parameters(), **optimizer_class("sgd")[1])
    norms = []
    for step in range(STEPS):
        x, y = make_batch(module, BATCH, step)
        loss_fn(module(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(module.parameters(), MAX_NORM, norm_type)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms, {k: v.detach().clone() for k, v in module.named_parameters()}


@pytest.mark.parametrize("strategy, n, norm_type", CLIP_CASES,
                         ids=[f"{s}-{ranks(n)}-{'inf' if t == float('inf') else 'l2'}" for s, n, t in CLIP_CASES])
def test_clipping_equals_single_process(cluster_of, strategy, n, norm_type):
    ref_norms, reference = _clipped_reference(norm_type)
    assert min(ref_norms) > MAX_NORM  # every step clips
    for rank, (norms, full) in enumerate(cluster_of(n).run(_train_clipped, strategy, norm_type)):
        assert norms == pytest.approx(ref_norms, rel=1e-5), f"rank {rank}: total norm"
        diff = max_abs_diff(full, reference)
        assert diff < TOL, f"{strategy} at {n} ranks: rank {rank} off by {diff}"


# On an emulated network the shared-memory transport moves a collective's bytes only when the rank
# waits for it (or, once its future is handed out, when the link delivers it: torch's wrappers, comm
# hooks): at_wait (ddpkit.comm.emulator). Results stay exact: every strategy, every size.
NIC_CASES = [(s, n) for s in NAMES for n in (2, 4) if STRATEGIES[s].fits(n)]


@pytest.mark.parametrize("strategy, n", NIC_CASES, ids=[f"{s}-{ranks(n)}" for s, n in NIC_CASES])
def test_equal_to_single_process_on_an_emulated_network(cluster_of, strategy, n):
    cluster = cluster_of(n)
    cluster.network = "10GbE" if strategy not in ("hsdp", "torch_hsdp") else ddpkit.Network("10GbE", gpus_per_node=2)
    try:
        per_rank = cluster.run(_train, strategy, "mlp", "sgd")
    finally:
        cluster.network = None
    reference = reference_params("mlp", "sgd", steps=STEPS, batch=BATCH, **MODELS["mlp"])
    for rank, full in enumerate(per_rank):
        diff = max_abs_diff(full, reference)
        assert diff <= TOL, f"{strategy}-{ranks(n)} on 10GbE: rank {rank} differs from one process by {diff}"
