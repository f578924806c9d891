"""The GPU lab's parts and their runner: what ``bash benchmarks/gpu_lab.sh OUTDIR`` runs (docs/gpu.md).

    python benchmarks/gpu_lab_parts.py run OUTDIR [--dry-run | --stand-in] [--only A,B] [--wheels DIR] [--budget S]
    python benchmarks/gpu_lab_parts.py check-wheels DIR PYVER   # every wheel's needs carried or on the image
    python benchmarks/gpu_lab_parts.py install DIR TARGET       # the wheels this Python lacks, into TARGET
    python benchmarks/gpu_lab_parts.py env                      # device, torch, CUDA, NCCL: key=value lines
    python benchmarks/gpu_lab_parts.py snapshot PATH [--dry-run]  # a CUDA memory snapshot of one recorded run
    python benchmarks/gpu_lab_parts.py oom [--dry-run]          # a rank past its capped share of a shared GPU
    python benchmarks/gpu_lab_parts.py figures COMPARE_JSON     # compare's figures, one line per strategy

``run`` installs the carried wheels (those this Python lacks), then runs each part (``lab_parts``)
in its own process, under its own timeout and the lab's budget, its output appended to
OUTDIR/logs.txt, and writes OUTDIR/summary.txt: one line per part, ``ok``, ``FAILED`` or
``SKIPPED`` with the line that says why, under the device, torch, CUDA and NCCL versions and the
date. Parts that need CUDA are skipped without it, saying so. ``--dry-run`` (seconds, for CI)
installs the wheels if their folder is there, then resolves every part's command without running
it: the ddpkit command lines parsed by the CLI's own parser, pytest's paths and plugins found.
``--stand-in`` (a rehearsal on a machine without CUDA) runs the CUDA parts that can run on the
CPU there, on gloo, to prove their plumbing (files written, figures read back); their rows say
"stand-in", and they prove nothing of CUDA. ``--only`` runs the parts named (as the summary
names them, comma-separated): a rerun of those that failed, in the minutes a lease has left.

The runner itself never imports torch (it holds no CUDA context on the GPU it lends the parts),
and the parts use ddpkit only through its command line and public names (``ddpkit.Cluster``,
``ddpkit.experiment.run_strategy``, ``ddpkit.memory``).
"""
from __future__ import annotations

import datetime
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field, replace
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = "benchmarks/gpu_lab_parts.py"
NOTEBOOKS = ["00_start_here", "02_naive_ddp", "04_overlap"]  # and 05, early, on ranks sharing the GPU
SHARED_TESTS = ["tests/test_shared_gpu.py", "tests/test_gpu_paths.py"]  # -m gpu: ranks sharing GPU 0 where one
BUDGET_S = 450  # the parts' share of a 10-minute device call: under 8 minutes with the install

# What the GPU image already holds that the carried wheels need (/work/.library/device/KINDS.md's
# package list, 2026-11-17): a wheel's requirement on one of these is met there.
ON_THE_IMAGE = {
    "attrs", "coverage", "packaging", "psutil", "pygments", "python-dateutil", "pytest", "six",
    "typing-extensions", "matplotlib", "numpy", "jinja2", "markupsafe", "pyyaml", "cloudpickle",
}
# Required by a carried wheel, but left out on purpose: ipykernel imports it only if present
# (its debugger, which nbval never asks for), and it is a few MB of compiled wheel.
LEFT_OUT = {"debugpy"}


# ============================================================================= the parts
@dataclass
class Part:
    """One check: ``argv`` run from the repo root (``{out}`` in an argument: OUTDIR), at most
    ``timeout_s`` seconds. ``needs``: "cuda" (skipped without a GPU), "nbval" (skipped where
    nbval cannot be imported: the wheels were not carried), or both ("cuda,nbval"). ``judge(rc, text)`` -> (ok, detail)
    for a part whose success is not exit status 0; ``figures(out)`` -> extra summary lines."""

    name: str
    argv: list[str]
    timeout_s: int
    needs: str = ""
    judge: object = None
    figures: object = None
    note: str = ""  # said on the part's line when it ran, e.g. what one GPU cannot show


