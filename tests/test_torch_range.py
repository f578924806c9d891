"""The tested torch range: stated once (torch_internals.SUPPORTED), the same in pyproject.toml and the
README, and a torch outside it gets one warning naming both, before any rank starts."""
import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

from ddpkit import torch_internals
from ddpkit.cluster.processes import WORKER_MAIN
from ddpkit.torch_internals import SUPPORTED, supported_range, torch_problem, torch_version

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("text, expected", [("2.7.1+cu126", (2, 7)), ("2.15.0", (2, 15)),
                                            ("2.16.0.dev20261101+cpu", (2, 16)), ("3.0.0a0", (3, 0))])
def test_versions_are_read_as_major_minor(text, expected):
    assert torch_version(text) == expected


def test_inside_the_range_there_is_nothing_to_say_and_outside_the_message_names_both():
    (a, b), (c, d) = SUPPORTED
    for inside in (f"{a}.{b}.0", f"{c}.{d}.0+cu132"):
        assert torch_problem(inside) is None
    older, newer = torch_problem(f"{a}.{b - 1}.0"), torch_problem(f"{c}.{d + 1}.0")
    assert f"{a}.{b - 1}.0" in older and "older than" in older and supported_range() in older
    assert f"{c}.{d + 1}.0" in newer and "newer than" in newer and supported_range() in newer


def test_pyproject_and_readme_state_the_same_range():
    (a, b), (c, d) = SUPPORTED
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torch>={a}.{b},<{c}.{d + 1}" in deps
    assert re.search(rf"torch {a}\.{b}\b.*?{c}\.{d}\b", (ROOT / "README.md").read_text())


def test_an_untested_torch_warns_once_and_its_ranks_stay_quiet(monkeypatch):
    monkeypatch.setattr(torch_internals, "torch_problem", lambda text=None: torch_problem("2.1.0"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch_internals.check_torch() is not None
    assert [w.category for w in caught] == [torch_internals.UntestedTorchWarning]
    # the ranks' first line filters the warning by its text: the parent has said it already
    message = str(caught[0].message)
    quiet = WORKER_MAIN.split("from ddpkit")[0] + f"warnings.warn({message!r})"
    shown = subprocess.run([sys.executable, "-c", quiet], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "ddpkit is tested" not in shown.stderr, shown.stderr


def test_the_doctor_says_whether_this_torch_is_in_the_range():
    from ddpkit.doctor import machine

    assert f"the tested range {supported_range()}" in machine()


def test_torch_28s_connection_chatter_is_dropped_and_nothing_else():
    from ddpkit.torch_internals import is_chatter

    assert is_chatter("[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3")
    assert not is_chatter("[W1126 gloo] a real warning about Rank 1")
    assert not is_chatter("Traceback (most recent call last):")
