"""The cost model: collective formulas, bucketing, and the behaviours the papers report."""
from __future__ import annotations

import dataclasses
import math

import pytest

from ddpkit import costmodel as cm
from ddpkit.costmodel.stream import Stream
from ddpkit.network import Link, LinkClock, Network, collective_time, ring_terms
from ddpkit.strategies.table import NAMES, strategy

NET = Link("test", alpha=20e-6, beta=1 / 10e9)  # 20 us per message, 10 GB/s


def test_collective_times_follow_the_ring_formulas():
    s = 1e6
    # all-reduce on 4 ranks: 2*3 alpha + 2*3/4 * S * beta
    assert collective_time("all_reduce", s, 4, NET) == pytest.approx(6 * 20e-6 + 1.5 * s / 10e9)
    assert collective_time("all_gather", s, 4, NET) == pytest.approx(3 * 20e-6 + 0.75 * s / 10e9)
    assert collective_time("reduce_scatter", s, 8, NET) == pytest.approx(7 * 20e-6 + 7 / 8 * s / 10e9)
    # a broadcast's pipeline: every link but the last carries all S, one after another
    assert collective_time("broadcast", s, 4, NET) == pytest.approx(3 * 20e-6 + s / 10e9)
    assert collective_time("all_reduce", s, 1, NET) == 0.0
    with pytest.raises(KeyError):
        collective_time("all_to_all", s, 2, NET)
    # its two terms, which a fit regresses on and a matched link solves: messages x alpha + bytes x beta
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier"):
        for n in (2, 3, 8):
            messages, carried = ring_terms(op, s, n)
            assert collective_time(op, s, n, NET) == pytest.approx(messages * NET.alpha + carried * NET.beta)
    assert ring_terms("all_reduce", s, 4) == (6, 1.5 * s) and ring_terms("all_gather", s, 1) == (0, 0)


def test_one_route_says_which_link_how_long_and_when_the_bytes_move():
    """``Network.route``, the timing policy the process group, the emulator and the cost model all
    ask: the link a group's collectives take, their time on it, and whether their bytes move at the
    wait (only an emulated link over the shared-memory transport: the emulated network card)."""
    s = 1e6
    net = Network("10GbE", gpus_per_node=2)
    across, inside = net.route([0, 2], "shm"), net.route([0, 1], "shm")
    assert (across.kind, across.link, inside.kind, inside.link) == ("inter-node", net.inter, "intra-node", net.intra)
    assert across.time("all_reduce", s) == collective_time("all_reduce", s, 2, net.inter)
    assert across.time("all_reduce", s) == net.emulated_time("all_reduce", s, [0, 2])
    assert across.at_wait and inside.at_wait
    assert not any(net.route([0, 2], t).at_wait for t in ("gloo", "nccl", "cuda-ipc", ""))
    plain = Network("loopback").route([0, 1], "shm")  # nothing emulated: the transport's own time, from the issue
    assert plain.link is None and plain.time("all_reduce", s) == 0.0 and not plain.at_wait
    # the cost model's stream asks the same route, by the transport its floor was fitted on
    floor = Link("fitted", 1e-6, 1e-10, host=True, transport="shm")
    stream = Stream(2, net.with_floor(floor))
    assert stream.issue("all_reduce", s, 0.0, [0, 2]).waiting
    assert not Stream(2, net.with_floor(dataclasses.replace(floor, transport="gloo"))).issue(
        "all_reduce", s, 0.0, [0, 2]).waiting


def test_buckets_follow_torch_ddp_rules():
    sizes = [10, 10, 10, 10, 10]  # registration order
    assert cm.assign_buckets(sizes, 25) == [[4, 3, 2], [1, 0]]  # reverse order; crossing tensor stays in
    assert cm.assign_buckets(sizes, 0) == [[4], [3], [2], [1], [0]]
    assert cm.assign_buckets(sizes, 1000) == [[4, 3, 2, 1, 0]]
    assert cm.assign_buckets(sizes, 1000, first_cap_bytes=15) == [[4, 3], [2, 1, 0]]
    with pytest.raises(ValueError, match=">= 0"):
        cm.assign_buckets(sizes, -1)


def _mlp_like():
    # 32 layers of 256 KiB (the default MLP's 256x256 Linear in fp32), 0.1 ms forward each
    return cm.uniform_profile(32, 256 * 1024, forward_ms=0.1, optimizer_ms=1.0)