def _ddpkit(*args) -> list[str]:
    return [sys.executable, "-m", "ddpkit", *args]


def _refused_two_ranks_on_one_gpu(rc: int, text: str) -> tuple[bool, str]:
    """With one GPU, asking NCCL for two ranks must be refused before any rank starts (exit 2,
    argparse's convention) with the kit's message: NCCL refuses two ranks on one device."""
    said = [line for line in text.splitlines() if "error:" in line]
    if rc == 2 and said and "one GPU per rank" in said[-1]:
        return True, f"refused, as the kit says: {said[-1].split('error:', 1)[1].strip()}"
    return False, f"expected the kit's refusal (exit 2, 'one GPU per rank'), got exit {rc}: {_why(text)}"


def _figures_of(name: str, part: str):
    """The summary's lines for a ``compare --json`` file ``name`` that part ``part`` wrote."""
    def figures(out: Path) -> list[str]:
        path = out / name
        if not path.exists():
            return []
        return [f"figures of '{part}' (MiB per rank; ms/step: the median of the rounds; peak: on CUDA the "
                "allocator's; after |: rank 0's last recorded step by category, cuda_context: outside the "
                "allocator)"] + _figure_lines(path)
    return figures


def _shared_gpu_parts() -> list[Part]:
    """Ranks sharing GPU 0: the course on CUDA ranks for a learner with one GPU (every part names its
    ranks' GPUs, so on a machine with more it still shares GPU 0)."""
    out = "{out}"
    return [
        # which transport moves bytes between ranks on one GPU fastest: the default is to be confirmed here
        Part("transport on 1 GPU", [sys.executable, "benchmarks/bench_shared_gpu.py", "--world-sizes", "2,4",
                                    "--sizes", "4K,1M,64M", "--rounds", "2", "--iters", "5"], 150, needs="cuda"),
        # as an instructor runs it: on one GPU, 2 ranks sharing it (auto), and NCCL at 1 rank
        Part("doctor", _ddpkit("doctor"), 150),
        # every strategy, ours and torch's, at 2 and 4 ranks on the GPU; each transport exact; desync;
        # memory against the formulas; the capped OOM; the tests that needed 2 GPUs, on ranks sharing one
        Part("shared-GPU tests", [sys.executable, "-m", "pytest", "-o", "addopts=", "-m", "gpu", *SHARED_TESTS, "-q",
                                  "-rs", "-p", "no:cacheprovider", "--timeout", "120"], 240, needs="cuda"),
        Part("compare, 4 ranks 1 GPU", _ddpkit("compare", "--world-size", "4", "--gpus", "0,0,0,0", "--steps", "5",
                                               "--rounds", "1", "--json", f"{out}/compare_shared.json"),
             150, needs="cuda", figures=_figures_of("compare_shared.json", "compare, 4 ranks 1 GPU")),
        # the emulated link waits on CUDA collectives (a ring of one rank sent nothing: unproven until now)
        Part("10GbE on shared CUDA", _ddpkit("compare", "--world-size", "2", "--gpus", "0,0", "--network", "10GbE",
                                             "--strategies", "overlapped,fsdp", "--steps", "3", "--rounds", "1"),
             90, needs="cuda"),
        Part("OOM message", [sys.executable, HERE, "oom"], 60, needs="cuda"),
        Part("notebook 05, 1 GPU", [sys.executable, "-m", "pytest", "-q", "--nbval-lax", "--nbval-current-env",
                                    "-p", "no:cacheprovider", "--timeout", "240", "notebooks/05_zero_and_fsdp.ipynb"],
             150, needs="cuda,nbval"),
        Part("doctor, 4 ranks 1 GPU", _ddpkit("doctor", "--world-size", "4", "--gpus", "0,0,0,0"), 150,
             needs="cuda"),
    ]


