"""benchmarks/gpu_lab.sh, the GPU lab in one call (docs/gpu.md), proven without a GPU: its dry run
resolves every part and writes the summary; a part that fails, hangs or leaves ranks behind is a
FAILED row, and the next part runs."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "benchmarks" / "gpu_lab.sh"


def _parts_module():
    spec = importlib.util.spec_from_file_location("gpu_lab_parts", ROOT / "benchmarks" / "gpu_lab_parts.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


parts = _parts_module()


def _wheel(folder: Path, name: str = "gpu_lab_probe", version: str = "1.0") -> Path:
    """A pure-Python wheel made here (CI reaches no index): one module, its dist-info."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {f"{name}.py": "VALUE = 42\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for n, text in {**files, f"{info}/RECORD": record}.items():
            z.writestr(n, text)
    return path


def _lab(*args, timeout=120):
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", str(LAB), *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout)


def _rows(summary: str) -> dict[str, str]:
    """{part: status} from summary.txt's rows (status in 8 columns, the name in the next 24)."""
    return {line[9:33].strip(): line[:8].strip() for line in summary.splitlines()
            if line[:8].strip() in ("ok", "FAILED", "SKIPPED")}


def test_the_dry_run_resolves_every_part_installs_the_wheels_and_writes_the_summary_in_seconds(tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _wheel(wheels)
    out = tmp_path / "out"
    t0 = time.monotonic()
    run = _lab("--dry-run", "--wheels", wheels, out)
    took = time.monotonic() - t0
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = (out / "summary.txt").read_text()
    head = summary.splitlines()
    assert head[0].startswith("ddpkit GPU lab, ") and "dry run" in head[0]
    assert head[2].startswith("torch ") and ", CUDA " in head[2] and ", NCCL " in head[2]
    rows = _rows(summary)
    names = ["carried wheels", "env"] + [p.name for p in parts.lab_parts(gpus=0)]
    assert list(rows) == names and set(rows.values()) == {"ok"}, summary
    assert "installed 1 of 1 carried wheels" in summary
    assert sum("dry run: python -m ddpkit" in line for line in head) >= 5
    assert sorted(p.name for p in out.iterdir()) == ["logs.txt", "summary.txt"]
    assert took < 60


def test_without_cuda_the_cuda_parts_say_so_and_a_spent_budget_skips_the_rest(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the lab would run its parts")
    out = tmp_path / "out"
    run = _lab("--wheels", tmp_path / "none", "--budget", "0", out)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = (out / "summary.txt").read_text()
    rows = _rows(summary)
    assert rows["carried wheels"] == "SKIPPED" and rows["env"] == "ok"
    for part in parts.lab_parts(gpus=0):
        assert rows[part.name] == "SKIPPED"
    lines = {line[9:33].strip(): line for line in summary.splitlines()}
    assert lines["compare on CUDA"].endswith("no CUDA") and lines["doctor"].endswith("budget is spent")
    assert "device: no CUDA GPU" in summary


def test_a_failing_or_hanging_part_is_a_failed_row_and_leaves_no_process_behind(tmp_path):
    lab = parts.Lab(out=tmp_path, work=tmp_path, dry=False, budget_s=60)
    # a rank-like child in a session of its own (as a Cluster's ranks are), which outlives its parent
    orphan = tmp_path / "orphan.pid"
    hang = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            f"time.sleep(60)'], start_new_session=True); open({str(orphan)!r}, 'w').write(str(p.pid)); "
            "time.sleep(60)")
    have = {"cuda": False, "nbval": False}
    lab.run_part(parts.Part("fails", [sys.executable, "-c", "print('step 1'); raise SystemExit('the reason')"], 30),
                 have)
    t0 = time.monotonic()
    lab.run_part(parts.Part("hangs", [sys.executable, "-c", hang], 3), have)
    assert time.monotonic() - t0 < 20
    lab.run_part(parts.Part("after", [sys.executable, "-c", "print('fine')"], 30), have)
    lab.run_part(parts.Part("on a GPU", [sys.executable, "-c", "pass"], 30, needs="cuda"), have)
    rows = {row[9:33].strip(): row for row in lab.rows}
    assert rows["fails"].startswith("FAILED") and rows["fails"].endswith("exit 1: the reason")
    assert rows["hangs"].startswith("FAILED") and "timed out after 3 s" in rows["hangs"]
    assert rows["after"].startswith("ok") and rows["after"].endswith("fine")
    assert rows["on a GPU"].startswith("SKIPPED") and rows["on a GPU"].endswith("no CUDA")
    pid = int(orphan.read_text())
    time.sleep(0.2)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    assert "===== fails:" in (tmp_path / "logs.txt").read_text()


def test_two_ranks_on_one_gpu_must_be_refused_with_the_kits_message():
    judge = parts._refused_two_ranks_on_one_gpu
    said = ("python -m ddpkit compare: error: backend='nccl' needs one GPU per rank: 2 rank(s) on this "
            "machine but 1 CUDA GPU(s) are visible; use backend='gloo' (CPU) or fewer ranks")
    ok, detail = judge(2, said)
    assert ok and detail.startswith("refused, as the kit says: backend='nccl' needs one GPU per rank")
    assert not judge(0, "trained")[0] and not judge(1, "Traceback ...\nRuntimeError: NCCL error")[0]


def test_the_lab_writes_at_most_8_files_and_carries_no_torch(tmp_path):
    written = {a.split("/")[-1] for p in parts.lab_parts(gpus=1) for a in p.argv if a.startswith("{out}/")}
    assert len(written | {"summary.txt", "logs.txt"}) <= 8
    (tmp_path / "torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"")
    with pytest.raises(SystemExit, match="never carry it"):
        parts.install(str(tmp_path), str(tmp_path / "site"))


def test_a_rerun_names_its_parts_and_a_wrong_name_is_refused_before_anything_runs(tmp_path):
    run = _lab("--only", "compare on CUDA,nope", tmp_path / "out")
    assert run.returncode == 2 and "no part called 'nope'" in run.stderr and "compare on CUDA" in run.stderr
    assert not (tmp_path / "out").exists()


def test_the_shared_gpu_parts_come_first_and_put_their_ranks_on_gpu_0():
    shared = [p.name for p in parts._shared_gpu_parts()]
    for gpus in (1, 2):  # on a machine with more GPUs too: GPU 0, shared
        assert [p.name for p in parts.lab_parts(gpus)][:len(shared)] == shared
    assert shared == ["transport on 1 GPU", "doctor", "shared-GPU tests", "compare, 4 ranks 1 GPU",
                      "10GbE on shared CUDA", "OOM message", "notebook 05, 1 GPU", "doctor, 4 ranks 1 GPU"]
    for p in parts._shared_gpu_parts():
        if "--gpus" in p.argv:
            assert set(p.argv[p.argv.index("--gpus") + 1].split(",")) == {"0"}, p
    # the tests that needed 2 GPUs run in the shared part (on ranks sharing one), not twice
    everything = next(p for p in parts.lab_parts(1) if p.name == "pytest -m gpu")
    assert all(f"--ignore={t}" in everything.argv for t in parts.SHARED_TESTS)


def test_a_rehearsal_runs_a_shared_gpu_part_on_cpu_ranks(tmp_path):
    lab = parts.Lab(out=tmp_path, work=tmp_path, dry=False, budget_s=60, stand_in=True)
    said = [sys.executable, "-c", "import sys; print(' '.join(sys.argv[1:]))"]
    lab.run_part(parts.Part("shared", [*said, "--world-size", "2", "--gpus", "0,0"], 30, needs="cuda"),
                 {"cuda": False, "nbval": False})
    (row,) = lab.rows
    assert row.startswith("ok") and row.endswith("--world-size 2 [stand-in: CPU ranks, not a shared GPU]")
