"""Shared fixtures: one persistent CPU Cluster per world size for the whole test session.

Starting ranks costs ~1.5 s (each imports torch); reusing them keeps the suite fast. A test
that leaves a cluster broken (a dead rank) gets it restarted by the next user.

Every Cluster a test starts moves its bytes on the default transport (shared memory);
``DDPKIT_TEST_TRANSPORT=gloo python -m pytest`` runs the same suite over gloo's sockets.
"""
from __future__ import annotations

import inspect
import os
import re

import pytest

import ddpkit

TRANSPORT = os.environ.get("DDPKIT_TEST_TRANSPORT", "auto")


def pytest_configure(config):
    config.pluginmanager.register(_TimingNotebooksOnce(), "ddpkit-timing-notebooks-once")
    # The notebooks' prediction cells (ddpkit.ask) take one made-up learner's answers under nbval and in
    # CI, so every notebook runs headless; the kernels nbval starts inherit it (ddpkit/predictions/unattended.py)
    os.environ.setdefault("DDPKIT_ANSWERS", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                         "notebooks", "answers.json"))
    if TRANSPORT != "auto":  # every Cluster made in this process, the fixtures' and the tests' own
        from ddpkit.cluster import TRANSPORTS, Cluster

        if TRANSPORT not in TRANSPORTS:
            raise pytest.UsageError(f"DDPKIT_TEST_TRANSPORT={TRANSPORT!r}: valid are {', '.join(TRANSPORTS)}")
        # by name: the defaults are positional, and arguments added after transport= (pin_cores=,
        # memory_fraction=) would otherwise get it
        defaults = list(Cluster.__init__.__defaults__)
        named = [p.name for p in inspect.signature(Cluster.__init__).parameters.values()
                 if p.default is not inspect.Parameter.empty]
        defaults[named.index("transport")] = TRANSPORT
        Cluster.__init__.__defaults__ = tuple(defaults)


@pytest.fixture(scope="session")
def _clusters():
    made: dict[int, ddpkit.Cluster] = {}
    yield made
    for c in made.values():
        c.shutdown()


@pytest.fixture
def no_rank_device():
    """The test process is a rank with no GPU chosen when the test starts and when it ends
    (``rankside.set_device(None)``): a test that pretends to bind one leaves none behind."""
    from ddpkit import rankside

    rankside.set_device(None)
    yield
    rankside.set_device(None)


@pytest.fixture
def cluster_of(_clusters):
    """``cluster_of(n)`` -> a ready CPU Cluster with n ranks, shared across tests."""

    def get(world_size: int) -> ddpkit.Cluster:
        c = _clusters.get(world_size)
        if c is None:
            c = _clusters[world_size] = ddpkit.Cluster(world_size, backend="gloo", timeout=30.0)
        elif any(r.status in ("dead", "stopped") for r in c.ranks):
            c.restart()
        return c

    return get


@pytest.hookimpl(tryfirst=True)  # before -k deselects
def pytest_collection_modifyitems(config, items):
    """The grader's tests answer to -k by topic and exercise name; GPU tests skip without CUDA."""
    for item in items:
        # test_exercises.py asks for its exercises as exercise("topic", "name"): so that
        # `-k averaging` or `-k average_gradients` select them whatever the test is called
        if getattr(item, "module", None) is not None and item.module.__name__.endswith("test_exercises"):
            for topic, name in re.findall(r'exercise\("(\w+)", "(\w+)"\)', inspect.getsource(item.function)):
                item.extra_keyword_matches.update({topic, name})
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs")
    for item in items:
        # the marker itself, not item.keywords: those also hold the names of the folders above
        # the test, so a checkout in a folder called "gpu" would skip every test
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


