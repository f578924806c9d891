"""The conda environment and pyproject.toml list the same dependencies (they must not drift)."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONDA_NAMES = {"pytorch": "torch"}  # conda-forge's name -> PyPI's name


def _name_and_spec(req: str) -> tuple[str, str]:
    m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(.*)", req)
    return m.group(1).lower().replace("_", "-"), m.group(2).replace(" ", "")


def _pyproject() -> dict[str, str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = meta["dependencies"] + meta["optional-dependencies"]["dev"]
    return dict(_name_and_spec(r) for r in reqs)


def _conda() -> dict[str, str]:
    deps = {}
    text = (ROOT / "environment.yml").read_text()
    for line in text.split("\ndependencies:\n", 1)[1].splitlines():
        m = re.match(r"\s+- ([A-Za-z][^:#]*)$", line)  # "  - name>=1" lines; skips "- pip:" itself
        if not m or line.startswith("      "):          # deeper lines are the pip: section
            continue
        name, spec = _name_and_spec(m.group(1))
        deps[CONDA_NAMES.get(name, name)] = spec.replace("=", "==", 1) if re.match(r"=[^=]", spec) else spec
    return deps


def test_conda_env_lists_the_same_dependencies_as_pyproject():
    conda = {k: v for k, v in _conda().items() if k not in ("python", "pip")}
    assert conda == _pyproject()


def test_conda_env_installs_this_project_with_pip():
    text = (ROOT / "environment.yml").read_text()
    assert re.search(r"- pip:\n\s+- -e \.", text), "environment.yml must pip-install this project"


def test_torch_requirement_admits_the_pinned_cpu_build():
    spec = _pyproject()["torch"]
    lower = re.search(r">=([\d.]+)", spec).group(1)
    upper = re.search(r"<([\d.]+)", spec).group(1)
    assert tuple(map(int, lower.split("."))) <= (2, 13) < tuple(map(int, upper.split(".")))
