"""python -m ddpkit compare / trace / predict: bad input fails fast, a short run reports sane figures."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import ddpkit
from ddpkit.__main__ import main
from ddpkit.strategies.table import NAMES
from ddpkit.compare import torch_reference
from ddpkit.strategies.table import strategy as strategy_row

REPO = os.path.dirname(os.path.dirname(os.path.abspath(ddpkit.__file__)))


@pytest.fixture
def no_cluster(monkeypatch):
    """Fail the test if a command starts ranks: bad arguments must be caught before that."""
    def refuse(*a, **k):
        raise AssertionError("a Cluster was started before the arguments were checked")

    monkeypatch.setattr(ddpkit, "Cluster", refuse)


def error_of(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, expected", [
    (["compare", "--strategies", "naive,bogus"], "unknown strategy 'bogus'; valid: " + ", ".join(NAMES)),
    (["compare", "--strategies", ""], "valid: naive"),
    (["compare", "--world-size", "0"], "--world-size: expected a whole number >= 1, got 0"),
    (["compare", "--steps", "two"], "--steps: expected a whole number >= 1, got 'two'"),
    (["compare", "--model", "resnet"], "--model 'resnet': not a built-in model (mlp, gpt) nor package.module:function"),
    # a workload by its function: imported and checked here, before any rank starts
    (["compare", "--model", "no_such_package.models:gpt2"], "cannot import 'no_such_package.models'"),
    (["trace", "--strategy", "fsdp", "--out", "t.json", "--model", "tests.hf_models:nope"],
     "tests.hf_models has no function 'nope'"),
    (["predict", "--model", "tests.hf_models:not_a_workload"],
     "not_a_workload() returned a dict, not a ddpkit.Workload"),
    (["compare", "--model", "tests.hf_models:gpt2_tiny", "--width", "8"], "--width/--depth size the built-in models"),
    (["compare", "--backend", "mpi"], "invalid choice: 'mpi'"),
    (["compare", "--bucket-cap-mb", "-1"], "expected a number of MiB >= 0"),
    (["compare", "--world-size", "3", "--global-batch-size", "32"],
     "a global batch of 32 does not split evenly over 3 ranks"),
    (["compare", "--json", "/nonexistent-dir/out.json"], "the folder '/nonexistent-dir' does not exist"),
    (["trace", "--strategy", "overlapped", "--out", "/nonexistent-dir/t.json"], "does not exist"),
    (["trace", "--strategy", "zero9", "--out", "t.json"], "invalid choice: 'zero9'"),
    (["trace", "--strategy", "naive"], "the following arguments are required: --out"),
    (["predict", "--network", "carrier-pigeon"], "valid presets: loopback, nvlink, 100GbE, 10GbE, 1GbE, paper"),
    (["predict", "--comm-hook", "int8"], "invalid choice: 'int8'"),
    (["compare", "--strategies", "naive,zero1", "--comm-hook", "bf16_compress"],
     "--comm-hook bf16_compress: none of naive, zero1 takes a communication hook; those that do: bucketed, "
     "overlapped, sharded_optimizer"),
    (["trace", "--strategy", "fsdp", "--out", "t.json", "--comm-hook", "fp16_compress"], "none of fsdp takes"),
    (["predict", "--world-sizes", "2,0"], "expected a whole number >= 1"),
    (["predict", "--world-sizes", "3", "--global-batch-size", "32"], "use --batch-per-rank"),
    (["predict", "--fit", "--fit-ranks", "1"], "--fit-ranks must be >= 2"),
    (["predict", "--fit", "--network", "0,0"], "valid presets"),
    (["predict", "--validate", "--fit"], "--validate fits the network and profiles compute"),
    (["predict", "--validate", "--batch-per-rank", "4"], "leave out --fit, --batch-per-rank"),
    (["predict", "--validate", "--json", "/nonexistent-dir/v.json"], "does not exist"),
    (["predict", "--validate", "--rounds", "0"], "expected a whole number >= 1"),
    # the library's checks, turned into the parser's errors: the Cluster's, the layout's
    (["compare", "--threads-per-rank", "-1"], "threads_per_rank must be None (cores / ranks), 0"),
    (["compare", "--world-size", "4", "--gpus-per-node", "3"], "gpus_per_node=3 does not divide world_size=4"),
    (["trace", "--strategy", "hsdp", "--world-size", "3", "--global-batch-size", "9", "--out", "t.json"],
     "hsdp shards inside nodes: with no two-tier network the ranks are laid out as nodes of 2"),
    (["predict", "--strategies", "hsdp", "--world-sizes", "3", "--batch-per-rank", "4"],
     "hsdp shards inside nodes"),
    (["predict", "--gpus-per-node", "3"], "gpus_per_node=3 does not divide world_size=2"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_bad_arguments_fail_before_any_rank_starts(argv, expected, capsys, no_cluster):
    assert expected in error_of(argv, capsys)


def test_unknown_arguments_are_refused_except_by_lab(capsys, no_cluster):
    assert "unrecognized arguments: --bogus 3" in error_of(["compare", "--bogus", "3"], capsys)


@pytest.mark.parametrize("command", ["compare", "trace", "predict"])
def test_help_never_cuts_a_strategy_name_at_the_edge_of_the_terminal(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")  # a narrow terminal; argparse reads it
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in NAMES), out  # "shard ed_optimizer" once


def test_lab_starts_jupyterlab_on_the_first_notebook_and_adds_allow_root_as_root():
    from ddpkit.lab import START, lab_command

    argv, note = lab_command(["--port", "8890"], as_root=True)
    assert argv[1:4] == ["-m", "jupyterlab", str(START)] and argv[4:6] == ["--port", "8890"]
    assert argv[-1] == "--allow-root" and "running as root" in note and "--allow-root" in note
    argv, note = lab_command([], as_root=False)
    assert "--allow-root" not in argv and note is None
    # served from the checkout, not notebooks/: the file browser reaches exercises/ and solutions/
    assert f"--ServerApp.root_dir={os.path.realpath(REPO)}" in argv
    argv, _ = lab_command(["--notebook-dir=/elsewhere"], as_root=False)  # the user's own root stays
    assert not any(a.startswith("--ServerApp.root_dir") for a in argv)
    argv, note = lab_command(["--allow-root"], as_root=True)  # given already: once, nothing to say
    assert argv.count("--allow-root") == 1 and note is None
    assert os.path.isfile(os.path.join(REPO, START))  # from this checkout


def test_lab_puts_its_interpreters_scripts_first_on_path(monkeypatch):
    """Started as .venv/bin/ddpkit lab without activating the venv, JupyterLab's kernels and what
    the notebooks start (torchrun) still find this Python's scripts: they come first, once."""
    import sysconfig

    import ddpkit.lab
    from ddpkit.lab import lab_environment

    scripts = sysconfig.get_path("scripts")
    env = lab_environment({"PATH": os.pathsep.join(["/usr/bin", scripts, "/bin"]), "HOME": "/home/x"})
    assert env["PATH"].split(os.pathsep) == [scripts, "/usr/bin", "/bin"] and env["HOME"] == "/home/x"
    assert lab_environment({})["PATH"] == scripts
    if os.name != "posix":
        return
    started = {}

    def execve(path, argv, env):  # what lab() would become: jupyter lab, with this environment
        started.update(argv=argv, env=env)
        raise SystemExit(0)

    monkeypatch.setattr(ddpkit.lab.os, "chdir", lambda path: started.update(cwd=path))
    monkeypatch.setattr(ddpkit.lab.os, "execve", execve)
    monkeypatch.setenv("PATH", "/usr/bin")
    with pytest.raises(SystemExit):
        ddpkit.lab.lab(["--no-browser"], out=lambda line: None)
    assert started["argv"][1:3] == ["-m", "jupyterlab"] and started["cwd"] == ddpkit.lab.checkout_root()
    assert started["env"]["PATH"].split(os.pathsep) == [scripts, "/usr/bin"]


