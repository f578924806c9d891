"""run_strategy (the job behind `compare`): a recorded run equals one process, and the bytes,
overlap and memory it reports agree with theory. (Every strategy equals one process with recording
off, at 1, 2 and 4 ranks, on both models and both optimizers: ``test_equivalence.py``.)"""
from __future__ import annotations

import pytest

import ddpkit
from ddpkit.experiment import (STRATEGIES, run_strategy, summarize_records,
                               train_single_process)
from ddpkit.models import build_model
from ddpkit.strategies.table import STRATEGIES as STRATEGIES_TABLE
from ddpkit.strategies.table import fsdp_units

TINY = dict(width=16, depth=3)  # Linear(16,16) x3 + head(16->10): 986 parameters, 3944 bytes
TINY_BYTES = 4 * (3 * (16 * 16 + 16) + 16 * 10 + 10)


def test_fsdp_units_one_per_linear_or_block():
    mlp = build_model("mlp", **TINY)
    assert fsdp_units(mlp) == [mlp.layers[0][0], mlp.layers[1][0], mlp.layers[2][0], mlp.head]
    gpt = build_model("gpt", dim=16, layers=3, heads=2, seq=8, vocab=16)
    assert fsdp_units(gpt) == list(gpt.blocks)


def test_unknown_strategy_is_a_clear_error(cluster_of):
    with pytest.raises(ddpkit.RankError, match="unknown strategy 'bogus'; valid: naive, bucketed"):
        cluster_of(2).run(run_strategy, "bogus", steps=1, model_kwargs=TINY)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_recorded_run_equals_one_process_and_counts_bytes(cluster_of, strategy):
    n, warmup, steps = 2, 1, 2
    ref = train_single_process("mlp", "sgd", steps=warmup + steps, global_batch_size=8, **TINY)
    results = cluster_of(n).run(run_strategy, strategy, steps=steps, warmup=warmup, global_batch_size=8,
                          record=True, reference=ref, model_kwargs=TINY)
    ddp_bytes = 2 * (n - 1) / n * TINY_BYTES  # all-reduce of every gradient, ring cost
    for r in results:
        assert r["strategy"] == strategy and r["world_size"] == n
        assert r["max_param_diff"] < 1e-5
        assert len(r["step_ms"]) == steps and r["ms_per_step"] > 0
        assert len(r["losses"]) == warmup + steps
        assert 0.0 <= r["overlap_fraction"] <= 1.0
        assert r["model_state_bytes"] > 0 and r["peak_bytes"] >= r["model_state_bytes"]
        mem = r["memory"]
        row = STRATEGIES_TABLE[strategy]
        if row.zero_stage == "ZeRO-3":  # fsdp, hsdp (at 2 ranks one node: FSDP), torch's
            if not row.torch_native:  # ours: half of the parameters each, plus the padding
                assert mem["parameters"] <= TINY_BYTES / n + 4 * n * len(fsdp_units(build_model("mlp", **TINY)))
        else:
            assert mem["parameters"] == TINY_BYTES
        # bytes through ddpkit's process group, torch's wrappers' too, as the table's theory says:
        # the DDP family and ZeRO-1/2 an all-reduce's worth (a reduce-scatter plus an all-gather,
        # with at most N-1 elements of padding per bucket), FSDP and the sharded optimizer 1.5x
        if row.bytes_vs_ddp is not None:
            assert r["comm_bytes_per_step"] == pytest.approx(row.bytes_vs_ddp * ddp_bytes, rel=0.02), strategy
        if strategy == "naive":
            assert r["collectives_per_step"] == {"all_reduce": 8}  # one per parameter tensor


def test_summarize_records_averages_steps_after_warmup():
    from ddpkit.trace import Record

    ms = 1_000_000
    recs = [
        # step 0 (warmup): an extra collective that must not count
        Record("span", "comm", "broadcast", 0, 0, 0, ms, nbytes=1000),
        Record("span", "compute", "backward", 0, 1, 0, 10 * ms),
        Record("span", "comm", "all_reduce", 0, 1, 5 * ms, 15 * ms, nbytes=400),  # half hidden
        Record("span", "compute", "backward", 0, 2, 20 * ms, 30 * ms),
        Record("span", "comm", "all_reduce", 0, 2, 30 * ms, 40 * ms, nbytes=400),  # not hidden
        Record("counter", "memory", "memory", 0, 2, 31 * ms, args={"parameters": 7, "gradients": 5}),
    ]
    out = summarize_records(recs, world_size=4, steps=[1, 2])
    assert out["comm_bytes_per_step"] == pytest.approx(2 * 3 / 4 * 400)
    assert out["collectives_per_step"] == {"all_reduce": 1}
    assert out["comm_ms_per_step"] == pytest.approx(10.0)
    assert out["overlap_fraction"] == pytest.approx(0.25)
    assert out["peak_memory_sample"] == 12


@pytest.mark.parametrize("strategy", ["overlapped", "fsdp", "torch_fsdp"])
def test_recorded_run_of_tiny_gpt_equals_one_process(cluster_of, strategy):
    # Recording on (gradient-ready hooks, memory samples) changes nothing on the tied transformer
    # either, with two blocks (two FSDP units). SGD: with AdamW attention's key bias, whose
    # gradient is exactly zero, moves by ~lr on rounding noise (see test_equivalence.py).
    gpt = dict(vocab=16, dim=16, layers=2, heads=2, seq=8)
    ref = train_single_process("gpt", "sgd", steps=3, global_batch_size=4, **gpt)
    results = cluster_of(2).run(run_strategy, strategy, model="gpt", steps=2, warmup=1, global_batch_size=4,
                          optimizer="sgd", record=True, reference=ref, model_kwargs=gpt)
    assert all(r["max_param_diff"] < 1e-5 for r in results), [r["max_param_diff"] for r in results]
