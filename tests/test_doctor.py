"""``python -m ddpkit doctor``: one row per feature, FAILED with the error's last line, exit 1."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from ddpkit import doctor as doctor_module
from ddpkit.doctor import default_checks, doctor


def _rows(lines) -> dict[str, str]:
    """{check name: "ok" | "FAILED"} from the printed rows (status in 7 columns, name in 28)."""
    return {line[10:38].strip(): line[2:9].strip() for line in lines
            if line.startswith("  ") and not line.startswith("  note")}


def test_the_fast_checks_pass_on_the_shared_cluster(cluster_of):
    lines = []
    status = doctor(cluster=cluster_of(2), only=["cluster", "strategy fsdp", "recording + streaming"],
                    out=lines.append)
    assert status == 0, "\n".join(lines)
    assert lines[0].startswith("ddpkit doctor: torch ")
    assert _rows(lines) == {"cluster": "ok", "strategy fsdp": "ok", "recording + streaming": "ok"}
    assert "fsdp" in lines[2] and "equals one process" in lines[2]
    assert lines[-1].startswith("3 of 3 checks ok (")


def _fails_on_the_ranks():
    return 1 / 0


def test_a_failing_feature_is_a_failed_row_with_its_last_line_and_the_status_is_1(cluster_of):
    def on_the_ranks(ctx):
        ctx.cluster.run(_fails_on_the_ranks)

    def here(ctx):
        raise AssertionError("several lines\nthe line that says what went wrong")

    lines = []
    checks = [("fine", lambda ctx: "all good"), ("on the ranks", on_the_ranks), ("here", here),
              ("after", lambda ctx: str(ctx.cluster.run(lambda: 2)))]
    assert doctor(cluster=cluster_of(2), checks=checks, out=lines.append) == 1
    rows = lines[1:-1]
    assert rows[0].split()[:2] == ["ok", "fine"] and rows[0].endswith("all good")
    assert rows[1].split()[0] == "FAILED" and rows[1].endswith("ZeroDivisionError: division by zero")
    assert rows[2].split()[0] == "FAILED" and rows[2].endswith("the line that says what went wrong")
    assert rows[3].split()[0] == "ok" and rows[3].endswith("[2, 2]")  # a failure does not stop the rest
    assert lines[-1].startswith("2 of 4 checks ok, 2 FAILED")


def test_every_strategy_has_a_row_and_an_unknown_name_is_refused_before_anything_starts():
    from ddpkit.strategies.table import NAMES

    names = [name for name, _ in default_checks(2)]
    assert names[0] == "cluster" and [f"strategy {n}" for n in NAMES] == names[1:1 + len(NAMES)]
    assert names[1 + len(NAMES):] == ["recording + streaming", "emulated network", "memory statistics", "compare"]
    assert "NCCL at 1 rank" in [name for name, _ in default_checks(2, one_gpu_only=True)]
    with pytest.raises(ValueError, match="no check called 'nonsense'; the checks: cluster, strategy naive"):
        doctor(only=["nonsense"], out=lambda line: None)


def test_the_command_exits_non_zero_when_a_feature_fails(monkeypatch, capsys):
    from ddpkit.__main__ import main

    def injected(ctx):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(doctor_module, "default_checks",
                        lambda ws, one_gpu_only=False: [("cluster", doctor_module._cluster), ("injected", injected)])
    assert main(["doctor", "--world-size", "1"]) == 1
    out = capsys.readouterr().out
    assert "ok      cluster" in out and "FAILED  injected" in out and "RuntimeError: injected failure" in out


def test_the_command_line_runs_a_check_and_refuses_a_bad_one():
    ok = subprocess.run([sys.executable, "-m", "ddpkit", "doctor", "--world-size", "1", "--only", "cluster"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "ok      cluster" in ok.stdout and "1 of 1 checks ok" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "ddpkit", "doctor", "--only", "clustr"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no check called 'clustr'" in bad.stderr


def test_gpus_that_do_not_exist_are_the_first_failed_row(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    lines = []
    assert doctor(gpus=[0, 1], only=["cluster"], out=lines.append) == 1
    assert lines[1].split()[:2] == ["FAILED", "cluster"] and "no CUDA GPU" in lines[1]


@pytest.mark.gpu
def test_the_doctor_passes_on_this_machines_gpus():
    lines = []
    status = doctor(world_size=min(2, torch.cuda.device_count()), out=lines.append)
    assert status == 0, "\n".join(lines)
    assert set(_rows(lines).values()) == {"ok"}
    assert any("cuda" in line for line in lines if "recording" in line or "NCCL" in line)  # CUDA events


def test_with_fewer_gpus_than_ranks_the_doctor_says_they_share_them(monkeypatch):
    from ddpkit.cluster import placement

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(placement, "nccl_version", lambda: (2, 28, 9))
    # what backend="auto" gives a learner with one GPU, in the note the doctor prints before its rows
    assert doctor_module._sharing(2) == "gloo, 2 ranks sharing GPU 0, bytes through CUDA IPC"
    assert doctor_module._sharing(4) == "gloo, 4 ranks sharing GPU 0, bytes through CUDA IPC"
    assert not doctor_module._on_gpu(SimpleNamespace(devices=["cpu", "cpu"]))
    assert doctor_module._on_gpu(SimpleNamespace(devices=["cuda:0", "cuda:0"]))