def test_one_rank_costs_exactly_the_compute():
    p = _mlp_like()
    for s in NAMES:
        if not strategy(s).fits(1):  # hybrid sharding: nodes of 2 ranks
            with pytest.raises(ValueError, match="not a multiple"):
                cm.simulate(s, p, 1, NET)
            continue
        pred = cm.simulate(s, p, 1, NET)
        assert pred.comm_bytes_per_step == 0 and pred.collectives == 0
        assert pred.ms_per_step == pytest.approx(pred.compute_ms)
        assert pred.compute_ms == pytest.approx((p.forward_s + p.backward_s + p.optimizer_s) * 1e3)


def test_a_group_of_one_ranks_all_gathers_and_reduce_scatters_copy_their_bytes():
    """Alone, a rank moves nothing, but an all-gather or a reduce-scatter copies its input to its
    output (one pass over S; an all-reduce is in place): what a wrapper timed alone pays, which
    validate must not count as its host work (at N ranks the transport's line holds it)."""
    p = dataclasses.replace(_mlp_like(), copy_s_per_byte=1e-9)  # 1 GB/s
    passes = {s: (cm.simulate(s, p, 1, NET).ms_per_step - cm.simulate(s, _mlp_like(), 1, NET).ms_per_step)
              / (p.param_bytes * 1e-6) for s in ("bucketed", "overlapped", "zero1", "zero2", "fsdp")}
    # bucketed DDP's own two passes (into its buckets and out), ZeRO's into its buckets only, plus
    # one pass each for the reduce-scatter and the all-gather; FSDP's three collectives per unit
    assert passes == pytest.approx({"bucketed": 2, "overlapped": 2, "zero1": 3, "zero2": 3, "fsdp": 3}, rel=0.01)


def test_bucket_size_has_an_optimum_inside_the_range():
    """Tiny buckets pay alpha per bucket, one huge bucket cannot overlap: a U-shaped curve."""
    p = _mlp_like()
    caps = [0, 0.5, 1, 2, 4, 8, 16, 64]
    times = [cm.simulate("overlapped", p, 8, NET, cap).ms_per_step for cap in caps]
    best = min(range(len(caps)), key=times.__getitem__)
    assert 0 < best < len(caps) - 1, times
    assert times[best] < 0.95 * times[0] and times[best] < 0.95 * times[-1], times


def test_overlap_gain_shrinks_as_communication_dominates():
    """Overlap hides at most the backward compute: once communication takes longer than
    backward, a slower network adds comm time that nothing hides, so the relative gain falls."""
    p = _mlp_like()
    gains, comm_over_backward = [], []
    for gbps in (10, 3, 1, 0.3, 0.1, 0.03):  # slower and slower network
        net = Link(f"{gbps}", alpha=20e-6, beta=1 / (gbps * 1e9))
        bucketed = cm.simulate("bucketed", p, 8, net, 2)
        overlapped = cm.simulate("overlapped", p, 8, net, 2)
        assert overlapped.ms_per_step <= bucketed.ms_per_step + 1e-9
        gain = bucketed.ms_per_step - overlapped.ms_per_step
        assert gain <= p.backward_s * 1e3 + 1e-9  # it can hide at most the backward compute
        gains.append(gain / bucketed.ms_per_step)
        comm_over_backward.append(bucketed.comm_ms / (p.backward_s * 1e3))
    dominated = [g for g, r in zip(gains, comm_over_backward, strict=True) if r >= 1]
    assert len(dominated) >= 3, comm_over_backward
    assert all(a > b for a, b in zip(dominated, dominated[1:], strict=False)), gains
    assert dominated[-1] < 0.2 * max(gains), gains


@pytest.mark.parametrize("n", [2, 4, 8])
def test_fsdp_moves_one_and_a_half_times_ddp_volume(n):
    p = _mlp_like()
    ddp = cm.simulate("overlapped", p, n, NET)
    fsdp = cm.simulate("fsdp", p, n, NET)
    assert ddp.comm_bytes_per_step == pytest.approx(2 * (n - 1) / n * p.param_bytes)
    assert fsdp.comm_bytes_per_step / ddp.comm_bytes_per_step == pytest.approx(1.5)
    # per unit: all-gather in forward, again in backward, one reduce-scatter
    assert fsdp.collectives == 3 * len(p.layers)


def test_naive_is_one_all_reduce_per_tensor_and_slowest_on_latency():
    p = _mlp_like()
    naive, bucketed = cm.simulate("naive", p, 8, NET), cm.simulate("bucketed", p, 8, NET, bucket_cap_mb=25.0)
    assert naive.collectives == 32 and bucketed.collectives == 1  # a cap given: every bucket's, one here
    # left at its default, torch DDP's layout: a first bucket of 1 MiB, then the rest
    assert cm.simulate("bucketed", p, 8, NET).collectives == cm.simulate("torch_ddp", p, 8, NET).collectives > 1
    assert naive.comm_bytes_per_step == pytest.approx(bucketed.comm_bytes_per_step)
    assert naive.ms_per_step - bucketed.ms_per_step == pytest.approx(31 * 14 * NET.alpha * 1e3)


