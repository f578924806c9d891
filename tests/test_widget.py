"""The cluster widget, headless: no frontend, the widgets' traits are what a page would show.

Each test drives a real gloo Cluster (the shared ``cluster_of(2)``) and reads the widget's
traits: button presses through ``.click()``, rank errors, progress from ``ddpkit.progress``,
and the plot tabs after a traced run.
"""
from __future__ import annotations

import time

import pytest

import ddpkit

pytest.importorskip("ipywidgets")
from ddpkit.widget import ClusterWidget, show, trace_of  # noqa: E402


def statuses(w: ClusterWidget) -> list[str]:
    """The status word each rank row shows (the text inside its status span)."""
    out = []
    for s in w.rank_status:
        v = s.value
        i = v.index("class='ddpkit-status'")
        out.append(v[v.index(">", i) + 1: v.index("</span>", i)])
    return out


def wait_for(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.fixture
def widget(cluster_of):
    w = ClusterWidget(cluster_of(2), log_lines=10)
    yield w
    w.close()


def test_header_and_rank_rows_show_the_cluster(widget):
    c = widget.cluster
    assert "world size 2" in widget.header.value
    assert "backend gloo" in widget.header.value
    assert "devices cpu, cpu" in widget.header.value
    assert statuses(widget) == ["idle", "idle"]
    for r, row in zip(c.ranks, widget.rank_status, strict=True):
        assert f"rank {r.rank}" in row.value and f"pid {r.pid}" in row.value
    assert widget.start_button.disabled and not widget.restart_button.disabled


def test_buttons_restart_stop_start(widget):
    c = widget.cluster
    old_pids = [r.pid for r in c.ranks]
    widget.restart_button.click()
    assert statuses(widget) == ["idle", "idle"]
    new_pids = [r.pid for r in c.ranks]
    assert set(new_pids).isdisjoint(old_pids)  # fresh processes
    assert all(f"pid {p}" in row.value for p, row in zip(new_pids, widget.rank_status, strict=True))

    widget.stop_button.click()
    assert statuses(widget) == ["stopped", "stopped"]
    assert [r.status for r in c.ranks] == ["stopped", "stopped"]
    assert not widget.start_button.disabled and widget.stop_button.disabled
    assert not widget.restart_button.disabled  # restart also starts stopped ranks

    widget.start_button.click()
    assert statuses(widget) == ["idle", "idle"]
    assert c.run(ddpkit.rank) == [0, 1]
    assert widget.start_button.disabled and not widget.stop_button.disabled
    assert widget.message.value == ""


def test_failed_button_action_is_shown_not_raised(widget, monkeypatch):
    widget.stop_button.click()

    def broken():
        raise RuntimeError("cannot start today")

    monkeypatch.setattr(widget.cluster, "start", broken)  # this cluster object only
    widget.start_button.click()
    assert "cannot start today" in widget.message.value
    assert statuses(widget) == ["stopped", "stopped"]
    assert not widget.start_button.disabled  # still usable
    monkeypatch.undo()
    widget.start_button.click()
    assert statuses(widget) == ["idle", "idle"] and widget.message.value == ""


def test_rank_error_shows_status_and_traceback_then_restart_recovers(widget):
    def job():
        if ddpkit.rank() == 1:
            raise ValueError("boom from rank 1")
        return "ok"

    with pytest.raises(ddpkit.RankError):
        widget.cluster.run(job)
    assert statuses(widget) == ["idle", "error"]
    assert wait_for(lambda: "ValueError: boom from rank 1" in widget.rank_logs[1].value, 2.0), \
        widget.rank_logs[1].value
    assert "boom" not in widget.rank_logs[0].value

    widget.restart_button.click()
    assert statuses(widget) == ["idle", "idle"]
    assert "boom" not in widget.rank_logs[1].value  # fresh ranks, fresh logs
    widget.cluster.run(print, "after the restart")
    assert statuses(widget) == ["idle", "idle"]
    assert wait_for(lambda: "after the restart" in widget.rank_logs[1].value, 2.0)


def test_dead_rank_shows_dead_then_restart_recovers(widget):
    def job():
        import os

        if ddpkit.rank() == 1:
            os._exit(3)  # the process is gone, not just the job
        return "ok"

    seen = []
    widget.rank_status[1].observe(lambda ch: seen.append(ch["new"]), names="value")
    with pytest.raises(ddpkit.RankError):
        widget.cluster.run(job)
    assert any(">dead</span>" in v for v in seen), seen
    # the cluster may restart its ranks after a fault; either way the reason stays readable
    assert statuses(widget)[1] in ("dead", "idle")
    assert "exited with code 3" in widget.rank_logs[1].value, widget.rank_logs[1].value
    assert not widget.restart_button.disabled
    widget.restart_button.click()
    assert statuses(widget) == ["idle", "idle"]
    assert "exited with code 3" not in widget.rank_logs[1].value  # a fresh start, by request
    assert widget.cluster.run(ddpkit.rank) == [0, 1]


def test_log_shows_the_tail_of_what_each_rank_printed(widget):
    def job():
        for i in range(30):
            print(f"line {i} of rank {ddpkit.rank()}")

    widget.cluster.run(job)
    for r in (0, 1):
        assert wait_for(lambda r=r: f"line 29 of rank {r}" in widget.rank_logs[r].value, 2.0)
        text = widget.rank_logs[r].value
        assert f"line 20 of rank {r}" in text and f"line 19 of rank {r}" not in text  # 10 lines kept
        assert f"of rank {1 - r}" not in text


def test_log_updates_are_coalesced(widget):
    updates = []
    widget.rank_logs[0].observe(lambda ch: updates.append(ch["new"]), names="value")

    def job():
        for i in range(400):
            print(f"chatty {i}")

    widget.cluster.run(job)
    assert wait_for(lambda: "chatty 399" in widget.rank_logs[0].value, 2.0)
    assert len(updates) < 100, f"{len(updates)} log updates for 400 lines"


def test_progress_bar_follows_ddpkit_progress(widget):
    seen = []
    widget.progress.observe(lambda ch: seen.append(ch["new"]), names="value")

    def job(n):
        for i in range(n):
            ddpkit.progress(i + 1, n)
            time.sleep(0.01)
        return n

    widget.cluster.run(job, 6)
    assert widget.progress_box.layout.display != "none"
    assert widget.progress.max == 6 and widget.progress.value == 6
    assert widget.progress_label.value == "6 / 6 steps"
    assert seen == sorted(seen) and len(set(seen)) >= 3  # it moved while the job ran

    widget.cluster.run(job, 4)  # a new run starts its own count
    assert widget.progress.max == 4 and widget.progress_label.value == "4 / 4 steps"


def test_plain_results_show_no_plots(widget):
    assert widget.cluster.run(ddpkit.rank) == [0, 1]
    assert widget.plots_done.wait(5)
    assert widget.plots.layout.display == "none" and not widget.plots.children
    assert trace_of([0, 1]) is None and trace_of([[], []]) is None


def test_plot_tabs_after_a_traced_run(widget):
    def job():
        import torch

        from ddpkit.experiment import local_batch, train_step
        from ddpkit.models import build_model
        from ddpkit.trace import Recorder

        rec = Recorder()
        module = build_model("mlp", seed=0, width=64, depth=6)
        model = ddpkit.BucketedDDP(module, bucket_cap_mb=0.02, recorder=rec)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(2):
            rec.next_step()
            x, y = local_batch(module, 8, step, ddpkit.rank(), ddpkit.world_size())
            train_step(model, opt, x, y, recorder=rec)
        return rec.trace()

    results = widget.cluster.run(job)
    assert trace_of(results) is not None
    assert widget.plots_done.wait(60)
    assert widget.plots.layout.display != "none"
    assert widget.plots.titles == ("bucket fill", "timeline", "memory")
    pngs = [getattr(child, "value", b"") for child in widget.plots.children]
    assert all(png[:8] == b"\x89PNG\r\n\x1a\n" for png in pngs), [png[:8] for png in pngs]

    # drawing happens off the caller's thread: show_results returns before the plots exist
    widget.show_results(results)
    assert not widget.plots_done.is_set()
    assert widget.plots_done.wait(60)

    widget.cluster.run(ddpkit.rank)  # a later untraced run keeps the last run's plots
    assert widget.plots_done.wait(5) and len(widget.plots.children) == 3


def test_a_closed_widget_stops_following_and_display_makes_a_new_one(cluster_of, monkeypatch):
    import IPython.display

    c = cluster_of(2)
    shown = []
    monkeypatch.setattr(IPython.display, "display", shown.append)
    show(c)
    show(c)
    assert shown[0] is shown[1]  # one widget per cluster while it is open
    first = shown[0]
    assert first._on_event in c._events.observers
    first.close()
    assert first._on_event not in c._events.observers
    show(c)
    assert shown[-1] is not first and not shown[-1]._closed
    shown[-1].close()


def test_ipython_displays_a_cluster_as_its_widget(cluster_of, monkeypatch):
    """A Cluster as a cell's value shows its widget, though the cluster imports no widget code."""
    import IPython.display
    from IPython.core.interactiveshell import InteractiveShell

    import ddpkit

    shell = InteractiveShell.instance()
    ddpkit._show_clusters_as_widgets()
    shown = []
    monkeypatch.setattr(IPython.display, "display", shown.append)
    c = cluster_of(2)
    assert shell.display_formatter.ipython_display_formatter(c) is True
    assert isinstance(shown[-1], ClusterWidget) and shown[-1].cluster is c
    shown[-1].close()
    assert "ddpkit.widget" not in open(ddpkit.cluster.__file__).read()
