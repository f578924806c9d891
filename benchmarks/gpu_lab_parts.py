"""The parts of benchmarks/gpu_lab.sh that are easier in Python than in bash (docs/gpu.md).

    python benchmarks/gpu_lab_parts.py check-wheels DIR PYVER   # every wheel's needs carried or on the image
    python benchmarks/gpu_lab_parts.py install DIR TARGET       # the wheels this Python lacks, into TARGET
    python benchmarks/gpu_lab_parts.py env                      # device, torch, CUDA, NCCL: key=value lines
    python benchmarks/gpu_lab_parts.py snapshot PATH [--dry-run]  # a CUDA memory snapshot of one recorded run
    python benchmarks/gpu_lab_parts.py figures COMPARE_JSON     # compare's figures, one line per strategy

Only ddpkit's public names are used (``ddpkit.Cluster``, ``ddpkit.experiment.run_strategy``,
``ddpkit.memory``), and only the standard library and ``packaging`` (on the GPU image and
everywhere pip is) before the wheels are installed.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What the GPU image already holds that the carried wheels need (/work/.library/device/KINDS.md's
# package list, 2026-11-17): a wheel's requirement on one of these is met there.
ON_THE_IMAGE = {
    "attrs", "coverage", "packaging", "psutil", "pygments", "python-dateutil", "pytest", "six",
    "typing-extensions", "matplotlib", "numpy", "jinja2", "markupsafe", "pyyaml", "cloudpickle",
}
# Required by a carried wheel, but left out on purpose: ipykernel imports it only if present
# (its debugger, which nbval never asks for), and it is a few MB of compiled wheel.
LEFT_OUT = {"debugpy"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _wheel_name(path: Path) -> str:
    return _canonical(path.name.split("-")[0])


def _metadata(path: Path):
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(z.read(meta).decode())


# ----------------------------------------------------------------------------- check-wheels
def check_wheels(folder: str, pyver: str) -> int:
    """Every Requires-Dist of every wheel in ``folder`` that applies on CPython ``pyver`` on Linux
    (extras left out) names a carried wheel or a package of the image; else say which, exit 1."""
    from packaging.requirements import Requirement

    env = {"python_version": pyver, "python_full_version": f"{pyver}.0", "sys_platform": "linux",
           "platform_system": "Linux", "implementation_name": "cpython", "os_name": "posix",
           "platform_machine": "x86_64", "platform_python_implementation": "CPython", "extra": ""}
    wheels = sorted(Path(folder).glob("*.whl"))
    carried = {_wheel_name(w) for w in wheels}
    missing = []
    for w in wheels:
        for line in _metadata(w).get_all("Requires-Dist") or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(env):
                continue  # an extra, another platform or another Python
            name = _canonical(req.name)
            if name not in carried | ON_THE_IMAGE | LEFT_OUT:
                missing.append(f"{_wheel_name(w)} needs {req}")
    for m in missing:
        print(f"not carried and not on the image: {m}", file=sys.stderr)
    return 1 if missing else 0


# ----------------------------------------------------------------------------- install
def _kit_ranges() -> dict:
    """{canonical name: SpecifierSet} of the kit's own dependencies (pyproject.toml)."""
    from packaging.requirements import Requirement

    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    lines = [m.group(1) for m in re.finditer(r'^\s*"([^"]+)"', block, re.M)]
    return {_canonical(r.name): r.specifier for r in map(Requirement, lines)}


def install(folder: str, target: str) -> int:
    """Install into ``target`` the wheels of ``folder`` whose package this Python lacks, or holds in
    a version outside the kit's range: never a second copy of what the machine has (the target
    comes first on PYTHONPATH, so it would shadow the machine's own)."""
    from importlib.metadata import PackageNotFoundError, version

    ranges = _kit_ranges()
    take, kept = [], []
    for w in sorted(Path(folder).glob("*.whl")):
        name = _wheel_name(w)
        if name == "torch" or "torch" in name:
            raise SystemExit(f"{w.name}: torch is the machine's own; never carry it")
        try:
            have = version(name)
        except PackageNotFoundError:
            take.append(w)
            continue
        spec = ranges.get(name)
        if spec is not None and not spec.contains(have, prereleases=True):
            print(f"{name} {have} here is outside the kit's range {spec}: the carried wheel goes first")
            take.append(w)
        else:
            kept.append(f"{name} {have}")
    if kept:
        print(f"already here, not installed: {', '.join(kept)}")
    if not take:
        print("nothing to install")
        return 0
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--disable-pip-version-check", "--upgrade", "--target", target,
           *map(str, take)]
    done = subprocess.run(cmd, env=dict(os.environ, PIP_CONFIG_FILE=os.devnull))
    if done.returncode == 0:
        print(f"installed {len(take)} wheels into {target}: {', '.join(_wheel_name(w) for w in take)}")
    return done.returncode