def test_lab_outside_a_checkout_says_where_it_looked(tmp_path):
    from ddpkit.lab import lab_command

    with pytest.raises(FileNotFoundError, match="from a checkout of the repository.*" + str(tmp_path)):
        lab_command([], root=tmp_path)


def test_the_lab_command_passes_what_it_does_not_know_to_jupyter_lab(monkeypatch, capsys):
    import ddpkit.lab

    given = []
    monkeypatch.setattr(ddpkit.lab, "lab", lambda extra: given.append(extra) or 0)
    assert main(["lab", "--port", "8890", "--no-browser"]) == 0
    assert given == [["--port", "8890", "--no-browser"]]

    def not_a_checkout(extra):
        raise FileNotFoundError("no notebooks/00_start_here.ipynb next to the installed package")

    monkeypatch.setattr(ddpkit.lab, "lab", not_a_checkout)
    assert main(["lab"]) == 1
    assert "ddpkit lab: no notebooks/00_start_here.ipynb" in capsys.readouterr().err


def test_hybrid_sharding_on_nodes_that_fit_gets_as_far_as_the_cluster(no_cluster):
    with pytest.raises(AssertionError, match="a Cluster was started"):
        main(["compare", "--strategies", "fsdp,hsdp", "--world-size", "6", "--global-batch-size", "12",
              "--gpus-per-node", "3"])


