"""The package's face: names handed on from their one home, loaded on first use; importing the
strategies loads neither the cluster nor the course; the maps of names are checked here, not kept
in step by hand."""
from __future__ import annotations

import ast
import importlib
import inspect
import json
import pathlib
import subprocess
import sys
import warnings

import pytest

import ddpkit
import ddpkit.strategies
import ddpkit.trace

# what a rank running a strategy must never load (the notebook's parent loads them)
NOT_FOR_A_STRATEGY = ("ddpkit.cluster", "ddpkit.predictions", "ddpkit.widget", "ddpkit.costmodel", "ddpkit.viz",
                      "ddpkit.compare", "ddpkit.experiment", "ddpkit.memory", "ddpkit.network", "ddpkit.comm")


def _loaded_by(statement: str) -> list[str]:
    code = (f"import sys, json; {statement}; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('ddpkit', 'ipywidgets', "
            "'matplotlib', 'IPython'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("statement", ["import ddpkit", "import ddpkit.strategies", "import ddpkit.strategies.naive",
                                       "import ddpkit.strategies.overlapped", "import ddpkit.strategies.fsdp",
                                       "from ddpkit import OverlappedDDP, FSDP, ZeRO2"])
def test_importing_the_strategies_loads_no_cluster_course_cost_model_plots_or_widget(statement):
    loaded = _loaded_by(statement)
    assert not [m for m in loaded if m.startswith(NOT_FOR_A_STRATEGY) or "." not in m and m != "ddpkit"], loaded


def test_one_ddp_strategy_loads_its_reading_path_and_little_else():
    loaded = _loaded_by("import ddpkit.strategies.naive")
    # the core, the compatibility layer and what they read; no other strategy
    assert {"ddpkit.strategies.naive", "ddpkit.strategies.ddp_module", "ddpkit.strategies.ddp_compat",
            "ddpkit.strategies.buckets"} <= set(loaded)
    assert not {"ddpkit.strategies.fsdp", "ddpkit.strategies.zero1", "ddpkit.strategies.table"} & set(loaded)
    assert len(loaded) <= 15, loaded  # ddpkit.lazy included


@pytest.mark.parametrize("face", [ddpkit, ddpkit.strategies, ddpkit.trace], ids=lambda m: m.__name__)
def test_each_public_name_is_its_homes_own_and_every_name_is_listed(face):
    homes = {name: home if home.startswith("ddpkit") else face.__name__ + home for name, home in face._HOMES.items()}
    assert face.__all__ == list(homes)
    for name, home in homes.items():
        value = getattr(face, name)
        assert value is getattr(importlib.import_module(home), name)
        # defined there (a class or function), or in the package whose face it is (ddpkit.predictions)
        defined_in = getattr(value, "__module__", home)
        assert defined_in == home or defined_in.startswith(home + "."), (name, home, defined_in)
        assert name in dir(face)
    namespace: dict = {}
    exec(f"from {face.__name__} import *", namespace)
    assert set(homes) <= set(namespace)


def test_the_trace_map_hands_on_every_public_function_and_class_of_its_modules():
    """A function or class defined without an underscore in a module ``ddpkit.trace`` hands on is in
    the map (one forgotten there, or a name gone from its module, fails here)."""
    for short in set(ddpkit.trace._HOMES.values()):
        module = importlib.import_module(short, "ddpkit.trace")
        defined = {n for n, v in vars(module).items() if not n.startswith("_") and (inspect.isclass(v)
                   or inspect.isfunction(v)) and v.__module__ == module.__name__}
        mapped = {n for n, h in ddpkit.trace._HOMES.items() if h == short and n in defined | set(vars(module))}
        assert mapped == {n for n, h in ddpkit.trace._HOMES.items() if h == short}, f"stale names in {short}"
        missing = defined - mapped
        assert not missing, f"ddpkit/trace{short}.py defines {sorted(missing)}: add to trace._HOMES, or name _private"


def test_a_submodule_is_an_attribute_of_the_package_on_first_use():
    loaded = _loaded_by("import ddpkit; ddpkit.rankside.rank; ddpkit.experiment.wrap")
    assert "ddpkit.rankside" in loaded and "ddpkit.experiment" in loaded
    with pytest.raises(AttributeError, match="module 'ddpkit' has no attribute 'nonsense'"):
        ddpkit.nonsense  # noqa: B018


def test_a_cluster_is_displayed_as_its_widget_in_ipython_without_importing_widgets_first():
    pytest.importorskip("IPython")
    code = ("from IPython.testing.globalipapp import start_ipython; shell = start_ipython(); import sys, ddpkit; "
            "assert 'ddpkit.cluster' not in sys.modules and 'ddpkit.widget' not in sys.modules; "
            "f = shell.display_formatter.ipython_display_formatter; from ddpkit.cluster import Cluster; "
            "p = f.lookup_by_type(Cluster); print(p.__qualname__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("display_cluster")


def test_import_ddpkit_still_checks_the_torch_range(monkeypatch):
    from ddpkit import torch_internals

    monkeypatch.setattr(torch_internals, "torch_problem", lambda text=None: "torch 2.1 is outside the range")
    monkeypatch.delitem(sys.modules, "ddpkit")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        importlib.import_module("ddpkit")
    assert [str(w.message) for w in caught] == ["torch 2.1 is outside the range"]


def test_the_ddp_reading_path_stays_within_its_budget():
    """naive's, bucketed's and overlapped's step read in one sitting (benchmarks/reading_path.py)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import reading_path
    finally:
        sys.path.pop(0)
    files, total = reading_path.together()
    assert files == ["bucketed.py", "buckets.py", "ddp_module.py", "naive.py", "overlapped.py"]
    assert total <= reading_path.BUDGET, f"the DDP reading path is {total} lines (budget {reading_path.BUDGET})"
    # ... and the core imports nothing of the compatibility layer (which composes onto the core)
    core = ast.parse((reading_path.STRATEGIES / "ddp_module.py").read_text())
    imported = {node.module for node in ast.walk(core) if isinstance(node, ast.ImportFrom)}
    assert not {"ddpkit.strategies.ddp_compat", "ddpkit.strategies.torch_ddp_args", "ddpkit.strategies.comm_hooks",
                "torch.distributed.algorithms"} & imported
