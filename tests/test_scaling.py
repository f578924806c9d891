"""The scaling gap taken apart (ddpkit.trace.gap): on synthetic traces whose parts are known
by construction, and on real recorded runs at 1 and 2 ranks."""
from __future__ import annotations

import pytest

from ddpkit.trace import Record, Trace
from ddpkit.trace.gap import GAP_PARTS, STEP_PARTS, decompose, format_gaps, step_breakdown, step_ends

MS = 1_000_000


def _step(rank, step, t, forward, backward, issue, done, sync_end, opt, world):
    """One step of one rank as train_step and the process group record it (times in ms from t)."""
    at = lambda ms: int((t + ms) * MS)  # noqa: E731
    return [
        Record("span", "compute", "forward", rank, step, at(forward[0]), at(forward[1])),
        Record("span", "compute", "backward", rank, step, at(backward[0]), at(backward[1])),
        Record("instant", "grad_ready", "w", rank, step, at(backward[1])),
        Record("span", "comm", "all_reduce", rank, step, at(issue), at(done), nbytes=4096, bucket=0,
               args={"group": tuple(range(world)), "group_size": world}),
        Record("span", "compute", "sync", rank, step, at(backward[1]), at(sync_end)),
        Record("span", "compute", "step", rank, step, at(opt[0]), at(opt[1])),
    ]


def one_rank_trace(steps=5):
    """Period 20 ms: forward 0-6, backward 6-14 (last gradient at 14), its all-reduce 14-15 (1 ms
    exposed), sync to 15.5, optimizer 16-19, the next forward at 20. Partitioned from one step's
    end (15) to the next: compute 3 + 14 = 17, host 0.5 + 0.5 + 1 = 2, exposed 1, straggler 0."""
    records = []
    for s in range(steps):
        records += _step(0, s, 20 * s, (0, 6), (6, 14), 14, 15, 15.5, (16, 19), world=1)
    return Trace(records, 1)


def two_rank_trace(steps=5):
    """Period 16 ms. Rank 0: forward 0-3, backward 3-7, issues at 7; rank 1 (the straggler):
    forward 0-4, backward 4-9, issues at 9; the all-reduce completes on both at 11; sync to 11.5,
    optimizer 12-14, next forward at 16. From one step's end (11) to the next, rank 0: compute
    2 + 7 = 9, straggler 7-9 = 2, exposed 9-11 = 2, host 3; rank 1: compute 2 + 9 = 11, exposed
    2, host 3. Mean: compute 10, host 3, exposed 2, straggler 1, and the step 16."""
    records = []
    for s in range(steps):
        t = 16 * s
        records += _step(0, s, t, (0, 3), (3, 7), 7, 11, 11.5, (12, 14), world=2)
        records += _step(1, s, t, (0, 4), (4, 9), 9, 11, 11.5, (12, 14), world=2)
    return Trace(records, 2)


def test_step_ends_are_the_last_collective_completions():
    ends = step_ends(two_rank_trace(3))
    assert ends == {0: 11 * MS, 1: 27 * MS, 2: 43 * MS}


def test_partition_of_known_steps():
    one = step_breakdown(one_rank_trace())
    assert one.steps == [2, 3, 4]  # after the warm-up step and the one holding its optimizer step
    assert one.step_ms == pytest.approx(20)
    assert one.parts == pytest.approx(dict(compute=17, exposed_comm=1, straggler_wait=0, host=2))

    two = step_breakdown(two_rank_trace())
    assert two.step_ms == pytest.approx(16)
    assert two.per_rank[0] == pytest.approx(dict(compute=9, exposed_comm=2, straggler_wait=2, host=3))
    assert two.per_rank[1] == pytest.approx(dict(compute=11, exposed_comm=2, straggler_wait=0, host=3))
    assert two.parts == pytest.approx(dict(compute=10, exposed_comm=2, straggler_wait=1, host=3))
    for rank_parts in two.per_rank.values():  # a partition: every rank's parts fill the step
        assert sum(rank_parts.values()) == pytest.approx(two.step_ms)


