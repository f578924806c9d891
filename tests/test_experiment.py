"""run_strategy (the job behind `compare`): a recorded run equals one process, and the bytes,
overlap and memory it reports agree with theory. (Every strategy equals one process with recording
off, at 1, 2 and 4 ranks, on both models and both optimizers: ``test_equivalence.py``.)"""
from __future__ import annotations

import re

import pytest

import ddpkit
from ddpkit.experiment import run_strategy, summarize_records, train_single_process
from ddpkit.models import build_model
from ddpkit.strategies.table import NAMES, STRATEGIES
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


@pytest.mark.parametrize("kwargs, message", [
    (dict(steps=0), "steps must be a whole number >= 1 (the timed steps, after the warmup), got 0"),
    (dict(steps=-1), "steps must be a whole number >= 1 (the timed steps, after the warmup), got -1"),
    (dict(steps=2.5), "steps must be a whole number >= 1 (the timed steps, after the warmup), got 2.5"),
    (dict(warmup=-1), "warmup must be a whole number >= 0 (untimed steps first), got -1")])
def test_steps_and_warmup_out_of_range_are_named_before_anything_runs(kwargs, message):
    # steps=0 used to report 0.0 ms/step, steps=-1 an UnboundLocalError after building the model
    with pytest.raises(ValueError, match=re.escape(f"run_strategy: {message}")):
        run_strategy("naive", **kwargs)


@pytest.mark.parametrize("strategy", NAMES)
def test_recorded_run_equals_one_process_and_counts_bytes(cluster_of, strategy):
    n, warmup, steps = 2, 1, 2
    ref = train_single_process("mlp", "sgd", steps=warmup + steps, global_batch_size=8, **TINY)
    results = cluster_of(n).run(run_strategy, strategy, steps=steps, warmup=warmup, global_batch_size=8,
                          record=True, reference=ref, model_kwargs=TINY)
    ddp_bytes = 2 * (n - 1) / n * TINY_BYTES  # all-reduce of every gradient, ring cost
    for r in results:
        assert r.strategy == strategy and r.world_size == n
        assert r.max_param_diff < 1e-5
        assert len(r.step_ms) == steps and r.ms_per_step > 0
        assert len(r.losses) == warmup + steps
        assert 0.0 <= r.overlap_fraction <= 1.0
        assert r.model_state_bytes > 0 and r.peak_bytes >= r.model_state_bytes
        mem = r.memory
        row = STRATEGIES[strategy]
        if row.zero_stage == "ZeRO-3":  # fsdp, hsdp (at 2 ranks one node: FSDP), torch's
            if not row.torch_native:  # ours: half of the parameters each, plus the padding
                assert mem["parameters"] <= TINY_BYTES / n + 4 * n * len(fsdp_units(build_model("mlp", **TINY)))
        else:
            assert mem["parameters"] == TINY_BYTES
        # bytes through ddpkit's process group, torch's wrappers' too, as the table's theory says:
        # the DDP family and ZeRO-1/2 an all-reduce's worth (a reduce-scatter plus an all-gather,
        # with at most N-1 elements of padding per bucket), FSDP and the sharded optimizer 1.5x
        if row.bytes_vs_ddp is not None:
            assert r.comm_bytes_per_step == pytest.approx(row.bytes_vs_ddp * ddp_bytes, rel=0.02), strategy
        if strategy == "naive":
            assert r.collectives_per_step == {"all_reduce": 8}  # one per parameter tensor


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
    assert out.comm_bytes_per_step == pytest.approx(2 * 3 / 4 * 400)
    assert out.collectives_per_step == {"all_reduce": 1}
    assert out.comm_ms_per_step == pytest.approx(10.0)
    assert out.overlap_fraction == pytest.approx(0.25)
    assert out.peak_memory_sample == 12