def lab_parts(gpus: int) -> list[Part]:
    """The parts, most telling first (the budget may cut the last ones), sized for one H100.
    ``gpus``: CUDA devices visible (0: the CPU, where the CUDA parts are skipped)."""
    out = "{out}"
    parts = _shared_gpu_parts() + [
        # every strategy on NCCL (one rank, the whole batch), each equal to one process
        Part("doctor at 1 rank on NCCL", _ddpkit("doctor", "--world-size", "1"), 150, needs="cuda"),
        Part("compare on CUDA", _ddpkit("compare", "--world-size", "1", "--backend", "nccl", "--steps", "5",
                                        "--rounds", "3", "--json", f"{out}/compare.json"),
             180, needs="cuda", figures=_figures_of("compare.json", "compare on CUDA")),
        Part("trace on CUDA", _ddpkit("trace", "--strategy", "overlapped", "--world-size", "1", "--backend",
                                      "nccl", "--out", f"{out}/trace.json"), 90, needs="cuda"),
        Part("CUDA memory snapshot", [sys.executable, HERE, "snapshot", f"{out}/snapshot.pickle"], 90,
             needs="cuda"),
        # addopts cleared: pyproject's adds nbval's options, which these tests do not need (a test
        # module that cannot be imported, e.g. without the carried nbformat, is counted an error,
        # and the GPU tests still run)
        Part("pytest -m gpu", [sys.executable, "-m", "pytest", "-o", "addopts=", "-m", "gpu", "tests/", "-q",
                               "-rs", "-p", "no:cacheprovider", "--timeout", "120",
                               *[f"--ignore={t}" for t in SHARED_TESTS],  # run above
                               "--continue-on-collection-errors"], 180, needs="cuda"),
    ]
    if gpus >= 2:
        parts += [
            Part("emulated 10GbE on NCCL", _ddpkit("compare", "--world-size", "2", "--backend", "nccl",
                                                   "--network", "10GbE", "--strategies", "overlapped,fsdp",
                                                   "--steps", "3", "--rounds", "1"), 120, needs="cuda"),
            Part("2 ranks on NCCL", _ddpkit("compare", "--world-size", "2", "--backend", "nccl", "--strategies",
                                            "naive,overlapped,zero2,fsdp", "--steps", "3", "--rounds", "1"),
                 120, needs="cuda"),
        ]
    else:  # NCCL itself still refuses two ranks on one GPU (the kit shares it through its own transport)
        at = len(_shared_gpu_parts())
        parts[at:at] = [
            Part("2 ranks on one GPU", _ddpkit("compare", "--world-size", "2", "--backend", "nccl", "--strategies",
                                               "overlapped", "--steps", "1", "--rounds", "1"), 60, needs="cuda",
                 judge=_refused_two_ranks_on_one_gpu),
        ]
    parts += [
        Part("notebooks under nbval", [sys.executable, "-m", "pytest", "-q", "--nbval-lax", "--nbval-current-env",
                                       "-p", "no:cacheprovider", "--timeout", "240",
                                       *[f"notebooks/{n}.ipynb" for n in NOTEBOOKS]], 300, needs="nbval"),
    ]
    return parts


