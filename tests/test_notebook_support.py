"""The course notebooks, read as files (executing them is nbval's job: ``pytest notebooks/``).

Checks what nbval cannot: that notebooks are committed clean, that each one starts and stops its
own cluster and ends by asserting what it taught, and that every exercise a notebook asks for
exists, so renaming an exercise cannot silently break a lecture.
"""
from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import exercises  # noqa: E402

NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))


def code_cells(name: str) -> list[str]:
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_without_outputs(name):
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, \
                f"{name}: strip outputs (jupyter nbconvert --clear-output --inplace)"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_starts_its_own_cluster_checks_and_shuts_down(name):
    cells = code_cells(name)
    assert any(re.search(r"ddpkit\.Cluster\(world_size=\d", c) for c in cells), f"{name}: no cluster of its own"
    assert cells[-1].strip().startswith("cluster.shutdown()"), f"{name}: the last cell should stop the cluster"
    assert "assert " in cells[-2] and "all checks passed" in cells[-2], f"{name}: no closing checks"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_exercise_a_notebook_uses_exists(name):
    used = re.findall(r'exercises\.use\(\s*"(\w+)",\s*"(\w+)"', "\n".join(code_cells(name)))
    for topic, fn in used:
        assert topic in exercises.TOPICS, f"{name}: unknown topic {topic!r}"
        for package in ("exercises", "solutions"):
            module = importlib.import_module(f"{package}.{topic}")
            assert hasattr(module, fn), f"{name}: {package}.{topic} has no {fn!r}"


def test_the_notebooks_use_most_exercises():
    used = {f"{t}.{f}" for name in NOTEBOOKS
            for t, f in re.findall(r'exercises\.use\(\s*"(\w+)",\s*"(\w+)"', "\n".join(code_cells(name)))}
    every = {f"{t}.{f}" for t in exercises.TOPICS
             for f in exercises.exercise_functions(importlib.import_module(f"exercises.{t}"))}
    assert every <= used, sorted(every - used)   # every graded exercise is met in a notebook (58.5)
