"""The benchmarks run: each one, tiny, end to end in a fresh interpreter (their figures are for
people to read, not for tests; a refactor must not leave one that no longer starts)."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"

TINY = {
    "bench_cluster.py": (["--repeats", "1", "--round-trips", "5"], "first 8 calls"),
    "bench_costmodel.py": (["--world-sizes", "2", "--runs", "1", "--rounds", "1", "--steps", "1", "--strategies",
                            "bucketed,fsdp", "--width", "16", "--depth", "2", "--phases"],
                           "error = model / measured - 1"),
    "bench_contention.py": (["--world-sizes", "2", "--chunks-ms", "0.5", "--iters", "10", "--repeats", "1"],
                            "sync cost per iteration"),
    "bench_desync.py": (["--rounds", "2", "--steps", "1", "--strategies", "overlapped"], "detection costs"),
    # fresh processes per wrapper (the user's case): torch and one wrapper of ours keep it short
    "bench_drop_in.py": (["--rounds", "1", "--steps", "1", "--models", "few", "--wrappers", "torch_ddp,overlapped"],
                         "ranks on plain gloo"),
    "bench_live.py": (["--rounds", "2", "--steps", "2"], "recording + streaming + live widget"),
    "bench_overlap.py": (["--networks", "10GbE", "--rounds", "1", "--steps", "1"], "overlapped's gradient hooks"),
    "bench_process_group.py": (["--rounds", "2", "--steps", "2"], "the layer costs"),
    "bench_recording.py": (["--rounds", "2", "--steps", "2", "--width", "32", "--depth", "2"], "recording costs"),
    # without a GPU its ranks are CPU ranks standing in: it starts, and says so
    "bench_shared_gpu.py": (["--world-sizes", "2", "--sizes", "4K", "--rounds", "1", "--iters", "1"],
                            "bus bandwidth in GB/s"),
    "bench_stagger.py": (["--world-sizes", "2", "--strategies", "bucketed", "--steps", "2"], "least"),
    "bench_transport.py": (["--rounds", "2", "--iters", "1", "--sizes", "4K,64K", "--candidates", "gloo,shm",
                            "--collectives", "all_reduce,broadcast"], "all-reduce through a Cluster"),
}


def _run(name, args):
    return subprocess.run([sys.executable, str(BENCHMARKS / name), *args], capture_output=True, text=True,
                          timeout=180)


def test_every_benchmark_is_covered():
    assert sorted(p.name for p in BENCHMARKS.glob("bench_*.py")) == sorted(TINY)


@pytest.mark.parametrize("name", sorted(TINY))
def test_a_benchmark_runs_and_prints_its_figure(name):
    args, figure = TINY[name]
    run = _run(name, args)
    assert run.returncode == 0, run.stderr[-3000:]
    assert figure in run.stdout, run.stdout


@pytest.mark.parametrize("name", ["bench_desync.py", "bench_live.py", "bench_process_group.py", "bench_recording.py",
                                  "bench_transport.py"])
def test_one_round_is_refused_before_any_rank_starts(name):
    run = _run(name, ["--rounds", "1"])
    assert run.returncode == 2 and "--rounds >= 2" in run.stderr, run.stderr


def test_an_unknown_network_is_refused_before_any_rank_starts():
    run = _run("bench_overlap.py", ["--networks", "10GbE,wifi"])
    assert run.returncode == 2 and "unknown network 'wifi'" in run.stderr, run.stderr


def test_the_overlap_bound_counts_the_links_capacity():
    """bench_overlap's limit: the link delivers the last bucket no sooner than the first bucket is
    full and every bucket has been carried after it, back to back, nor before the last is full."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from bench_overlap import link_done_ms
    finally:
        sys.path.remove(str(BENCHMARKS))
    even = [0.25] * 4
    assert link_done_ms([1.0] * 4, even, 10.0) == 11.0        # a fast link: the last bucket after backward
    assert link_done_ms([5.0] * 4, even, 10.0) == 2.5 + 20.0  # a slow one: from the first bucket, 4 x 5 ms
    assert link_done_ms([3.0], [1.0], 10.0) == 13.0           # one bucket: launched when backward ends


def test_the_stagger_lead_is_the_link_time_run_after_the_last_rank_joined():
    """bench_stagger's figure: per collective of the whole world, (first completion - last issue) /
    link time, the i-th collective of every rank matched; unfinished, subgroup and parted ones left out."""
    import ddpkit

    sys.path.insert(0, str(BENCHMARKS))
    try:
        from bench_stagger import leads
    finally:
        sys.path.remove(str(BENCHMARKS))
    net = ddpkit.Network.of("10GbE")
    mib = 1 << 20
    t = round(net.emulated_time("all_reduce", mib, range(2)) * 1e9)  # the link's time, ns
    rank0 = [(0, 2 * t, "all_reduce", mib, 2), (3 * t, None, "all_reduce", mib, 2), (4 * t, 5 * t, "all_reduce", 4, 1),
             (6 * t, 8 * t, "all_gather", mib, 2)]
    rank1 = [(t // 2, 2 * t + 5, "all_reduce", mib, 2), (3 * t, 4 * t, "all_reduce", mib, 2),
             (4 * t, 5 * t, "all_reduce", 4, 1), (6 * t, 8 * t, "all_reduce", mib, 2)]
    staggers, lead = leads([rank0, rank1], net, 2)
    assert lead == [pytest.approx(1.5)]          # the link ran 1.5 link-times after rank 1 joined
    assert staggers == [pytest.approx(t / 2 / 1e6)]  # rank 1 issued half a link-time after rank 0