# ============================================================================= the runner
@dataclass
class Lab:
    out: Path
    work: Path
    dry: bool
    budget_s: float
    stand_in: bool = False
    mode: str = ""
    facts: dict = field(default_factory=dict)  # the env part's key=value lines
    started: float = field(default_factory=time.monotonic)
    rows: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    counts: dict = field(default_factory=lambda: {"ok": 0, "FAILED": 0, "SKIPPED": 0})
    serial: int = 0

    @property
    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def log(self, text: str) -> None:
        with open(self.out / "logs.txt", "a") as f:
            f.write(text)

    def record(self, status: str, name: str, seconds: float, detail: str, more=()) -> None:
        self.counts[status] += 1
        row = f"{status:<8} {name:<24} {seconds:5.0f} s  {detail}"
        self.rows.append(row)
        self.rows.extend(f"{'':<8} {'':<24}          {line}" for line in more)
        print(f"[{time.monotonic() - self.started:4.0f} s] {row}", flush=True)
        self.write_summary()  # after every part: a lab cut short still leaves its rows

    def write_summary(self) -> str:
        f = self.facts.get
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        c = self.counts
        head = [f"ddpkit GPU lab, {now}, {self.mode}",
                f"device: {f('device', '?')}",
                f"torch {f('torch', '?')}, CUDA {f('cuda', '?')}, NCCL {f('nccl', '?')}, Python {f('python', '?')}, "
                f"{f('cpus', '?')} CPUs",
                f"ddpkit from {f('ddpkit', '?')}, cloudpickle {f('cloudpickle', '?')}",
                f"{c['ok']} ok, {c['FAILED']} FAILED, {c['SKIPPED']} SKIPPED in "
                f"{time.monotonic() - self.started:.0f} s (budget {self.budget_s:.0f} s for the parts)", ""]
        summary = "\n".join(head + self.rows + ([""] + self.extra if self.extra else [])) + "\n"
        (self.out / "summary.txt").write_text(summary)
        return summary

    def execute(self, name: str, argv: list[str], timeout_s: float) -> tuple[int | None, str, float]:
        """Run ``argv`` in a session of its own, output to the log; past ``timeout_s`` its group is
        killed. Then every process left that carries this part's mark in its environment (the
        ranks start sessions of their own) is killed too: the next part starts on a free GPU."""
        self.serial += 1
        mark = f"{os.getpid()}.{self.serial}"
        env = dict(os.environ, GPU_LAB_PART=mark)
        self.log(f"\n===== {name}: {' '.join(argv)}  (timeout {timeout_s:.0f} s)\n")
        t0 = time.monotonic()
        with tempfile.TemporaryFile("w+") as buf:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=buf, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rc = None
            leftovers = _kill_marked(mark)
            buf.seek(0)
            text = buf.read()
        if leftovers:
            text += f"\n(killed {leftovers} leftover process(es) of this part)\n"
        self.log(text)
        return rc, text, time.monotonic() - t0

    def run_part(self, part: Part, have: dict) -> None:
        argv = [a.replace("{out}", str(self.out)).replace("{work}", str(self.work)) for a in part.argv]
        if self.stand_in and part.needs == "cuda" and not have["cuda"]:
            if part.judge is not None:  # a refusal: asked of the CPU, it must be refused alike
                part = replace(part, needs="", note="stand-in: refused on the CPU, not CUDA")
            elif "--gpus" in argv:  # ranks sharing a GPU: CPU ranks instead
                at = argv.index("--gpus")
                argv = argv[:at] + argv[at + 2:]
                part = replace(part, needs="", note="stand-in: CPU ranks, not a shared GPU")
            elif "nccl" in argv:
                argv = ["gloo" if a == "nccl" else a for a in argv]
                part = replace(part, needs="", note="stand-in: on the CPU (gloo), not CUDA")
            elif "pytest" in argv:
                part = replace(part, needs="", note="stand-in: collected on the CPU, every test skipped")
            elif HERE not in argv:  # the doctor: on the CPU its ranks run on gloo
                part = replace(part, needs="", note="stand-in: on the CPU (gloo), not CUDA")
        if self.dry:
            t0 = time.monotonic()
            ok, detail = resolve(argv)
            where = " (runs with CUDA only)" if "cuda" in part.needs.split(",") else ""
            self.log(f"\n===== {part.name}: {' '.join(argv)}\n(dry run) {detail}\n")
            self.record("ok" if ok else "FAILED", part.name, time.monotonic() - t0,
                        f"dry run: {detail}{where}" if ok else detail)
            return
        missing = [n for n in part.needs.split(",") if n and not have[n]]
        if missing:
            why = "no CUDA" if "cuda" in missing else "no nbval (carry the wheels: bash benchmarks/gpu_wheels.sh)"
            self.log(f"\n===== {part.name}: SKIPPED: {why}\n")
            self.record("SKIPPED", part.name, 0, why)
            return
        if self.left_s < 20:
            self.record("SKIPPED", part.name, 0, f"the lab's {self.budget_s:.0f} s budget is spent")
            return
        limit = min(part.timeout_s, self.left_s)
        rc, text, took = self.execute(part.name, argv, limit)
        if rc is None:
            self.record("FAILED", part.name, took, f"timed out after {limit:.0f} s; last: {_last_line(text)}")
            return
        if part.judge is not None:
            ok, detail = part.judge(rc, text)
        else:
            ok, detail = rc == 0, _last_line(text) if rc == 0 else f"exit {rc}: {_why(text)}"
        if ok and part.note:
            detail = f"{detail} [{part.note}]"
        self.record("ok" if ok else "FAILED", part.name, took, detail, () if ok else _failure_lines(text))
        if part.figures is not None:
            self.extra.extend(part.figures(self.out))


