"""Faults: ranks that die, hang or get interrupted, and a parent that is killed.

These tests break ranks on purpose, so they use their own Cluster (never the shared
``cluster_of`` ones). After each fault the cluster must be usable again.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import psutil
import pytest

import ddpkit
from ddpkit.cluster import Cluster, RankError

TIMEOUT = 8.0  # the cluster's collective timeout: long enough that our 2 s grace + 2 s kill come first


@pytest.fixture(scope="module")
def faulty():
    c = Cluster(world_size=2, backend="gloo", timeout=TIMEOUT)
    yield c
    c.shutdown()


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit may be reaped late inside a container)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pids(c):
    return [r.pid for r in c.ranks]


def _usable(c):
    assert c.run(lambda: ddpkit.rank()) == [0, 1]
    assert [r.status for r in c.ranks] == ["idle", "idle"]
    assert all(_running(p) for p in _pids(c))


def _all_reduce_unless(rank_that_misbehaves, misbehave):
    """A job: every rank all-reduces, except one, which misbehaves instead."""
    def job():
        import torch
        import torch.distributed as dist

        if dist.get_rank() == rank_that_misbehaves:
            misbehave()
        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()
    return job


def _run_expecting_rank_error(c, job):
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        c.run(job)
    return info.value, time.monotonic() - start


@pytest.mark.parametrize("how, words", [
    ("exit", "exited with code 3"),
    ("segfault", "SIGSEGV"),
    ("sigkill", "SIGKILL"),
])
def test_a_rank_that_dies_mid_job_is_named_and_the_cluster_restarts(faulty, how, words):
    def die():
        if how == "exit":
            os._exit(3)
        elif how == "segfault":
            import ctypes
            ctypes.string_at(0)
        else:
            os.kill(os.getpid(), signal.SIGKILL)

    old = _pids(faulty)
    err, took = _run_expecting_rank_error(faulty, _all_reduce_unless(1, die))
    assert err.ranks == [1] and words in err.failures[1]
    if how == "segfault":
        assert "Fatal Python error: Segmentation fault" in err.failures[1]  # faulthandler's dump
    # Rank 0 was waiting for rank 1 in the all-reduce: released (error or stopped), not hung.
    assert 0 in err.affected or 0 in err.failures
    assert took < TIMEOUT + 30  # includes the restart, on a loaded machine
    assert "restarted" in str(err)
    assert not any(_running(p) for p in old)
    _usable(faulty)


def test_a_failing_rank_releases_the_others_stuck_in_a_collective(faulty):
    def raise_():
        raise ValueError("rank 1 gives up before the all-reduce")

    err, _ = _run_expecting_rank_error(faulty, _all_reduce_unless(1, raise_))
    assert err.ranks == [1] and "gives up" in err.failures[1]
    assert not isinstance(err, ddpkit.DesyncError)  # rank 1's error is the cause, not a desync
    # rank 0 sat in all_reduce, which rank 1 (failed) never issued: its flight recorder says so,
    # so it was stopped at once (SIGINT cannot reach Python there), not after GRACE + KILL_AFTER.
    assert err.affected[0].startswith("rank 0 was stopped by the cluster at once")
    assert "which rank(s) 1 will never issue" in err.affected[0] and "all_reduce" in err.affected[0]
    assert "restarted" in str(err)
    _usable(faulty)


def test_a_hung_collective_fails_within_the_timeout_and_the_cluster_recovers(faulty):
    def never_joins():
        time.sleep(120)

    err, took = _run_expecting_rank_error(faulty, _all_reduce_unless(1, never_joins))
    assert err.ranks == [0] and "timed out" in err.failures[0].lower()  # the transport's timeout on rank 0
    assert "time.sleep" in err.affected[1] or "never_joins" in err.affected[1]  # where rank 1 was
    assert took < TIMEOUT + 30, took  # not 120 s: the sleeper was interrupted
    assert "restarted" in str(err)
    _usable(faulty)


def _interrupt_this_process_after(seconds: float) -> threading.Timer:
    # What a notebook's stop button does: SIGINT to the kernel, KeyboardInterrupt in run().
    t = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    t.start()
    return t


def test_keyboard_interrupt_stops_the_ranks_and_keeps_the_cluster(faulty):
    old = _pids(faulty)
    _interrupt_this_process_after(1.0)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        faulty.run(time.sleep, 60)
    assert time.monotonic() - start < 10
    assert _pids(faulty) == old  # both ranks stopped cleanly in Python: no restart needed
    _usable(faulty)


def test_keyboard_interrupt_with_a_rank_stuck_in_a_collective_restarts(faulty):
    old = _pids(faulty)
    _interrupt_this_process_after(1.0)
    with pytest.raises(KeyboardInterrupt):
        faulty.run(_all_reduce_unless(1, lambda: time.sleep(60)))
    assert _pids(faulty) != old  # rank 0 could not leave the all-reduce: killed, restarted
    _usable(faulty)


def test_on_nccl_an_interrupted_job_restarts_the_ranks(faulty, monkeypatch):
    # NCCL keeps what the interrupted job queued, which no other rank will match (faked here)
    from ddpkit.cluster import jobs

    monkeypatch.setattr(jobs.Job, "backend", property(lambda self: "nccl"))
    old = _pids(faulty)
    _interrupt_this_process_after(1.0)
    with pytest.raises(KeyboardInterrupt):
        faulty.run(time.sleep, 60)  # both ranks stop cleanly in Python: on gloo, no restart
    assert _pids(faulty) != old
    _usable(faulty)


def test_a_collective_that_timed_out_inside_a_strategy_restarts_the_ranks(faulty):
    # the transport's timeout (gloo's: a plain RuntimeError) is raised below OverlappedDDP's own
    # wait(), not from torch.distributed's Python code: its message says the group is broken, so
    # the ranks restart
    def job():
        import torch

        model = ddpkit.OverlappedDDP(torch.nn.Linear(4, 1))
        if ddpkit.rank() == 1:
            time.sleep(60)  # rank 0 waits in its bucket's all-reduce until the timeout
        model(torch.ones(2, 4)).sum().backward()

    old = _pids(faulty)
    err, took = _run_expecting_rank_error(faulty, job)
    assert not isinstance(err, ddpkit.DesyncError)  # a straggler, not a desync: the timeout decided
    assert err.ranks == [0] and "timed out" in err.failures[0].lower() and "buckets.py" in err.failures[0]
    assert "restarted" in str(err) and _pids(faulty) != old
    assert took < TIMEOUT + 30, took
    _usable(faulty)  # it used to fail here, with "pair closure" and "Connection closed by peer"


def test_an_idle_rank_ignores_a_stray_sigint(faulty):
    old = _pids(faulty)
    for pid in old:
        os.kill(pid, signal.SIGINT)
    time.sleep(0.5)
    assert all(_running(p) for p in old)
    _usable(faulty)
    assert _pids(faulty) == old


SCRIPT = """
import json, os, sys, time
import ddpkit

