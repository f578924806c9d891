"""Issue 59: what a learner's mistakes, a Ctrl-C, a full disk or a shared run folder do. Each input gets
one clear message (no traceback), nothing is lost, and nothing in a file can run code.

- A script that ends with a Cluster still up exits cleanly (an atexit shutdown).
- Ctrl-C during ``python -m ddpkit compare``: "interrupted", the partial table, exit 130, no restart.
- ``ddpkit.record``: a read-only or full folder is refused before training; a disk that fills during
  training leaves no cut-off file; ``draw`` names a damaged, empty, text or pickled file, and a
  crafted pickle runs nothing; a wrapper built before the block is named as the cause.
- ``ddpkit.init_process_group`` times out as a Cluster does (60 s), not after torch's 30 minutes.
- Cluster, compare and predict arguments the machine or the library cannot take.
"""
from __future__ import annotations

import datetime
import math
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import pytest

import ddpkit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(ddpkit.__file__)))
ENV = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


def python(*args, timeout=180, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=ENV, timeout=timeout,
                          **kwargs)


# --------------------------------------------------------------------------- the end of a script, Ctrl-C
def test_a_script_ending_with_a_live_cluster_exits_cleanly():
    done = python("-c", "import ddpkit\nc = ddpkit.Cluster(2)\nprint(c.run(lambda: 7))\nraise SystemExit(0)")
    assert done.returncode == 0, done.stderr[-2000:]  # was 134: "Fatal Python error: _enter_buffered_busy"
    assert "[7, 7]" in done.stdout and "Fatal Python error" not in done.stderr and "Traceback" not in done.stderr