def test_predict_lays_out_hybrid_sharding_on_the_nodes_given(capsys):
    """--gpus-per-node 3 (odd): hsdp is predicted at 3 and 6 ranks, not dropped; with the default
    strategies at 3 ranks and no nodes given, hybrid sharding is left out, saying why."""
    args = ["predict", "--width", "8", "--depth", "2", "--batch-per-rank", "4", "--network", "10GbE"]
    assert main([*args, "--strategies", "fsdp,hsdp", "--world-sizes", "3,6", "--gpus-per-node", "3"]) == 0
    out = capsys.readouterr().out
    assert "3 ranks per node" in out
    rows = [line.split()[:2] for line in out.splitlines() if line.split()[:1] in (["3"], ["6"])]
    assert rows == [["3", "fsdp"], ["3", "hsdp"], ["6", "fsdp"], ["6", "hsdp"]]
    assert main([*args, "--world-sizes", "3"]) == 0
    captured = capsys.readouterr()
    assert "left out: hsdp shards inside nodes" in captured.err and "left out: torch_hsdp" in captured.err
    predicted = [line.split()[1] for line in captured.out.splitlines() if line.split()[:1] == ["3"]]
    assert predicted == [s for s in NAMES if s not in ("hsdp", "torch_hsdp")]


def test_predicts_table_keeps_its_columns_and_says_what_the_default_cap_is(capsys):
    """Every name right-aligned under 'strategy', sharded_optimizer (the longest) too; the default
    bucket cap is spelled out (torch DDP's: 25 MiB, a first bucket of 1 MiB)."""
    assert main(["predict", "--width", "8", "--depth", "2", "--world-sizes", "2", "--strategies",
                 "bucketed,sharded_optimizer,torch_zero"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "bucket cap 25 MiB, the first bucket 1 MiB (torch DDP's default" in out[0]
    head = next(i for i, line in enumerate(out) if line.split()[:2] == ["ranks", "strategy"])
    table = out[head:head + 4]
    end = table[0].index("strategy") + len("strategy")
    assert [line[:end].split()[-1] for line in table[1:]] == ["bucketed", "sharded_optimizer", "torch_zero"]
    assert len({len(line) for line in table}) == 1, table  # every column in its place


def test_predict_with_a_comm_hook_halves_the_bytes_of_the_strategies_that_take_one(capsys):
    """--comm-hook bf16_compress: the header says so; bucketed sends half its bytes, naive (no
    buckets for a hook) as many as without it."""
    args = ["predict", "--width", "8", "--depth", "2", "--world-sizes", "2", "--strategies", "naive,bucketed"]
    sent = {}
    for hook in ([], ["--comm-hook", "bf16_compress"]):
        assert main([*args, *hook]) == 0
        out = capsys.readouterr().out.splitlines()
        assert ("comm hook bf16_compress" in out[0]) == bool(hook)
        sent[bool(hook)] = {line.split()[1]: " ".join(line.split()[-2:]) for line in out if line.split()[:1] == ["2"]}
    assert sent[True]["naive"] == sent[False]["naive"] and sent[True]["bucketed"] != sent[False]["bucketed"]


def test_output_path_that_is_a_directory_or_read_only(tmp_path, capsys, no_cluster):
    assert "is a directory" in error_of(["trace", "--strategy", "naive", "--out", str(tmp_path)], capsys)
    if os.geteuid() != 0:  # root may write anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        assert "not writable" in error_of(["compare", "--plot", str(ro / "x.png")], capsys)


def test_nccl_without_gpus_is_refused(capsys, no_cluster):
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 64:
        pytest.skip("this machine has the GPUs")
    assert "backend='nccl' needs one GPU per rank: 64 rank(s) on this machine" in error_of(
        ["compare", "--backend", "nccl", "--world-size", "64", "--global-batch-size", "64"], capsys)


def test_pinning_more_ranks_than_cores_is_refused(capsys, no_cluster):
    n = len(os.sched_getaffinity(0)) + 1
    for argv in (["compare", "--world-size", str(n), "--global-batch-size", str(4 * n), "--pin-cores"],
                 ["predict", "--validate", "--world-sizes", f"2,{n}", "--pin-cores"]):
        assert f"needs a core per rank: {n} ranks" in error_of(argv, capsys)
    # predict alone starts no ranks (but with --profile-on-ranks, which shares the cores as training would)
    assert "--pin-cores pins the ranks that --validate or --fit start" in error_of(
        ["predict", "--world-sizes", "2", "--pin-cores"], capsys)


def test_predict_prints_a_table_and_plots(tmp_path, capsys):
    import matplotlib

    matplotlib.use("Agg")
    png = tmp_path / "scaling.png"
    assert main(["predict", "--width", "16", "--depth", "3", "--world-sizes", "2,4",
                 "--strategies", "bucketed,overlapped,fsdp", "--network", "20,10", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["2"], ["4"])]
    assert [(r[0], r[1]) for r in rows] == [(n, s) for n in ("2", "4") for s in ("bucketed", "overlapped", "fsdp")]
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    by = {(r[0], r[1]): float(r[-2]) * scale[r[-1]] for r in rows}  # sent per step, binary units
    assert by[("2", "fsdp")] == pytest.approx(1.5 * by[("2", "overlapped")], rel=0.05)
    assert png.stat().st_size > 5000


def test_predict_profiles_a_workload_given_by_its_function(capsys):
    pytest.importorskip("transformers")
    assert main(["predict", "--model", "tests.hf_models:gpt2_tiny", "--world-sizes", "2", "--global-batch-size", "8",
                 "--strategies", "bucketed,fsdp"]) == 0
    out = capsys.readouterr().out
    assert "model gpt2-tiny" in out
    rows = {line.split()[1]: line.split() for line in out.splitlines() if line.split()[:1] == ["2"]}
    assert set(rows) == {"bucketed", "fsdp"}


def test_predict_validate_puts_predictions_beside_measurements(tmp_path):
    out = tmp_path / "validate.json"
    res = _cli("predict", "--validate", "--world-sizes", "2", "--strategies", "naive,bucketed,fsdp",
               "--width", "8", "--depth", "2", "--steps", "2", "--rounds", "1", "--global-batch-size", "8",
               "--json", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "calibrating collectives" in res.stderr  # the progress bar
    assert "reduce_scatter" in res.stdout and "KiB measured/fitted ms" in res.stdout
    records = json.loads(out.read_text())
    assert [(r["world_size"], r["strategy"]) for r in records] == [(2, "naive"), (2, "bucketed"), (2, "fsdp")]
    for r in records:
        assert r["predicted_ms"] > 0 and r["measured_ms"] > 0 and len(r["measured_ms_rounds"]) == 1
        assert r["rel_error"] == pytest.approx(r["predicted_ms"] / r["measured_ms"] - 1)
        assert f"{r['rel_error']:+.0%}" in res.stdout


def _cli(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "ddpkit", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def test_compare_short_run_writes_sane_records(tmp_path):
    strategies = list(NAMES)
    out = tmp_path / "compare.json"
    res = _cli("compare", "--world-size", "2", "--strategies", ",".join(strategies), "--width", "8",
               "--depth", "2", "--steps", "2", "--rounds", "1", "--global-batch-size", "8",
               "--json", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    for s in strategies:
        assert s in res.stdout
    assert "run 1/" in res.stderr and "timing round 1 of 1" in res.stderr  # the progress bar, labelled
    assert "lower is faster" in res.stdout and "peak: the most one rank held" in res.stdout
    records = json.loads(out.read_text())
    assert [r["strategy"] for r in records] == strategies
    param_bytes = 4 * (2 * (8 * 8 + 8) + 8 * 10 + 10)
    for r in records:
        assert "error" not in r, r
        assert r["world_size"] == 2
        assert r["ms_per_step"] > 0
        assert r["max_param_diff"] < 1e-5
        # torch's wrappers too: every collective passes through ddpkit's process group
        assert 0 <= r["overlap_fraction"] <= 1
        assert r["peak_bytes"] >= r["model_state_bytes"] > 0
        if r["strategy"] in ("naive", "bucketed", "overlapped"):
            assert r["comm_bytes_per_step"] == pytest.approx(param_bytes)  # 2(N-1)/N = 1 at N=2
        if r["strategy"] == "torch_ddp":  # + the broadcast of its rebuilt bucket order, once
            assert r["comm_bytes_per_step"] == pytest.approx(param_bytes, rel=0.02)
        if r["strategy"] in ("fsdp", "torch_fsdp"):
            assert r["comm_bytes_per_step"] == pytest.approx(1.5 * param_bytes, rel=0.05)
        # each strategy is compared with torch's wrapper of its own family only
        ref = torch_reference(r["strategy"])
        assert strategy_row(ref).torch_native and strategy_row(ref).family == strategy_row(r["strategy"]).family
        torch_ms = records[strategies.index(ref)]["ms_per_step"]
        assert r[f"vs_{ref}"] == r["vs_torch"] == pytest.approx(r["ms_per_step"] / torch_ms)
        assert [k for k in r if k.startswith("vs_torch_")] == [f"vs_{ref}"]


def test_trace_writes_a_chrome_trace(tmp_path):
    out = tmp_path / "trace.json"
    res = _cli("trace", "--strategy", "overlapped", "--world-size", "2", "--width", "8", "--depth", "2",
               "--steps", "2", "--global-batch-size", "8", "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    trace = json.loads(out.read_text())
    assert trace["distributedInfo"]["world_size"] == 2
    events = trace["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}
    assert any(e["ph"] == "X" and e["name"] == "all_reduce" for e in events)
    assert any(e["ph"] == "X" and e["name"] == "backward" for e in events)
    assert any(e["ph"] == "s" for e in events) and any(e["ph"] == "f" for e in events)  # ranks linked


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning 2 ranks needs 2 cores")
def test_compare_with_pinned_ranks_says_so():
    res = _cli("compare", "--world-size", "2", "--strategies", "bucketed", "--width", "8", "--depth", "2",
               "--steps", "1", "--rounds", "1", "--global-batch-size", "8", "--pin-cores")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "each rank pinned to its cores" in res.stdout and "bucketed" in res.stdout


def test_compare_on_a_two_tier_loopback(tmp_path):
    """--gpus-per-node with no --network: 4 ranks as 2 nodes x 2 on loopback, no link emulated.
    Hybrid sharding keeps its all-gathers and reduce-scatters inside a node and sends fewer bytes
    per rank than FSDP over all 4 (2 S against 2.25 S, padding aside)."""
    out = tmp_path / "compare.json"
    res = _cli("compare", "--world-size", "4", "--gpus-per-node", "2", "--strategies", "fsdp,hsdp",
               "--width", "8", "--depth", "2", "--steps", "1", "--rounds", "1", "--global-batch-size", "8",
               "--json", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "4 ranks (gloo, bytes through shared memory) on loopback (no emulated link), 2 ranks per node" in res.stdout
    fsdp, hsdp = json.loads(out.read_text())
    assert "error" not in fsdp and "error" not in hsdp, (fsdp, hsdp)
    assert hsdp["comm_bytes_per_step"] < fsdp["comm_bytes_per_step"]