@pytest.mark.parametrize("strategy", ["overlapped", "fsdp", "torch_fsdp"])
def test_recorded_run_of_tiny_gpt_equals_one_process(cluster_of, strategy):
    # Recording on (gradient-ready hooks, memory samples) changes nothing on the tied transformer
    # either, with two blocks (two FSDP units). SGD: with AdamW attention's key bias, whose
    # gradient is exactly zero, moves by ~lr on rounding noise (see test_equivalence.py).
    gpt = dict(vocab=16, dim=16, layers=2, heads=2, seq=8)
    ref = train_single_process("gpt", "sgd", steps=3, global_batch_size=4, **gpt)
    results = cluster_of(2).run(run_strategy, strategy, "gpt", steps=2, warmup=1, global_batch_size=4,
                          optimizer="sgd", record=True, reference=ref, model_kwargs=gpt)
    assert all(r.max_param_diff < 1e-5 for r in results), [r.max_param_diff for r in results]


# ----------------------------------------------------------------------------- the timing loop
def _listen(cluster):
    """Every announcement the cluster's subscribers hear: (label, run, runs)."""
    heard = []

    def listener(kind, rank, **fields):
        if kind == "label":
            heard.append((fields["label"], fields.get("run"), fields.get("runs")))

    cluster.subscribe(listener)
    return heard, listener


def test_timed_rounds_rotate_announce_each_run_and_skip_a_failure(cluster_of):
    from ddpkit.series import Series, timed_rounds

    cluster = cluster_of(2)
    runs = {"naive": dict(strategy="naive"), "broken": dict(strategy="bogus"),
            "bucketed": dict(strategy="bucketed", bucket_cap_mb=0.001)}
    heard, listener = _listen(cluster)
    try:
        with Series(cluster, runs=9) as series:
            timings = timed_rounds(series, runs, rounds=3, steps=1, global_batch_size=8, model_kwargs=TINY)
    finally:
        cluster.unsubscribe(listener)
    # rotated by the round; "broken" failed in round 1 and is skipped from then on
    order = ["naive", "broken", "bucketed", "bucketed", "naive", "bucketed", "naive"]
    rounds = [1, 1, 1, 2, 2, 3, 3]
    assert heard == [(f"{label}: timing round {r} of 3", i, 9)
                     for i, (label, r) in enumerate(zip(order, rounds, strict=True), start=1)] + [(None, None, None)]
    assert list(timings.errors) == ["broken"]
    error = timings.errors["broken"]
    assert error.startswith("broken failed: ") and "unknown strategy 'bogus'" in error
    assert timings.per_round["broken"] == []
    assert all(len(timings.per_round[s]) == 3 and min(timings.per_round[s]) > 0 for s in ("naive", "bucketed"))
    assert cluster.run(ddpkit.rank) == [0, 1]  # usable after the failure


def test_interleaved_announces_every_run_and_warns_about_a_failure(cluster_of):
    from ddpkit.compare import interleaved, spread

    cluster = cluster_of(2)
    heard, listener = _listen(cluster)
    try:
        with pytest.warns(RuntimeWarning, match="broken failed: .*unknown strategy 'bogus'"):
            out = interleaved(cluster, {0.5: dict(strategy="overlapped", bucket_cap_mb=0.5),
                                        "broken": dict(strategy="bogus")},
                              rounds=2, steps=1, global_batch_size=8, model_kwargs=TINY)
    finally:
        cluster.unsubscribe(listener)
    assert list(out) == [0.5] and len(out[0.5]) == 2 and "over 2 rounds" in spread(out[0.5])
    assert heard == [("0.5: timing round 1 of 2", 1, 4), ("broken: timing round 1 of 2", 2, 4),
                     ("0.5: timing round 2 of 2", 3, 4), (None, None, None)]