def test_fit_recovers_alpha_and_beta():
    true = Link("true", alpha=50e-6, beta=1 / 2e9)
    sizes = [4096, 65536, 1 << 20, 1 << 22, 1 << 24]
    samples = [(s, collective_time("all_reduce", s, 4, true)) for s in sizes]
    fit = cm.fit_link(samples, 4)
    assert fit.alpha == pytest.approx(true.alpha, rel=1e-6)
    assert fit.beta == pytest.approx(true.beta, rel=1e-6)
    with pytest.raises(ValueError):
        cm.fit_link(samples, 1)


def test_profile_model_measures_each_layer():
    from ddpkit.experiment import local_batch
    from ddpkit.models import build_model

    model = build_model("mlp", width=16, depth=3)
    x, y = local_batch(model, 8, 0, 0, 1)
    prof = cm.profile_model(model, x, y, repeats=2)
    assert [layer.name for layer in prof.layers] == ["layers.0.0", "layers.1.0", "layers.2.0", "head"]
    assert prof.param_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert all(layer.forward_s > 0 and layer.backward_s > 0 for layer in prof.layers)
    assert [layer.unit for layer in prof.layers] == ["layers.0.0", "layers.1.0", "layers.2.0", "head"]
    gpt = build_model("gpt", dim=16, layers=2, heads=2, seq=8, vocab=16)
    x, y = local_batch(gpt, 4, 0, 0, 1)
    prof = cm.profile_model(gpt, x, y, repeats=1)
    # the tied head is counted once (with the token embedding); blocks are FSDP units
    assert prof.param_bytes == sum(p.numel() * 4 for p in gpt.parameters())
    assert {layer.unit for layer in prof.layers} == {"", "blocks.0", "blocks.1"}
    assert cm.simulate("fsdp", prof, 2, NET).comm_bytes_per_step >= 1.5 * prof.param_bytes / 2


def test_plot_scaling_draws_to_256():
    import matplotlib

    from ddpkit.viz import plot_scaling

    matplotlib.use("Agg")
    fig = plot_scaling(_mlp_like(), strategies=("overlapped", "fsdp"), networks=("100GbE", NET))
    axes = fig.get_axes()
    assert len(axes) == 2
    xs = axes[0].get_lines()[0].get_xdata()
    assert max(xs) == 256
    ys = axes[0].get_lines()[0].get_ydata()
    assert ys[0] == pytest.approx(100) and all(0 < y <= 100 + 1e-9 for y in ys)


def test_fit_gives_each_collective_its_own_line():
    truth = {"all_reduce": (300e-6, 1 / 1.5e9), "all_gather": (100e-6, 1 / 1e9),
             "reduce_scatter": (600e-6, 1 / 0.7e9)}
    true = Link("true", *truth["all_reduce"], per_op=truth)
    sizes = [1024, 16384, 1 << 18, 1 << 20, 1 << 22]
    samples = {op: [(s, collective_time(op, s, 2, true)) for s in sizes] for op in truth}
    fit = cm.fit_link(samples, 2)
    for op, (alpha, beta) in truth.items():
        assert fit.alpha_beta(op) == pytest.approx((alpha, beta), rel=1e-6)
    assert (fit.alpha, fit.beta) == pytest.approx(truth["all_reduce"], rel=1e-6)
    # a network without per-collective lines uses its own alpha and beta for every collective
    assert NET.alpha_beta("reduce_scatter") == (NET.alpha, NET.beta)
    with pytest.raises(ValueError, match="two sizes or more"):
        cm.fit_link({"all_gather": [(1024, 1e-3)]}, 2)
    with pytest.raises(ValueError, match="unknown collective"):
        cm.fit_link({"all_to_all": samples["all_gather"]}, 2)
    with pytest.raises(ValueError, match=">= 0"):
        Link("bad", 1e-6, 1e-9, per_op={"all_gather": (-1.0, 1e-9)})
    with pytest.raises(ValueError, match="unknown collective"):
        Link("bad", 1e-6, 1e-9, per_op={"gossip": (1e-6, 1e-9)})