def test_strong_and_weak_gaps_of_known_steps():
    one, two = one_rank_trace(), two_rank_trace()
    strong = decompose(one, two, "strong")
    # ideal 20 / 2 = 10, measured 16: gap 6 = contention (10 - 17/2) + host (3 - 2/2)
    # + exposed (2 - 1/2) + straggler 1
    assert strong.ideal_ms == pytest.approx(10) and strong.gap_ms == pytest.approx(6)
    assert strong.parts == pytest.approx(dict(contention=1.5, host_overhead=2, exposed_comm=1.5, straggler_wait=1))
    assert strong.residual_ms == pytest.approx(0, abs=1e-9)
    assert strong.efficiency == pytest.approx(10 / 16) and strong.speedup == pytest.approx(20 / 16)
    weak = decompose(one, two, "weak")  # perfect weak scaling: the 1-rank time at every size
    assert weak.ideal_ms == pytest.approx(20) and weak.gap_ms == pytest.approx(-4)
    assert weak.parts == pytest.approx(dict(contention=-7, host_overhead=1, exposed_comm=1, straggler_wait=1))
    table = format_gaps([strong, weak])
    assert table.splitlines()[1].split()[:2] == ["strong", "2"] and "weak" in table


def test_decompose_refuses_a_baseline_that_is_not_one_rank():
    with pytest.raises(ValueError, match="1 rank"):
        decompose(two_rank_trace(), two_rank_trace())
    with pytest.raises(ValueError, match="mode"):
        decompose(one_rank_trace(), two_rank_trace(), "sideways")
    with pytest.raises(ValueError, match="after another"):
        step_breakdown(one_rank_trace(2))


def test_real_runs_at_one_and_two_ranks_add_up(cluster_of):
    """Recorded OverlappedDDP at 1 and 2 ranks: each rank's parts fill its step, the gap's parts add
    up to the measured gap, and the 2-rank run waits for communication (it has some to wait for)."""
    from ddpkit.experiment import run_strategy

    traces = {}
    for n in (1, 2):
        cluster = cluster_of(n)
        with cluster.recording():
            cluster.run(run_strategy, "overlapped", steps=4, global_batch_size=16, bucket_cap_mb=1.0,
                        model_kwargs=dict(width=128, depth=8), report_progress=False)
        traces[n] = cluster.last_trace
    at_two = step_breakdown(traces[2])
    assert at_two.steps == [2, 3, 4]
    for parts in at_two.per_rank.values():
        assert sum(parts.values()) == pytest.approx(at_two.step_ms, rel=1e-6)
        assert all(parts[p] >= 0 for p in STEP_PARTS) and parts["compute"] > 0
    assert at_two.parts["exposed_comm"] + at_two.parts["straggler_wait"] > 0
    gap = decompose(traces[1], traces[2], "strong")
    assert set(gap.parts) == set(GAP_PARTS)
    assert abs(gap.residual_ms) <= 0.05 * max(abs(gap.gap_ms), 1e-3), gap


def test_the_gap_plot_stacks_each_part_and_marks_the_measured_step():
    from ddpkit.viz import plot_scaling_gap

    one, two = one_rank_trace(), two_rank_trace()
    gaps = [decompose(one, one, "strong"), decompose(one, two, "strong"), decompose(one, one, "weak"),
            decompose(one, two, "weak")]
    fig = plot_scaling_gap(gaps)
    assert fig._repr_png_().startswith(b"\x89PNG")
    strong, weak = fig.axes
    assert [t.get_text() for t in strong.get_xticklabels()] == ["1 rank", "2 ranks"]
    labels = {t.get_text() for t in strong.texts}
    assert labels == {"100%", f"{10 / 16:.0%}"} and "weak" in weak.get_title()
    # weak scaling's negative contention (-7 ms) is drawn below where the stack stood, hatched
    assert any(p.get_hatch() == "///" for p in weak.patches)
