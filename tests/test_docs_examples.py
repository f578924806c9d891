"""The workload example of the README and of docs/own_model.md runs as pasted: every name it uses
is defined in it, and (slow) the block itself, run as a script, prints the compare table."""
from __future__ import annotations

import ast
import builtins
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "docs/own_model.md"]


def workload_example(page: str) -> str:
    """The page's first ```python block that builds a ddpkit.Workload."""
    text = (ROOT / page).read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    return next(b for b in blocks if "ddpkit.Workload(" in b)


def undefined_names(code: str) -> set[str]:
    """Names the code reads that it never imports, assigns or takes as an argument (nor builtins)."""
    tree = ast.parse(code)
    defined = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - defined


def test_the_check_finds_what_an_example_leaves_undefined():
    assert undefined_names("wl = make(lambda: GPT2LMHeadModel(cfg), ids[0])") == {"make", "GPT2LMHeadModel", "cfg",
                                                                                  "ids"}


@pytest.mark.parametrize("page", PAGES)
def test_the_workload_example_defines_every_name_it_uses(page):
    assert undefined_names(workload_example(page)) == set(), page


def test_the_readme_and_the_guide_show_the_same_example():
    strip = [line.split("#")[0].rstrip() for line in workload_example("README.md").splitlines()]
    assert strip == [line.split("#")[0].rstrip() for line in workload_example("docs/own_model.md").splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_guides_example_runs_as_pasted(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(workload_example("docs/own_model.md"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=560)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in run.stdout.splitlines() if line.split()}
    assert set(rows) >= {"bucketed", "zero2", "fsdp", "torch_fsdp"}
    for name in ("bucketed", "zero2", "fsdp", "torch_fsdp"):
        assert float(rows[name][-1]) < 1e-5, rows[name]  # dropout off: every strategy equals one process