def test_validate_announces_calibration_profiling_and_timing(cluster_of):
    """Notebook 07's widget showed no label: validate's runs are announced like compare's."""
    from ddpkit.costmodel.validate import validate

    cluster = cluster_of(2)
    heard, listener = _listen(cluster)
    try:
        records, _, _ = validate(cluster, ["naive"], rounds=1, steps=1, global_batch_size=8, model_kwargs=TINY)
    finally:
        cluster.unsubscribe(listener)
    assert heard == [("calibrating collectives (round 1 of 1)", 1, 4), ("profiling compute (round 1 of 1)", 2, 4),
                     ("timing each wrapper alone (round 1 of 1)", 3, 4), ("naive: timing round 1 of 1", 4, 4),
                     (None, None, None)]
    assert records[0]["strategy"] == "naive" and records[0]["measured_ms"] > 0 and records[0]["host_ms"] >= 0
    assert records[0]["outran_link"] is None  # no emulated link, nothing to outrun


def test_compare_announces_its_series_to_the_cluster_and_a_progress_bar(cluster_of):
    import io

    from ddpkit.compare import compare, format_table
    from ddpkit.progressbar import ProgressBar

    cluster = cluster_of(2)
    heard, listener = _listen(cluster)
    out = io.StringIO()
    bar = ProgressBar(stream=out)
    try:
        records = compare(cluster, ["naive"], model_kwargs=TINY, steps=1, rounds=1, global_batch_size=8,
                          record_steps=1, progress=bar)
    finally:
        cluster.unsubscribe(listener)
    assert heard == [("naive: timing round 1 of 1", 1, 2),
                     ("naive: one recorded run (bytes, memory, equality)", 2, 2), (None, None, None)]
    assert records[0]["max_param_diff"] < 1e-5 and records[0]["rounds"] == 1
    assert "naive" in format_table(records)
    lines = out.getvalue().splitlines()  # not a terminal: a line at the start and end of each run
    assert lines[0].startswith("[") and "run 1/2 naive: timing round 1 of 1: step 0/1" in lines[0]
    assert "100% run 2/2 naive: one recorded run" in lines[-1]
    assert bar not in cluster._events.observers  # followed for the comparison only


def test_compare_passes_a_comm_hook_to_the_strategies_that_take_one(cluster_of):
    """compare(..., comm_hook="bf16_compress"): bucketed's buckets go in bf16, half the bytes,
    close to one process (rounded, not exact); naive, which has no buckets, runs as it is; the
    table says which rows the hook reduced."""
    from ddpkit.compare import compare, format_table

    records = compare(cluster_of(2), ["naive", "bucketed"], model_kwargs=TINY, steps=1, rounds=1,
                      global_batch_size=8, record_steps=1, comm_hook="bf16_compress")
    by = {r["strategy"]: r for r in records}
    assert by["naive"]["comm_hook"] is None and by["bucketed"]["comm_hook"] == "bf16_compress"
    assert by["bucketed"]["comm_bytes_per_step"] == pytest.approx(by["naive"]["comm_bytes_per_step"] / 2)
    assert by["naive"]["max_param_diff"] < 1e-5 and 0 < by["bucketed"]["max_param_diff"] < 2e-3
    assert "comm hook: bf16_compress reduced the buckets of bucketed" in format_table(records)


def test_progress_bar_shows_what_the_series_counted():
    import io

    from ddpkit.progressbar import ProgressBar, overall

    assert overall(3, 4, 5, 5) == 0.75 and overall(1, 4, 0, 10) == 0 and overall(4, 4, 20, 10) == 1
    out = io.StringIO()
    bar = ProgressBar(stream=out)
    for _ in range(2):  # subscribed twice (the caller, and a series following it): shown once
        bar("label", None, label="naive: timing round 1 of 3", run=4, runs=8)
    for done in (1, 2, 2):
        bar("progress", 0, done=done, total=2)
        bar("progress", 1, done=done, total=2)  # rank 0 speaks for the ranks
    bar("label", None, label=None, run=None, runs=None)  # the series is over: nothing new
    assert out.getvalue().splitlines() == [
        "[#########...............]  38% run 4/8 naive: timing round 1 of 3: step 0/1",
        "[############............]  50% run 4/8 naive: timing round 1 of 3: step 2/2"]