class _TimingNotebooksOnce:
    """A timing notebook runs once in a run that also runs it under load: there, not here as well.

    ``tests/test_notebooks_under_load.py`` runs the timing notebooks under nbval with one core kept
    busy (the harder case; the cloud kernels' job runs them on a quiet machine); nbval's own items
    for the same notebooks are deselected then, and only then: a notebook named on the command line
    without that test, or a run that leaves it out (``-m "not slow"``, ``-k``), keeps its own.
    A plugin of its own (registered in ``pytest_configure``): its hook must run after -k and -m
    deselect, the grader's above before.
    """

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        under_load = [item for item in items if item.name == "test_the_timing_notebooks_pass_with_one_core_kept_busy"
                      and not any(m.args and m.args[0] for m in item.iter_markers("skipif"))]
        if not under_load:
            return
        names = {f"{name}.ipynb" for name in under_load[0].module.TIMING_NOTEBOOKS}
        twice = {item for item in items if item.path.suffix == ".ipynb" and item.path.name in names}
        if twice:
            config.hook.pytest_deselected(items=list(twice))
            items[:] = [item for item in items if item not in twice]


# ----------------------------------------------------------------------------- the grader's summary
# tests/test_exercises.py tags each test with the exercise(s) it grades (a user property,
# ("ddpkit_exercise", (target, "topic.name"))). After a run on the learner's exercises, one line per
# exercise says where it stands, so a learner sees "not written yet" without pytest's -rs and the
# hint of a wrong answer without scrolling through the failures.
_ORDER = {"right": 0, "not written yet": 1, "error": 2, "WRONG": 3}


def _reason(report) -> str:
    """The skip reason, or the failure's message (pytest.fail's text, else its first E line)."""
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        return reason.removeprefix("Skipped: ").removeprefix("not written yet: ")
    text = report.longreprtext.strip()
    e_lines = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    lines = e_lines or text.splitlines() or ["failed"]
    # the grader's messages: a first line, "  " detail lines (the first is shown), "  hint: " lines
    details = [line.strip() for line in lines[1:2] if line.startswith("  ")
               and not line.strip().startswith(("hint:", "..."))]
    hints = [line.strip() for line in lines if line.strip().startswith("hint:")]
    return "\n".join([lines[0].strip(), *details, *hints])


def pytest_terminal_summary(terminalreporter):
    status: dict[str, tuple[str, str]] = {}
    where: dict[str, tuple] = {}  # exercise -> the first test that graded it (file, line): the order shown
    for kind in ("passed", "failed", "skipped", "error"):
        for report in terminalreporter.stats.get(kind, []):
            tags = [v[1] for k, v in getattr(report, "user_properties", ()) if k == "ddpkit_exercise"
                    and v[0] == "exercises"]
            if not tags:
                continue
            if report.skipped:  # the exercise whose stub stopped the test: the last one it asked for
                tags, verdict = tags[-1:], "not written yet"
            else:
                verdict = "right" if report.passed else "WRONG" if report.when == "call" else "error"
            detail = "" if verdict == "right" else _reason(report)
            for name in tags:
                where[name] = min(where.get(name, report.location[:2]), report.location[:2])
                if _ORDER[verdict] > _ORDER[status.get(name, ("right", ""))[0]] or name not in status:
                    status[name] = (verdict, detail)
    if not status:
        return
    tr = terminalreporter
    tr.write_sep("=", "your exercises (DDPKIT_TARGET=exercises)")
    width = max(map(len, status)) + 2
    for name in sorted(status, key=where.__getitem__):
        verdict, detail = status[name]
        first, *rest = (f"{verdict}: {detail}" if detail else verdict).splitlines()
        colour = {"right": "green", "not written yet": "yellow"}.get(verdict, "red")
        tr.write_line(f"{name:<{width}}{first}", **{colour: True})
        for line in rest:
            tr.write_line(" " * (width + 2) + line, **{colour: True})
    counts = [f"{sum(v == k for v, _ in status.values())} {k.lower()}" for k in _ORDER
              if any(v == k for v, _ in status.values())]
    tr.write_line(f"{len(status)} exercise{'s' if len(status) > 1 else ''} checked: {', '.join(counts)}", bold=True)