def run(out: str, dry: bool = False, wheels: str | None = None, budget_s: float = BUDGET_S,
        stand_in: bool = False, only: list[str] | None = None) -> int:
    names = [p.name for p in lab_parts(gpus=1)] + [p.name for p in lab_parts(gpus=2)]
    unknown = sorted(set(only or ()) - set(names))
    if unknown:
        print(f"no part called {', '.join(map(repr, unknown))}; the parts: {', '.join(dict.fromkeys(names))}",
              file=sys.stderr)
        return 2
    out_dir = Path(out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("logs.txt", "summary.txt"):
        (out_dir / name).unlink(missing_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_lab."))
    mode = ("dry run: each part's command resolved, none run" if dry else
            "rehearsal: CUDA parts stood in for on the CPU where they can" if stand_in else "full")
    lab = Lab(out_dir, work, dry, budget_s, stand_in=stand_in and not dry, mode=mode)
    print(f"ddpkit GPU lab ({mode}) into {out_dir}; {sys.executable}", flush=True)

    # 1. the carried wheels, into a folder of their own ahead of the machine's packages
    folder = Path(wheels) if wheels else ROOT / (".whl" if sys.version_info[:2] == (3, 12)
                                                else f".whl-{sys.version_info[0]}.{sys.version_info[1]}")
    site = work / "site"
    paths = [str(ROOT), str(site), os.environ.get("PYTHONPATH", "")]
    os.environ.update(PYTHONPATH=os.pathsep.join(p for p in paths if p), PYTHONUNBUFFERED="1",
                      HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", JUPYTER_PLATFORM_DIRS="1",
                      JUPYTER_RUNTIME_DIR=str(work / "jupyter" / "runtime"),
                      JUPYTER_DATA_DIR=str(work / "jupyter" / "data"),
                      JUPYTER_CONFIG_DIR=str(work / "jupyter" / "config"), IPYTHONDIR=str(work / "ipython"))
    sys.path[:0] = [str(ROOT), str(site)]
    if not folder.is_dir():
        lab.record("SKIPPED", "carried wheels", 0, f"no wheel folder {folder} (bash benchmarks/gpu_wheels.sh)")
    else:
        rc, text, took = lab.execute("carried wheels", [sys.executable, HERE, "install", str(folder), str(site)], 180)
        lab.record("ok" if rc == 0 else "FAILED", "carried wheels", took, _last_line(text) if rc == 0 else
                   f"exit {rc}: {_why(text)}")
    importlib.invalidate_caches()

    # 2. what this machine is (a part of its own: it imports torch, the runner does not)
    rc, text, took = lab.execute("env", [sys.executable, HERE, "env"], 90)
    lab.facts = dict(line.split("=", 1) for line in text.splitlines() if re.match(r"^\w+=", line))
    lab.record("ok" if rc == 0 else "FAILED", "env", took, f"{lab.facts.get('device', '?')}, torch "
               f"{lab.facts.get('torch', '?')}" if rc == 0 else f"exit {rc}: {_why(text)}",
               () if rc == 0 else _failure_lines(text))
    gpus = int(lab.facts.get("gpus", 0))
    have = {"cuda": gpus > 0, "nbval": importlib.util.find_spec("nbval") is not None}

    # 3. the parts
    for part in lab_parts(gpus):
        if only is None or part.name in only:
            lab.run_part(part, have)

    summary = lab.write_summary()
    shutil.rmtree(work, ignore_errors=True)
    print("\n" + summary, flush=True)
    return 1 if lab.counts["FAILED"] else 0


def resolve(argv: list[str]) -> tuple[bool, str]:
    """A part's command checked without running it: (ok, what was checked or what is wrong)."""
    if argv[0] != sys.executable:
        return False, f"not run by this Python: {argv[0]}"
    if argv[1:3] == ["-m", "ddpkit"]:
        import contextlib
        import io

        from ddpkit.__main__ import build_parser  # the CLI's own parser: types, choices, names

        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                build_parser().parse_args(argv[3:])
        except SystemExit:
            return False, f"python -m ddpkit {argv[3]}: {_last_line(err.getvalue())}"
        return True, f"python -m ddpkit {argv[3]}: arguments parsed"
    if argv[1:3] == ["-m", "pytest"]:
        wanted = ["pytest", "pytest_timeout"] + (["nbval"] if "--nbval-lax" in argv else [])
        missing = [m for m in wanted if importlib.util.find_spec(m) is None]
        paths = [a.removeprefix("--ignore=") for a in argv[3:] if "/" in a]  # tests, notebooks, those left out
        missing += [a for a in paths if not (ROOT / a).exists()]
        if missing:
            return False, f"missing: {', '.join(missing)}"
        return True, f"{', '.join(wanted)} found, {len(paths)} path(s) there"
    if argv[1] == HERE:
        if argv[2] not in COMMANDS:
            return False, f"{HERE} has no part {argv[2]!r}"
        if argv[2] == "snapshot":
            snapshot(argv[3], dry=True)
        if argv[2] == "oom":
            oom(dry=True)
        return True, f"{HERE} {argv[2]}: found"
    if argv[1].startswith("benchmarks/bench_") and (ROOT / argv[1]).is_file():
        import contextlib
        import io

        spec = importlib.util.spec_from_file_location(Path(argv[1]).stem, ROOT / argv[1])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # its imports of torch and ddpkit wait inside its functions
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                module.build_parser().parse_args(argv[2:])
        except SystemExit:
            return False, f"{argv[1]}: {_last_line(err.getvalue())}"
        return True, f"{argv[1]}: arguments parsed"
    return False, f"unknown command {' '.join(argv[1:3])}"


def _kill_group(proc) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _kill_marked(mark: str) -> int:
    """Kill the processes whose environment holds GPU_LAB_PART=``mark`` (only this lab's part
    sets it: its ranks and their children); how many."""
    needle = f"GPU_LAB_PART={mark}\0".encode()
    killed = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
        except (OSError, PermissionError):
            continue
    return killed


_PROGRESS = re.compile(r"^\[[#.]+\]")


def _last_line(text: str) -> str:
    """The output's last line that says something (a progress bar's line does not)."""
    lines = [line.strip() for line in text.splitlines() if line.strip() and not _PROGRESS.match(line.strip())]
    return lines[-1][:300] if lines else "(no output)"


_ERROR = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b.*:|\berror: ")


def _why(text: str) -> str:
    """The line that says why a part failed: the last error raised (a rank's traceback ends in
    one, before the kit's note that the ranks keep running), else the last line."""
    errors = [line.strip() for line in text.splitlines() if _ERROR.search(line.strip())]
    return errors[-1][:300] if errors else _last_line(text)


def _failure_lines(text: str, most: int = 6) -> list[str]:
    """Lines naming what failed (pytest's and doctor's FAILED rows, errors), for the summary."""
    hits = [line.strip()[:240] for line in text.splitlines()
            if re.search(r"\bFAILED\b|Error\b|error:", line) and line.strip()]
    hits = [h for h in dict.fromkeys(hits) if h != _why(text)[:240]]
    return hits[-most:]


# ============================================================================= check-wheels
def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _wheel_name(path: Path) -> str:
    return _canonical(path.name.split("-")[0])


def _metadata(path: Path):
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(z.read(meta).decode())


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
            if _canonical(req.name) not in carried | ON_THE_IMAGE | LEFT_OUT:
                missing.append(f"{_wheel_name(w)} needs {req}")
    for m in missing:
        print(f"not carried and not on the image: {m}", file=sys.stderr)
    return 1 if missing else 0


# ============================================================================= install
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
    comes first on PYTHONPATH, so it would shadow the machine's own). Never torch."""
    from importlib.metadata import PackageNotFoundError, version

    ranges = _kit_ranges()
    take, kept = [], []
    for w in sorted(Path(folder).glob("*.whl")):
        name = _wheel_name(w)
        if "torch" in name:
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
           "--no-cache-dir", "--disable-pip-version-check", "--upgrade", "--target", target, *map(str, take)]
    done = subprocess.run(cmd, env=dict(os.environ, PIP_CONFIG_FILE=os.devnull))
    if done.returncode == 0:
        print(f"installed {len(take)} of {len(take) + len(kept)} carried wheels into {target}")
    return done.returncode


# ============================================================================= env
def env() -> int:
    """key=value lines for the summary's head: what this machine is, what the kit sees."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch

    import ddpkit

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = ""
    if gpus and torch.distributed.is_nccl_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    try:
        cloudpickle = version("cloudpickle")
    except PackageNotFoundError:
        cloudpickle = "absent"
    rows = {
        "gpus": str(gpus),
        "device": f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else "no CUDA GPU",
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none (a CPU build)",
        "nccl": nccl or "not used (no GPU)",
        "python": platform.python_version(),
        "cpus": str(os.cpu_count()),
        "ddpkit": os.path.dirname(ddpkit.__file__),
        "cloudpickle": cloudpickle,
    }
    for k, v in rows.items():
        print(f"{k}={v}")
    return 0


# ============================================================================= snapshot
SNAPSHOT_STRATEGY = "fsdp"


def _recorded_run_in_a_snapshot(path: str) -> dict:
    """A Cluster job: one recorded FSDP run of the course's MLP, every CUDA allocation in it
    recorded into a memory snapshot at ``path`` (open it at https://pytorch.org/memory_viz)."""
    from ddpkit.experiment import run_strategy
    from ddpkit.memory import cuda_memory_snapshot

    with cuda_memory_snapshot(path, max_entries=50_000):
        out = run_strategy(SNAPSHOT_STRATEGY, steps=2, warmup=1, record=True, report_progress=False)
    return {"bytes": os.path.getsize(path), "peak_bytes": out.peak_bytes, "memory": out.memory}


def snapshot(path: str, dry: bool = False) -> int:
    import ddpkit
    from ddpkit.experiment import run_strategy  # noqa: F401 - found before any rank starts
    from ddpkit.memory import cuda_memory_snapshot  # noqa: F401

    if dry:
        return 0
    with ddpkit.Cluster(1, backend="nccl", timeout=60.0) as cluster:
        (out,) = cluster.run(_recorded_run_in_a_snapshot, os.path.abspath(path))
    mem = ", ".join(f"{k} {v} B" for k, v in out["memory"].items())
    print(f"wrote {path}: {out['bytes']} B; {SNAPSHOT_STRATEGY}'s peak {out['peak_bytes']} B; "
          f"memory in its measured step: {mem}")
    return 0


# ============================================================================= oom
def _past_the_cap() -> int:
    """A Cluster job on 2 ranks sharing a GPU, each capped at a tenth of it: rank 0 holds 64 MiB and
    waits in a collective, rank 1 asks for a fifth of the GPU."""
    import torch
    import torch.distributed as dist

    import ddpkit

    dev = ddpkit.device()
    held = torch.empty(16 * 2**20, device=dev)  # 64 MiB
    if dist.get_rank() == 1:
        torch.empty(torch.cuda.get_device_properties(dev).total_memory // 5, dtype=torch.uint8, device=dev)
    dist.barrier()
    return held.numel()


def oom(dry: bool = False) -> int:
    """The message a learner gets when a rank sharing a GPU runs out of memory (printed whole), and
    the cluster running its next job."""
    import ddpkit

    if dry:
        return 0
    with ddpkit.Cluster(2, gpus=[0, 0], memory_fraction=0.1, timeout=60.0) as cluster:
        try:
            cluster.run(_past_the_cap)
        except ddpkit.GpuOutOfMemoryError as err:
            print(str(err).split("\n--- rank")[0])  # the explanation and the cluster's note
            if err.out_of_memory != [1] or sorted(err.held) != [0, 1]:
                print(f"expected rank 1 out of memory and both ranks' figures; got {err.out_of_memory}, "
                      f"{sorted(err.held)}")
                return 1
        else:
            print("rank 1 asked for a fifth of the GPU under a cap of a tenth, and no GpuOutOfMemoryError came")
            return 1
        after = cluster.run(ddpkit.rank)
    print(f"the out-of-memory message named both ranks' figures; the next job ran on ranks {after}")
    return 0


# ============================================================================= figures
def _mib(n) -> str:
    return f"{n / 2**20:.2f}"


def _figure_lines(path) -> list[str]:
    """One line per strategy of a ``compare --json`` file (MiB): what docs/gpu.md's Results take."""
    lines = []
    for r in json.load(open(path)):
        if "error" in r:
            lines.append(f"{r['strategy']:>17}  error: {r['error']}")
            continue
        mem = r["memory"][-1] if r.get("memory") else {}
        cats = " ".join(f"{k} {_mib(v)}" for k, v in mem.items())
        lines.append(f"{r['strategy']:>17}  {r['ms_per_step']:7.2f} ms/step  sent {_mib(r['comm_bytes_per_step'])}  "
                     f"peak {_mib(r['peak_bytes'])}  max|diff| {r['max_param_diff']:.1e}  | {cats}")
    return lines


def figures(path: str) -> int:
    print("\n".join(_figure_lines(path)))
    return 0


# ============================================================================= command line
COMMANDS = {"run", "check-wheels", "install", "env", "snapshot", "oom", "figures"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        return 2
    cmd, args = argv[0], argv[1:]
    if cmd == "run":
        flags = {"--wheels": None, "--budget": BUDGET_S, "--only": None}
        rest = []
        while args:
            a = args.pop(0)
            if a in flags:
                flags[a] = args.pop(0)
            elif a not in ("--dry-run", "--stand-in"):
                rest.append(a)
        if len(rest) != 1 or rest[0].startswith("-"):
            print("usage: gpu_lab_parts.py run OUTDIR [--dry-run | --stand-in] [--only A,B] [--wheels DIR] "
                  "[--budget S]", file=sys.stderr)
            return 2
        only = [n.strip() for n in flags["--only"].split(",") if n.strip()] if flags["--only"] else None
        return run(rest[0], dry="--dry-run" in argv, wheels=flags["--wheels"], budget_s=float(flags["--budget"]),
                   stand_in="--stand-in" in argv, only=only)
    if cmd == "check-wheels":
        return check_wheels(*args)
    if cmd == "install":
        return install(*args)
    if cmd == "env":
        return env()
    if cmd == "snapshot":
        return snapshot(args[0], dry="--dry-run" in args)
    if cmd == "oom":
        return oom(dry="--dry-run" in args)
    return figures(*args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