def test_a_fitted_link_keeps_its_timings_to_print_beside_its_lines_and_prices_by_the_lines():
    samples = {"all_reduce": [(1024, 1e-3), (1 << 20, 2e-3), (1 << 22, 8e-3)],
               "all_gather": [(1024, 0.5e-3), (1 << 22, 4e-3)]}
    net = cm.fit_link(samples, 2, transport="shm")
    assert net.measured_world_size == 2 and net.transport == "shm"
    alpha, beta = net.alpha_beta("all_reduce")
    for n in (2, 4):  # one formula at every world size, the measured one included
        assert collective_time("all_reduce", 1 << 20, n, net) == pytest.approx(
            2 * (n - 1) * alpha + 2 * (n - 1) / n * (1 << 20) * beta)
    text = cm.format_fit(net)
    assert "1024 2.00/" in text and "(KiB measured/fitted ms)" in text  # each timing beside its line
    with pytest.raises(ValueError, match="world size"):
        Link("bad", 1e-6, 1e-9, measured={"all_reduce": ((1, 1.0), (2, 2.0))})


def test_naive_pays_the_apart_wake_once_and_the_in_step_wake_after():
    """Naive DDP waits for each gradient's all-reduce before issuing the next: only the first follows
    compute (the ranks arrive apart, ``emulation_s``); the rest follow a wait, in step
    (``emulation_step_s``, measured with calls back to back). Bucketed's buckets all follow compute."""
    p = _mlp_like()
    floor = Link("shm", 50e-6, 1 / 2e9, host=True, transport="shm")
    apart, step = 0.4e-3, 0.05e-3

    def ms(name, emulation_s, emulation_step_s):
        net = Network("10GbE").with_floor(floor, emulation_s, emulation_step_s)
        return cm.simulate(name, p, 2, net, None if name == "naive" else 1).ms_per_step

    collectives = sum(len(layer.param_bytes) for layer in p.layers)  # one all-reduce per gradient
    base = ms("naive", 0.0, 0.0)
    assert ms("naive", apart, 0.0) - base == pytest.approx(apart * 1e3)
    assert ms("naive", apart, step) - base == pytest.approx((apart + (collectives - 1) * step) * 1e3)
    assert ms("bucketed", apart, step) == pytest.approx(ms("bucketed", apart, 0.0))


