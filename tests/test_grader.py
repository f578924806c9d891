"""The grader's own tests: that it grades right, reads well, and runs after the README's set-up.

They live here, not in ``tests/test_exercises.py``, so a learner's run of the grader counts only
the learner's exercises. Two of them run the grader in a subprocess as a learner would
(``DDPKIT_TARGET=exercises python -m pytest tests/test_exercises.py``) and read its output.
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import cloudpickle
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import exercises  # noqa: E402  (needs ROOT on sys.path)
import test_exercises as grader  # noqa: E402  (tests/ is on sys.path under pytest)


def _stubs() -> list[tuple[str, str]]:
    return [(topic, name) for topic in exercises.TOPICS
            for name, fn in exercises.exercise_functions(importlib.import_module(f"exercises.{topic}")).items()
            if exercises.is_stub(fn)]


def _grade(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """The learner's command, run in ``cwd``: DDPKIT_TARGET=exercises python -m pytest tests/test_exercises.py."""
    env = dict(os.environ, DDPKIT_TARGET="exercises", COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "pytest", "tests/test_exercises.py", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


# ----------------------------------------------------------------------------- the course itself
def test_exercises_and_solutions_have_the_same_names_signatures_and_docstrings():
    for topic in exercises.TOPICS:
        mine = importlib.import_module(f"exercises.{topic}")
        ref = importlib.import_module(f"solutions.{topic}")
        ex, so = exercises.exercise_functions(mine), exercises.exercise_functions(ref)
        assert list(ex) == list(so), f"{topic}: exercise names {list(ex)} != solution names {list(so)}"
        for name in ex:
            assert inspect.signature(ex[name]) == inspect.signature(so[name]), f"{topic}.{name}: signature"
            assert inspect.getdoc(ex[name]) == inspect.getdoc(so[name]), f"{topic}.{name}: docstring"
            assert not exercises.is_stub(so[name]), f"solutions.{topic}.{name} is still a stub"
            assert "Check" in inspect.getdoc(ex[name]), f"{topic}.{name}: the docstring should say how it is checked"
    assert len(exercises.TOPICS) >= 6


def test_is_stub_tells_stubs_from_answers():
    def stub(x):
        """Docstring."""
        raise NotImplementedError("exercise: x")

    def bare_stub(x):
        raise NotImplementedError

    def answer(x):
        """Docstring."""
        if x < 0:
            raise NotImplementedError("negative")
        return x

    def other_error(x):
        raise ValueError("x")

    assert exercises.is_stub(stub) and exercises.is_stub(bare_stub)
    assert not exercises.is_stub(answer) and not exercises.is_stub(other_error)


def test_the_grader_needs_nothing_beyond_the_readme_setup():
    """pytest and every plugin its configuration names are installed with the course, not an extra."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    main = {re.match(r"[A-Za-z0-9_.\-]+", r).group(0).lower() for r in meta["project"]["dependencies"]}
    config = meta["tool"]["pytest"]["ini_options"]
    needed = {"pytest"}
    if "--nbval" in config.get("addopts", ""):
        needed.add("nbval")
    if "timeout" in config:
        needed.add("pytest-timeout")
    assert needed <= main, f"the grader needs {sorted(needed - main)} as main dependencies in pyproject.toml"


# ----------------------------------------------------------------------------- what a learner reads
def test_every_known_mistake_is_named():
    """The wrong variants the grader knows each get their own hint."""
    for kwargs, hint in grader.BUCKET_MISTAKES:
        for sizes, cap in [([4, 4, 4, 4], 8), ([4, 4, 4, 4], 6), ([16, 4, 100, 4, 1000], 64)]:
            wrong_answer = grader._buckets_like(sizes, cap, **kwargs)
            if wrong_answer != grader._buckets_like(sizes, cap):
                assert hint in grader._assign_problem(sizes, cap, wrong_answer)
    flat = torch.arange(1.0, 8.0)
    for variant, _hint in grader.SHARD_MISTAKES:
        assert [s.tolist() for s in variant(flat, 3)] != [s.tolist() for s in grader._shards(flat, 3)]
    mean, local = torch.randn(5), torch.randn(5)
    hints = {"2 times the expected": mean * 2, "divide twice": mean / 2,
             "own value, unchanged": local, "own value divided": local / 2}
    for words, got in hints.items():
        assert words in grader.tensor_problem(got, mean, grader.mean_mistakes(mean, 2, local))
    assert grader.tensor_problem(mean.clone(), mean, grader.mean_mistakes(mean, 2, local)) == ""


def test_every_stub_is_reported_as_not_written_yet():
    """The untouched course: every exercise is a plain "not written yet" line, without -rs."""
    stubs = _stubs()
    if not stubs:
        pytest.skip("every exercise in exercises/ is written")
    proc = _grade(ROOT)
    out = proc.stdout + proc.stderr
    for topic, name in stubs:
        assert f"not written yet: exercises/{topic}.py: {name} raises NotImplementedError" in out, out[-3000:]
    assert "NotImplementedError" not in "\n".join(
        line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))), out[-3000:]
    if len(stubs) == sum(len(exercises.exercise_functions(importlib.import_module(f"exercises.{t}")))
                         for t in exercises.TOPICS):
        # nothing may fail or pass: the grader must not crash on stubs, nor count its own tests
        assert proc.returncode == 0, out[-3000:]
        assert f"{len(stubs)} exercises checked: {len(stubs)} not written yet" in out, out[-3000:]
        assert not re.search(r"\d+ passed", out), out[-3000:]


def test_a_wrong_answer_gets_a_hint_and_a_right_one_passes(tmp_path):
    """A learner's checkout with two wrong answers, one right one and a stub, graded in a subprocess."""
    for part in ("exercises", "solutions"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "tests").mkdir()
    for part in ("tests/test_exercises.py", "tests/conftest.py", "pyproject.toml"):
        shutil.copy(ROOT / part, tmp_path / part)

    def write(topic: str, name: str, body: str) -> None:
        path = tmp_path / "exercises" / f"{topic}.py"
        stub = f'    raise NotImplementedError("exercise: {topic}.{name} (see the docstring)")\n'
        assert stub in path.read_text(), f"{topic}.{name} is no longer a stub in exercises/"
        path.write_text(path.read_text().replace(stub, body))

    write("averaging", "average_gradients",   # summed, not divided
          "    for p in module.parameters():\n"
          "        if p.grad is not None:\n"
          "            dist.all_reduce(p.grad, group=group)\n")
    write("buckets", "assign_buckets",        # registration order, not reversed
          "    buckets, current, filled = [], [], 0\n"
          "    for i in range(len(sizes)):\n"
          "        current.append(i)\n"
          "        filled += sizes[i]\n"
          "        if filled >= cap_bytes:\n"
          "            buckets.append(current)\n"
          "            current, filled = [], 0\n"
          "    return buckets + [current] if current else buckets\n")
    write("sharding", "shard_flat",           # right
          "    per = -(-flat.numel() // world_size)\n"
          "    padded = torch.cat([flat, flat.new_zeros(per * world_size - flat.numel())])\n"
          "    return padded[rank * per:(rank + 1) * per].clone()\n")
    proc = _grade(tmp_path, "-k", "average_gradients or assign_buckets or test_shard_flat or reduce_bucket")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert "did you sum without dividing by the world size?" in out, out[-4000:]
    assert "walk the parameters from the last to the first" in out, out[-4000:]
    summary = out[out.index("your exercises"):]
    assert re.search(r"sharding\.shard_flat +right", summary), summary
    assert re.search(r"averaging\.average_gradients +WRONG", summary), summary
    assert "not written yet: exercises/buckets.py: reduce_bucket raises NotImplementedError" in summary, summary
    assert "4 exercises checked: 1 right, 1 not written yet, 2 wrong" in summary, summary


# ----------------------------------------------------------------------------- exercises.use
STUB_LINE = 'raise NotImplementedError("exercise: costs.ring_all_gather_time (see the docstring)")'


def _learner_copy(tmp_path, monkeypatch):
    """A fresh ``exercises`` package in tmp_path (a learner's checkout), imported instead of ours."""
    pkg = tmp_path / "exercises"
    pkg.mkdir()
    (pkg / "__init__.py").write_text((ROOT / "exercises" / "__init__.py").read_text())
    stub_src = (ROOT / "exercises" / "costs.py").read_text()
    assert STUB_LINE in stub_src
    (pkg / "costs.py").write_text(stub_src)
    monkeypatch.syspath_prepend(str(tmp_path))
    for m in [m for m in sys.modules if m == "exercises" or m.startswith("exercises.")]:
        monkeypatch.delitem(sys.modules, m)  # restored (ours) when the test ends
    fresh = importlib.import_module("exercises")
    assert fresh.__file__.startswith(str(tmp_path))

    def edit(body: str) -> None:
        (pkg / "costs.py").write_text(stub_src.replace(STUB_LINE, body))

    return fresh, edit


def test_use_says_whether_it_gives_the_reference_or_yours_and_picks_up_edits(tmp_path, monkeypatch, capsys):
    """``exercises.use`` gives the reference while a stub, the learner's code once written, and says so."""
    fresh, edit = _learner_copy(tmp_path, monkeypatch)
    fn = fresh.use("costs", "ring_all_gather_time")
    assert fn.__module__ == "solutions.costs"
    out = capsys.readouterr().out
    assert "using the REFERENCE solution (solutions/costs.py)" in out and "not written yet" in out, out
    edit("return 12345.0")
    fn = fresh.use("costs", "ring_all_gather_time")
    assert fn.__module__ == "exercises.costs" and fn(1, 2, 0, 0) == 12345.0
    assert "using YOUR code from exercises/costs.py" in capsys.readouterr().out
    fresh.use("costs", "ring_all_gather_time", quiet=True)
    assert capsys.readouterr().out == ""
    # and it ships by value: a pickled copy runs the edited code without importing the file
    assert cloudpickle.loads(cloudpickle.dumps(fn))(1, 2, 0, 0) == 12345.0


def test_an_edited_exercise_reaches_running_ranks(tmp_path, monkeypatch, cluster_of):
    """Edit, run on the ranks, edit again, run again: the ranks never run a stale copy."""
    fresh, edit = _learner_copy(tmp_path, monkeypatch)
    cluster = cluster_of(2)
    fn = fresh.use("costs", "ring_all_gather_time", quiet=True)  # still a stub: the reference
    assert cluster.run(fn, 1e6, 2, 0.0, 1e-9) == [pytest.approx(0.5e6 * 1e-9)] * 2
    for value in (1.0, 2.0):
        edit(f"return {value}")
        fn = fresh.use("costs", "ring_all_gather_time", quiet=True)
        assert cluster.run(fn, 1e6, 2, 0.0, 1e-9) == [value, value]