def test_ctrl_c_during_compare_is_one_line_the_partial_table_and_130():
    p = subprocess.Popen([sys.executable, "-m", "ddpkit", "compare", "--world-size", "2", "--strategies",
                          "naive,bucketed", "--steps", "2", "--rounds", "50"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    err, second_round = [], threading.Event()

    def read():
        for line in p.stderr:
            err.append(line)
            if "timing round 2" in line:
                second_round.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert second_round.wait(150), "".join(err)[-2000:]
    p.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    out = p.stdout.read()
    p.wait(timeout=60)
    took = time.monotonic() - t0
    reader.join(10)
    err = "".join(err)
    assert p.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "restarting" not in err and "cluster.restart" not in err, err[-2000:]
    assert [line for line in err.splitlines() if "interrupted" in line] == ["interrupted"]
    assert "naive" in out and "ms/step" in out  # the partial table: the rounds timed until then
    assert took < 20, took


# --------------------------------------------------------------------------- recordings
RECORD = """
import sys, torch, ddpkit
folder, store, how = sys.argv[1:]
ddpkit.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
if how == "before":
    model = ddpkit.OverlappedDDP(torch.nn.Linear(4, 1))
with ddpkit.record(folder):
    if how != "before":
        model = ddpkit.OverlappedDDP(torch.nn.Linear(4, 1))
    print("training", flush=True)
    for _ in range(2):
        model(torch.ones(2, 4)).sum().backward()
    if how == "fill":  # the disk fills up during training
        try:
            with open(folder + "/filler", "wb") as f:
                while True:
                    f.write(bytes(1 << 16)); f.flush()
        except OSError:
            pass
"""


def record(tmp_path, folder, how="inside") -> subprocess.CompletedProcess:
    return python("-c", RECORD, str(folder), str(tmp_path / f"store{time.monotonic_ns()}"), how)


def draw(folder) -> subprocess.CompletedProcess:
    return python("-m", "ddpkit", "draw", str(folder))


@pytest.fixture
def tmpfs(tmp_path):
    """A small filesystem of its own (mount needs root): ``mount(name, options)``."""
    mounted = []

    def mount(name, options):
        path = tmp_path / name
        path.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True).returncode:
            pytest.skip("cannot mount a tmpfs here (not root)")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", str(path)])


@pytest.mark.parametrize("options, why", [("ro,size=1m", "Read-only file system"),
                                          ("size=64k", "No space left on device")])
def test_a_folder_that_cannot_hold_the_records_is_refused_before_training(tmp_path, tmpfs, options, why):
    done = record(tmp_path, tmpfs("disk", options))
    assert done.returncode != 0 and "training" not in done.stdout, done.stdout  # refused before any step
    assert f"ddpkit.record cannot write its records in '{tmp_path / 'disk'}': {why}" in done.stderr


def test_a_disk_that_fills_during_training_leaves_no_cut_off_file(tmp_path, tmpfs):
    folder = tmpfs("disk", "size=1200k")  # room for the check, filled by the script's own "training"
    done = record(tmp_path, folder, "fill")
    assert done.returncode != 0 and f"ddpkit.record could not write {folder / 'rank0.records'}" in done.stderr
    assert sorted(os.listdir(folder)) == ["filler"]  # no rank0.records cut short, no temporary file


class Marker:
    """A pickle that creates a file when it is loaded without ``weights_only``."""

    path = ""

    def __reduce__(self):
        return open, (self.path, "w")


def bad_files(folder, marker):
    real = folder.parent / "real"
    Marker.path = str(marker)
    return {"empty": b"", "text": b"hello, I am a text file\n",
            "a pickle": pickle.dumps({"world_size": 1, "backend": "gloo", "records": [[1, 2]]}),
            "a crafted pickle": pickle.dumps({"world_size": 1, "backend": "gloo", "records": [Marker()]}),
            "cut off": (real / "rank0.records").read_bytes()[:600]}


def test_draw_names_a_file_that_is_not_a_recording_and_runs_nothing_in_it(tmp_path):
    assert record(tmp_path, tmp_path / "real").returncode == 0
    marker = tmp_path / "marker"
    for what, content in bad_files(tmp_path / "bad", marker).items():
        folder = tmp_path / what.replace(" ", "_")
        folder.mkdir()
        (folder / "rank0.records").write_bytes(content)
        done = draw(folder)
        last = done.stderr.strip().splitlines()[-1]
        assert done.returncode == 2 and "Traceback" not in done.stderr, (what, done.stderr[-2000:])
        assert last.startswith(f"python -m ddpkit: error: {folder / 'rank0.records'}: not a recording"), (what, last)
    assert not marker.exists()  # the crafted pickle's code did not run
    assert draw(tmp_path / "real").returncode == 0  # and a real recording draws


def test_a_wrapper_built_before_record_is_named_in_draws_message(tmp_path):
    assert record(tmp_path, tmp_path / "run", "before").returncode == 0
    done = draw(tmp_path / "run")
    assert done.returncode == 2 and "built before the block records nothing" in " ".join(done.stderr.split())


def test_init_process_group_times_out_as_a_cluster_does(monkeypatch):
    import torch.distributed as dist

    from ddpkit.comm import process_group

    seen = {}
    monkeypatch.setattr(process_group, "install", lambda *a: None)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(kw))
    ddpkit.init_process_group("gloo")
    assert seen["timeout"] == datetime.timedelta(seconds=60)  # was torch's 30 minutes
    ddpkit.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
    assert seen["timeout"] == datetime.timedelta(seconds=5)


# --------------------------------------------------------------------------- arguments
def test_cluster_arguments_the_machine_cannot_take():
    from ddpkit.cluster import check_arguments

    with pytest.raises(ValueError, match="timeout must be a positive, finite number"):
        check_arguments(2, timeout=math.inf)
    with pytest.raises(ValueError, match=r"cannot start 1000000 ranks: they need about \d+ .* it has \d+"):
        check_arguments(10**6)


def test_compare_refuses_what_is_not_a_list_of_strategies():
    from ddpkit.compare import compare

    for strategies in ([], "bucketed", None):
        with pytest.raises(ValueError, match="compare needs a list of strategy names"):
            compare(None, strategies)
    with pytest.raises(ValueError, match="unknown strategy 'bucketd'"):
        compare(None, ["bucketd"])
    with pytest.raises(ValueError, match="steps must be a whole number >= 1, got 0"):
        compare(None, ["naive"], steps=0)


@pytest.mark.parametrize("args, says", [
    (["--world-sizes", ","], "argument --world-sizes: expected comma-separated whole numbers >= 1"),
    (["--json", "p.json"], "--json writes the records --validate measures; add --validate"),
    (["--network", "-1,5"], "network '-1,5': latency must be >= 0 us"),
])
def test_predict_arguments_that_give_nothing(tmp_path, args, says):
    done = python("-m", "ddpkit", "predict", *args, cwd=tmp_path)
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert not (tmp_path / "p.json").exists() or args[0] != "--json"