# ----------------------------------------------------------------------------- env
def env() -> int:
    """key=value lines for the summary's head: what this machine is, what the kit sees."""
    import platform

    import torch

    import ddpkit

    cuda = torch.cuda.is_available()
    nccl = ""
    if cuda and torch.distributed.is_nccl_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    try:
        from importlib.metadata import version

        cloudpickle = version("cloudpickle")
    except Exception:  # noqa: BLE001 - only reported
        cloudpickle = "absent"
    rows = {
        "device": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if cuda else "no CUDA",
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none (a CPU build)",
        "nccl": nccl or "none",
        "python": f"{platform.python_version()} ({sys.executable})",
        "cpus": str(os.cpu_count()),
        "ddpkit": os.path.dirname(ddpkit.__file__),
        "cloudpickle": cloudpickle,
    }
    for k, v in rows.items():
        print(f"{k}={v}")
    return 0


# ----------------------------------------------------------------------------- snapshot
SNAPSHOT_STRATEGY = "fsdp"


def _recorded_run_in_a_snapshot(path: str) -> dict:
    """A Cluster job: one recorded FSDP run of the course's MLP, every CUDA allocation in it
    recorded into a memory snapshot at ``path`` (open it at https://pytorch.org/memory_viz)."""
    from ddpkit.experiment import run_strategy
    from ddpkit.memory import cuda_memory_snapshot

    with cuda_memory_snapshot(path, max_entries=50_000):
        out = run_strategy(SNAPSHOT_STRATEGY, steps=2, warmup=1, record=True, report_progress=False)
    return {"bytes": os.path.getsize(path), "peak_bytes": out["peak_bytes"], "memory": out["memory"][0]}


def snapshot(path: str, dry: bool = False) -> int:
    import ddpkit
    from ddpkit.experiment import run_strategy  # noqa: F401 - resolved before any rank starts
    from ddpkit.memory import cuda_memory_snapshot  # noqa: F401

    if dry:
        print(f"dry run: would record {SNAPSHOT_STRATEGY} on Cluster(1, backend='nccl') into {path}")
        return 0
    with ddpkit.Cluster(1, backend="nccl", timeout=60.0) as cluster:
        (out,) = cluster.run(_recorded_run_in_a_snapshot, os.path.abspath(path))
    mem = ", ".join(f"{k} {v}" for k, v in out["memory"].items())
    print(f"wrote {path}: {out['bytes']} B; {SNAPSHOT_STRATEGY} peak {out['peak_bytes']} B; step memory: {mem}")
    return 0


# ----------------------------------------------------------------------------- figures
def figures(path: str) -> int:
    """One line per strategy of a ``compare --json`` file: what docs/gpu.md's Results take."""
    for r in json.load(open(path)):
        if "error" in r:
            print(f"{r['strategy']:>18}  error: {r['error']}")
            continue
        mem = r["memory"][0] if r.get("memory") else {}
        cats = " ".join(f"{k}={v}" for k, v in mem.items())
        print(f"{r['strategy']:>18}  {r['ms_per_step']:8.2f} ms/step  sent {r['comm_bytes_per_step']} B/step  "
              f"peak {r['peak_bytes']} B  max|diff| {r['max_param_diff']:.1e}  {cats}")
    return 0


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    cmd, args = argv[0], argv[1:]
    if cmd == "check-wheels":
        return check_wheels(*args)
    if cmd == "install":
        return install(*args)
    if cmd == "env":
        return env()
    if cmd == "snapshot":
        return snapshot(args[0], dry="--dry-run" in args)
    if cmd == "figures":
        return figures(*args)
    print(f"unknown part {cmd!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