# no `if __name__ == "__main__":` guard: ranks are fresh interpreters, not spawn children
cluster = ddpkit.Cluster(world_size=2, backend="gloo", timeout=30)
pids = cluster.run(os.getpid)
print(json.dumps({"pids": pids, "ranks": cluster.run(lambda: ddpkit.rank())}), flush=True)
time.sleep(120)
"""


def test_a_plain_script_works_and_its_ranks_exit_when_it_is_sigkilled(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent(SCRIPT))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        lines = []  # the script prints one line once its ranks answered
        reader = threading.Thread(target=lambda: lines.append(parent.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout=120)
        assert lines and lines[0], "the script did not report its ranks"
        report = json.loads(lines[0])
        assert report["ranks"] == [0, 1]
        pids = report["pids"]
        assert all(_running(p) for p in pids)
        parent.kill()  # SIGKILL: no cleanup code runs in the parent
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_running(p) for p in pids):
            time.sleep(0.1)
        assert not any(_running(p) for p in pids), "orphaned ranks"
        # no cleanup ran in the parent: its flight rings are left, until the next Cluster sweeps them
        from ddpkit.cluster.watch import PREFIX, sweep

        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        left = [d for d in os.listdir(base) if d.startswith(f"{PREFIX}{parent.pid}-")]
        assert len(left) == 1 and left[0] in sweep(base) and not os.path.exists(os.path.join(base, left[0]))
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