def test_calibration_sizes_reach_the_largest_collective():
    assert cm.calibration_sizes(8.4e6) == (1024, 16384, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
    assert cm.calibration_sizes(1000) == cm.CALIBRATION_SIZES[:3]  # at least three sizes
    assert cm.calibration_sizes(1e12) == cm.CALIBRATION_SIZES


def test_bucket_copies_cost_two_passes_and_naive_one():
    """Each gradient is copied into its bucket and back out (two passes over P bytes); naive
    scales each gradient in place (one pass); with overlap the copy in happens during backward."""
    p = _mlp_like()
    c = 1e-10  # seconds per byte (10 GB/s)
    copying = cm.Profile(p.layers, p.optimizer_s, copy_s_per_byte=c)
    passes = {"naive": 1, "bucketed": 2, "overlapped": 2}
    for s, k in passes.items():  # one 8 MiB bucket (cap 25 MiB); overlapped: 2 MiB buckets
        cap = 2 if s == "overlapped" else 25
        free, paid = cm.simulate(s, p, 8, NET, cap), cm.simulate(s, copying, 8, NET, cap)
        extra = (paid.ms_per_step - free.ms_per_step) / 1e3
        if s == "overlapped":  # copies during backward can hide under communication
            assert 0 < extra <= k * p.param_bytes * c + 1e-12
        else:                  # nothing overlaps them
            assert extra == pytest.approx(k * p.param_bytes * c)
    assert cm.simulate("zero1", copying, 8, NET).ms_per_step > cm.simulate("zero1", p, 8, NET).ms_per_step


def test_measure_collectives_on_two_ranks(cluster_of):
    sizes = (4096, 1 << 16)
    out = cluster_of(2).run(cm.measure_collectives, sizes=sizes, repeats=1)
    for per_rank in out:
        assert set(per_rank) == {"all_reduce", "all_gather", "reduce_scatter"}
        for rows in per_rank.values():
            assert [s for s, _ in rows] == list(sizes)
            assert all(t > 0 and math.isfinite(t) for _, t in rows)
    slowest = cm.slowest_rank(out)
    for op, rows in slowest.items():
        for i, (_size, t) in enumerate(rows):
            assert t == max(r[op][i][1] for r in out)
    net = cm.fit_link(slowest, 2)
    assert set(net.per_op) == {"all_reduce", "all_gather", "reduce_scatter"}
    assert [s for s, _ in cluster_of(2).run(cm.measure_all_reduce, sizes, 1)[0]] == list(sizes)
    with pytest.raises(Exception, match="cannot measure"):
        cluster_of(2).run(cm.measure_collectives, ("broadcast",), sizes)


def test_the_zero_ladder_moves_ddp_bytes_or_one_and_a_half_times():
    p = _mlp_like()
    ddp = cm.simulate("overlapped", p, 4, NET).comm_bytes_per_step
    assert cm.simulate("zero1", p, 4, NET).comm_bytes_per_step == pytest.approx(ddp)
    assert cm.simulate("zero2", p, 4, NET).comm_bytes_per_step == pytest.approx(ddp)
    assert cm.simulate("sharded_optimizer", p, 4, NET).comm_bytes_per_step == pytest.approx(1.5 * ddp)
    # hybrid, 2 nodes x 2: 3 collectives among 2 ranks of a node, plus an all-reduce of half the model
    # between 2 replicas: 3 * 1/2 * S + 2 * 1/2 * S / 2 = 2 S, against FSDP's 3 * 3/4 * S
    s = p.param_bytes
    assert cm.simulate("hsdp", p, 4, NET).comm_bytes_per_step == pytest.approx(2 * s)
    assert cm.simulate("fsdp", p, 4, NET).comm_bytes_per_step == pytest.approx(2.25 * s)


def test_torch_zero_broadcasts_the_bytes_of_an_all_gather_one_parameter_at_a_time():
    """torch's ZeroRedundancyOptimizer broadcasts each parameter from the rank that stepped it:
    the bytes of the sharded optimizer's one all-gather (1.5x DDP's), in one collective per
    parameter, each taking its pipeline's S beta."""
    p = _mlp_like()
    n = 4
    ours, torchs = cm.simulate("sharded_optimizer", p, n, NET), cm.simulate("torch_zero", p, n, NET)
    assert torchs.comm_bytes_per_step == pytest.approx(ours.comm_bytes_per_step)
    assert torchs.comm_bytes_per_step == pytest.approx(1.5 * cm.simulate("overlapped", p, n, NET).comm_bytes_per_step)
    tensors = sum(len(layer.param_bytes) for layer in p.layers)
    assert torchs.collectives == ours.collectives - 1 + tensors  # one all-gather -> a broadcast per tensor
    # on the link: the broadcasts' (N-1) alpha each and S beta in all, against one all-gather's
    # (N-1) alpha + (N-1)/N S beta
    broadcasts = tensors * (n - 1) * NET.alpha + p.param_bytes * NET.beta
    gather = (n - 1) * NET.alpha + (n - 1) / n * p.param_bytes * NET.beta
    assert torchs.comm_ms - ours.comm_ms == pytest.approx((broadcasts - gather) * 1e3)


def test_the_validation_table_says_which_rows_outran_the_link_and_what_that_means():
    from ddpkit.costmodel.validate import format_validation

    rec = dict(world_size=4, predicted_ms=10.0, measured_ms=11.0, rel_error=10 / 11 - 1, measured_ms_rounds=[11.0],
               host_ms=0.5)
    few = dict(rec, strategy="bucketed", outran_link=0.1)
    assert "outran" not in format_validation([few])
    assert "outran" not in format_validation([dict(rec, strategy="fsdp", outran_link=None)])  # no emulated link
    text = format_validation([few, dict(rec, strategy="fsdp", outran_link=0.6)])
    assert "(fsdp (4 ranks) 60%;" in text and "bucketed (4 ranks)" not in text
    assert "that row checks the fitted transport" in " ".join(text.split())


def test_the_validation_table_says_what_each_column_is_and_how_near_the_model_came():
    """One model column and one error (model / measured - 1), the rounds' range and spread beside
    the median, and under each world size the mean and worst error and the two orders."""
    from ddpkit.costmodel.validate import format_validation, summary

    def rec(name, predicted, rounds, n=2):
        measured = sorted(rounds)[len(rounds) // 2]
        return dict(strategy=name, world_size=n, predicted_ms=predicted, measured_ms=measured,
                    rel_error=predicted / measured - 1, measured_ms_rounds=rounds, host_ms=1.0)

    records = [rec("bucketed", 10.5, [10.0, 10.0, 10.2]), rec("fsdp", 19.0, [18.0, 20.0, 24.0]),
               rec("zero1", 9.0, [9.5, 9.6, 9.55])]
    text = format_validation(records)
    head = text.splitlines()[0].split()
    assert head == ["ranks", "strategy", "measured", "rounds", "(min-max)", "spread", "model", "error", "host", "work"]
    assert "from timings" not in text and text.count("error") >= 2
    row = next(line for line in text.splitlines() if " fsdp " in line).split()
    assert row[2:7] == ["20.00", "18.0-24.0", "30%", "19.00", "-5%"]
    flat = " ".join(text.split())
    for words in ("error: model / measured - 1", "spread: (slowest - fastest) / measured", "the median of 3 rounds"):
        assert words in flat
    lines = summary(records)
    assert lines[0].startswith("mean |error| 5.3%, worst -5.8% (zero1)")  # (5% + 5% + 5.8%) / 3, the worst
    assert "measured order zero1 < bucketed < fsdp, the model's the same" in lines[0]
    assert lines[1] == "rounds spread wider than 5%: fsdp; the model inside their range: fsdp"
    swapped = summary([rec("bucketed", 12.0, [10.0]), rec("zero1", 11.0, [11.0])])
    assert swapped[0].endswith("measured order bucketed < zero1, the model's zero1 < bucketed") and len(swapped) == 1


def test_fsdp_switches_are_what_the_simulation_runs():
    """The table's fsdp row describes what our FSDP does (backward prefetch only); flipping a
    switch changes the prediction the way it changes the run."""
    from dataclasses import replace

    p = cm.uniform_profile(8, 4 * 1024 * 1024, forward_ms=2.0)  # big layers: communication matters
    row = strategy("fsdp").cost
    assert (row.forward_prefetch, row.backward_prefetch, row.limit_all_gathers) == (False, True, None)

    def ms(**switches):
        return cm.simulate("fsdp", p, 4, NET, cost=replace(row, **switches)).ms_per_step

    assert ms(forward_prefetch=True) < ms()                  # forward all-gathers hidden too
    assert ms(backward_prefetch=False) > ms()
    assert ms(forward_prefetch=True, limit_all_gathers=1) == pytest.approx(ms(backward_prefetch=False))
    assert ms(forward_prefetch=True, limit_all_gathers=2) == pytest.approx(ms(forward_prefetch=True))


def test_hybrid_sharding_follows_the_networks_nodes():
    """8 ranks as 2 nodes x 4 (the network's gpus_per_node): 3 collectives among 4 ranks of a node
    (3 * 3/4 * S) plus an all-reduce of a quarter of the model between 2 replicas (2 * 1/2 * S/4):
    2.5 S. The default layout (nodes of 2) would be 3 * 1/2 * S + 2 * 3/4 * S/2 = 2.25 S."""
    p = _mlp_like()
    s = p.param_bytes
    nodes_of_4 = Network.of("10GbE", gpus_per_node=4)
    assert cm.simulate("hsdp", p, 8, nodes_of_4).comm_bytes_per_step == pytest.approx(2.5 * s)
    assert cm.simulate("hsdp", p, 8, "10GbE").comm_bytes_per_step == pytest.approx(2.25 * s)
    # the optimizer steps a node's share: 1/4 of it, as memory and the run do
    assert cm.simulate("hsdp", p, 8, nodes_of_4).compute_ms == pytest.approx(
        (p.forward_s + p.backward_s + p.optimizer_s / 4) * 1e3)


def test_predict_keeps_hybrid_sharding_on_odd_nodes_and_refuses_what_cannot_be_laid_out():
    p = _mlp_like()
    nodes_of_3 = Network.of("10GbE", gpus_per_node=3)
    rows = cm.predict(p, ["fsdp", "hsdp"], [3, 6], nodes_of_3)
    assert [(r.world_size, r.strategy) for r in rows] == [(3, "fsdp"), (3, "hsdp"), (6, "fsdp"), (6, "hsdp")]
    with pytest.raises(ValueError, match="hsdp shards inside nodes: .* 3 is not a multiple of 2"):
        cm.predict(p, ["fsdp", "hsdp"], [3], "10GbE")


def test_scaling_plot_starts_hybrid_sharding_at_its_first_whole_node():
    import matplotlib

    matplotlib.use("Agg")
    from ddpkit.viz import plot_scaling

    fig = plot_scaling(_mlp_like(), strategies=("fsdp", "hsdp"), networks=(NET,))
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert set(lines) == {"fsdp", "hsdp (from 2 ranks)"}
    assert list(lines["hsdp (from 2 ranks)"].get_xdata()) == [2, 4, 8, 16, 32, 64, 128, 256]
    assert lines["hsdp (from 2 ranks)"].get_ydata()[0] == pytest.approx(100)


def test_a_wrappers_host_work_is_spread_over_the_layers_compute():
    p = _mlp_like()
    compute = p.forward_s + p.backward_s
    more = p.with_host(0.25 * compute)
    assert more.forward_s + more.backward_s == pytest.approx(1.25 * compute)
    for a, b in zip(p.layers, more.layers, strict=True):  # in proportion: every layer 1.25x
        assert (b.forward_s, b.backward_s) == pytest.approx((1.25 * a.forward_s, 1.25 * a.backward_s))
        assert b.param_bytes == a.param_bytes and b.unit == a.unit
    assert more.optimizer_s == p.optimizer_s and p.with_host(0.0) is p and p.with_host(-1.0) is p
    for s in ("bucketed", "overlapped", "fsdp"):  # one rank: the step grows by exactly that work
        assert cm.simulate(s, more, 1, NET).ms_per_step == pytest.approx(
            cm.simulate(s, p, 1, NET).ms_per_step + 0.25 * compute * 1e3)


def test_each_rank_times_the_wrappers_alone_without_its_peers(cluster_of):
    def job():
        from ddpkit import rankside

        def sent():
            return sum(c[1] for c in rankside.comm().snapshot().values())

        before = sent()
        out = cm.wrapper_job({"ddp": ("bucketed", {}), "sharded": ("fsdp", {"reshard_after_forward": True})},
                             "mlp", 4, model_kwargs=dict(width=16, depth=2), steps=2)
        return out, sent() - before

    for per_step, sent in cluster_of(2).run(job):
        assert set(per_step) == {"ddp", "sharded"} and all(0 < t < 5 for t in per_step.values())
        assert sent == 0  # alone: every collective ran over a group of one, no byte crossed to the peer


def test_at_wait_the_rank_moves_the_bytes_when_it_waits():
    """``Route.at_wait`` (the emulated network card: an emulated link over the shared-memory
    transport, ``Link.transport``): an issue costs the rank nothing, the bytes move
    when it waits, beside the link's time; torch's DDP (futures) has the link's thread move them
    after the link delivered. Without the rule, a host transport's work is charged at the issue."""
    p = _mlp_like()  # 8 MiB of gradients, 6.4 ms of backward
    shm = Link("shm", alpha=0.0, beta=1 / 4e9, host=True)  # ~0.26 ms a 1 MiB bucket
    at_wait = dataclasses.replace(shm, transport="shm")
    moved = 8 * Network("paper").with_floor(shm).transport_time("all_reduce", 1024 * 1024, 2) * 1e3

    def step(strategy, network, floor):
        return cm.simulate(strategy, p, 2, Network(network).with_floor(floor), 1).ms_per_step

    # moved at the wait, the bytes never cost more than moved from the issue; on 10GbE (a bucket's
    # link time near its backward) they hide under the link instead of slowing backward
    for network in ("paper", "10GbE", "30,2", "0,1000"):
        assert step("overlapped", network, at_wait) <= step("overlapped", network, shm) + 1e-9
    assert step("overlapped", "10GbE", at_wait) < step("overlapped", "10GbE", shm) - 0.2
    # a link faster than the transport: the rank moves every byte itself, after backward
    compute = (p.forward_s + p.backward_s + p.optimizer_s) * 1e3
    assert step("overlapped", "0,1000", at_wait) == pytest.approx(compute + moved)
    # torch's DDP: the link's thread moves each bucket after delivering it, the link busy meanwhile
    assert step("torch_ddp", "paper", at_wait) == pytest.approx(step("overlapped", "paper", at_wait) + moved)
    # a network that is not emulated: shared memory moves the bytes from the issue, at_wait is off
    assert step("overlapped", "loopback", at_wait) == step("overlapped", "loopback", shm)


def test_one_link_clock_in_issue_order_done_when_link_and_transfer_are():
    """``LinkClock``, the rule the emulator keeps and the cost model simulates: a collective starts
    on the link at its issue or when the link frees up, and completes when both the link and the
    real transfer are done; under at_wait the transfer is not the link's."""
    clock = LinkClock()
    assert clock.delivers(0.0, 2.0) == 2.0
    assert clock.complete(2.0, 1.0) == 2.0   # the transfer ended first: the link decides
    assert clock.delivers(1.0, 2.0) == 4.0   # issued while the link was busy: starts when it frees
    assert clock.complete(4.0, 5.0) == 5.0   # the transfer outran the link: busy until it ended
    assert clock.delivers(6.0, 1.0) == 7.0   # issued on an idle link: from the issue
    assert clock.complete(7.0) == 7.0        # at_wait: the rank moves the bytes, off the link


def test_each_link_keeps_its_own_clock_as_in_the_emulator():
    """Two tiers: a collective inside a node does not wait behind one across nodes (the emulator
    runs one thread per link); two on one link run one after the other."""
    net = Network.of("10GbE", gpus_per_node=2)
    stream, s = Stream(4, net), 2**20
    across = stream.issue("all_reduce", s, 0.0, [0, 2])
    inside = stream.issue("all_reduce", s, 0.0, [0, 1])
    assert across.end == pytest.approx(net.emulated_time("all_reduce", s, [0, 2]))
    assert inside.end == pytest.approx(net.emulated_time("all_reduce", s, [0, 1]))
    assert stream.issue("all_reduce", s, 0.0, [0, 2]).end == pytest.approx(2 * across.end)


def test_a_comm_hook_is_priced_by_its_row_on_the_buckets_that_take_one():
    """bf16_compress (``COMM_HOOKS``: 2 bytes an element, a cast down before the launch, a cast
    back and a copy into the bucket after the wait) halves the bytes of the buckets' all-reduce
    where the buckets take a hook; the others are as they were; one that takes none refuses it."""
    p = dataclasses.replace(_mlp_like(), copy_s_per_byte=1e-10)
    names = ["naive", "bucketed", "overlapped", "sharded_optimizer", "zero1"]
    plain = {r.strategy: r for r in cm.predict(p, names, [4], "10GbE")}
    hooked = {r.strategy: r for r in cm.predict(p, names, [4], "10GbE", comm_hook="bf16_compress")}
    for s in ("bucketed", "overlapped"):
        assert hooked[s].comm_bytes_per_step == pytest.approx(plain[s].comm_bytes_per_step / 2)
        assert hooked[s].ms_per_step < plain[s].ms_per_step
    # the gradients' all-reduce halved, the parameters' all-gather as it was: 1.5x DDP becomes 1.0x
    assert hooked["sharded_optimizer"].comm_bytes_per_step == pytest.approx(plain["overlapped"].comm_bytes_per_step)
    assert hooked["naive"] == plain["naive"] and hooked["zero1"] == plain["zero1"]
    # on a link that costs nothing, the hook's three passes over the gradients are all it adds
    free, bf16 = Link("free", 0.0, 0.0), dataclasses.replace(strategy("bucketed").cost, comm_hook="bf16_compress")
    added = cm.simulate("bucketed", p, 2, free, cost=bf16).ms_per_step - cm.simulate("bucketed", p, 2, free).ms_per_step
    assert added == pytest.approx(3 * p.copy_s(p.param_bytes) * 1e3)
    with pytest.raises(ValueError, match="zero1 takes no communication hook.*those that do: bucketed"):
        cm.simulate("zero1", p, 2, cost=dataclasses.replace(strategy("zero1").cost, comm_hook="bf16_compress"))


def test_a_comm_hook_chains_on_futures_as_torchs_ddp():
    """Under at_wait a hooked bucket's bytes move on the link's thread when the link delivers (the
    hook's future is handed out, as torch's DDP's): the plain hook is on_futures, nothing more."""
    p = _mlp_like()
    at_wait = Network("paper").with_floor(Link("shm", alpha=0.0, beta=1 / 4e9, host=True, transport="shm"))
    cost = strategy("overlapped").cost
    hooked = cm.simulate("overlapped", p, 2, at_wait, 1, cost=dataclasses.replace(cost, comm_hook="allreduce"))
    on_futures = cm.simulate("overlapped", p, 2, at_wait, 1, cost=dataclasses.replace(cost, on_futures=True))
    assert hooked.ms_per_step == on_futures.ms_per_step != cm.simulate("overlapped", p, 2, at_wait, 1).ms_per_step


def test_a_hybrid_wrapper_is_timed_alone_as_the_rows_one_node_form():
    """A rank alone has no nodes: ``alone_as`` reads the table for the row that runs the same step
    on one node (same CostStep, same implementation), and leaves every other row as it is."""
    from ddpkit.costmodel.validate import _alone_as as alone_as

    for name in NAMES:
        row, alone = strategy(name), strategy(alone_as(name))
        assert not alone.hybrid and alone.cost == row.cost and alone.torch_native == row.torch_native
        assert (alone_as(name) == name) == (not row.hybrid)


def test_the_emulations_overhead_is_added_beyond_the_slower_of_link_and_transport():
    """``emulation_overhead`` measures what a collective waited for takes beyond the slower of the
    transport and the link; the stream adds it there, whichever of the two is slower (a fast link
    over a slow transport included), once per wait that moves the bytes."""
    s, wake = 1 << 20, 0.4e-3
    floor = Link("shm", 50e-6, 1 / 2e9, host=True, transport="shm")
    for net in ("10GbE", "0,1000"):  # a slow link, then one faster than the transport
        network = Network(net).with_floor(floor, wake)
        stream = Stream(2, network)
        done = stream.issue("all_reduce", s, 1.0)
        slower = max(network.transport_time("all_reduce", s, 2), network.emulated_time("all_reduce", s, [0, 1]))
        assert stream.wait(1.0, done) == pytest.approx(1.0 + slower + wake)
        assert stream.wait(5.0, done) == 5.0  # moved and delivered long ago: nothing more to wait for
