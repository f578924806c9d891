"""The cluster widget, headless: no frontend, the widgets' traits are what a page would show.

Each test drives a real gloo Cluster (the shared ``cluster_of(2)``) and reads the widget's
traits: button presses through ``.click()``, rank errors, progress from ``ddpkit.progress``,
the live plots of a recorded run (SVG text), the replay slider, the status line in the running
cell, and what a long chatty run costs the page and the kernel.
"""
from __future__ import annotations

import html
import re
import time

import pytest

import ddpkit

pytest.importorskip("ipywidgets")
from ddpkit.widget import ClusterWidget, show, trace_of  # noqa: E402


def statuses(w: ClusterWidget) -> list[str]:
    """The status word each rank row shows (the text inside its status span)."""
    out = []
    for s in w.ranks.status:
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


_OPEN: list = []


def request_close(w) -> None:
    _OPEN.append(w)


@pytest.fixture(autouse=True)
def _close_widgets():
    yield
    while _OPEN:
        _OPEN.pop().close()


@pytest.fixture
def widget(cluster_of, monkeypatch):
    c = cluster_of(2)
    c.run(int)  # the shared ranks start this test idle: an earlier test's rank error is over
    monkeypatch.setattr(c, "last_trace", None)  # and with no recorded run to show
    w = ClusterWidget(c, log_lines=10, cell_output=None)
    yield w
    w.close()
    w.cluster.record = False


def test_header_and_rank_rows_show_the_cluster(widget):
    c = widget.cluster
    assert "world size 2" in widget.header.value
    assert "backend gloo" in widget.header.value
    assert "devices cpu, cpu" in widget.header.value
    assert statuses(widget) == ["idle", "idle"]
    for r, row in zip(c.ranks, widget.ranks.status, strict=True):
        assert f"rank {r.rank}" in row.value and f"pid {r.pid}" in row.value
    assert widget.start_button.disabled and not widget.restart_button.disabled


def test_buttons_restart_stop_start(widget):
    c = widget.cluster
    old_pids = [r.pid for r in c.ranks]
    widget.restart_button.click()
    assert statuses(widget) == ["idle", "idle"]
    new_pids = [r.pid for r in c.ranks]
    assert set(new_pids).isdisjoint(old_pids)  # fresh processes
    assert all(f"pid {p}" in row.value for p, row in zip(new_pids, widget.ranks.status, strict=True))

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
    assert wait_for(lambda: "ValueError: boom from rank 1" in widget.ranks.logs[1].value, 2.0), \
        widget.ranks.logs[1].value
    assert "boom" not in widget.ranks.logs[0].value
    assert "in job" in widget.ranks.logs[1].value and "/ddpkit/cluster/" not in widget.ranks.logs[1].value  # user code

    widget.restart_button.click()
    assert statuses(widget) == ["idle", "idle"]
    assert "boom" not in widget.ranks.logs[1].value  # fresh ranks, fresh logs
    widget.cluster.run(print, "after the restart")
    assert statuses(widget) == ["idle", "idle"]
    assert wait_for(lambda: "after the restart" in widget.ranks.logs[1].value, 2.0)


def test_dead_rank_shows_dead_then_restart_recovers(widget):
    def job():
        import os

        if ddpkit.rank() == 1:
            os._exit(3)  # the process is gone, not just the job
        return "ok"

    seen = []
    widget.ranks.status[1].observe(lambda ch: seen.append(ch["new"]), names="value")
    with pytest.raises(ddpkit.RankError):
        widget.cluster.run(job)
    assert any(">dead</span>" in v for v in seen), seen
    # the cluster may restart its ranks after a fault; either way the reason stays readable
    assert statuses(widget)[1] in ("dead", "idle")
    assert "exited with code 3" in widget.ranks.logs[1].value, widget.ranks.logs[1].value
    assert not widget.restart_button.disabled
    widget.restart_button.click()
    assert statuses(widget) == ["idle", "idle"]
    assert "exited with code 3" not in widget.ranks.logs[1].value  # a fresh start, by request
    assert widget.cluster.run(ddpkit.rank) == [0, 1]


def test_log_shows_the_tail_of_what_each_rank_printed(widget):
    def job():
        for i in range(30):
            print(f"line {i} of rank {ddpkit.rank()}")

    widget.cluster.run(job)
    for r in (0, 1):
        assert wait_for(lambda r=r: f"line 29 of rank {r}" in widget.ranks.logs[r].value, 2.0)
        text = widget.ranks.logs[r].value
        assert f"line 20 of rank {r}" in text and f"line 19 of rank {r}" not in text  # 10 lines kept
        assert f"of rank {1 - r}" not in text


def test_log_updates_are_coalesced(widget):
    updates = []
    widget.ranks.logs[0].observe(lambda ch: updates.append(ch["new"]), names="value")

    def job():
        for i in range(400):
            print(f"chatty {i}")

    widget.cluster.run(job)
    assert wait_for(lambda: "chatty 399" in widget.ranks.logs[0].value, 2.0)
    assert len(updates) < 100, f"{len(updates)} log updates for 400 lines"


def test_progress_bar_follows_ddpkit_progress(widget):
    seen = []
    widget.progress.bar.observe(lambda ch: seen.append(ch["new"]), names="value")

    def job(n):
        for i in range(n):
            ddpkit.progress(i + 1, n)
            time.sleep(0.01)
        return n

    widget.cluster.run(job, 6)
    assert widget.progress.layout.display != "none"
    assert widget.progress.bar.max == 6 and widget.progress.bar.value == 6
    assert widget.progress.label.value == "6 / 6 steps"
    assert seen == sorted(seen) and len(set(seen)) >= 3  # it moved while the job ran

    widget.cluster.run(job, 4)  # a new run starts its own count
    assert widget.progress.bar.max == 4 and widget.progress.label.value == "4 / 4 steps"


def test_a_series_of_runs_is_labelled_with_its_overall_progress(widget):
    """compare announces each run (strategy, round, run i of N): the bar is the whole series."""
    def job(n):
        for i in range(n):
            ddpkit.progress(i + 1, n)

    widget.cluster.announce("overlapped, timing round 2 of 3", run=3, runs=4)
    widget.cluster.run(job, 5)
    label = widget.progress.label.value
    assert "overlapped, timing round 2 of 3" in label and "run 3 of 4" in label and "5 / 5 steps" in label
    assert widget.progress.bar.description == "overall" and widget.progress.bar.value == 750  # 3 of 4 runs
    widget.cluster.announce(None)
    assert widget.progress.label.value == "5 / 5 steps"


def test_plain_results_show_no_plots_and_one_line_says_why(widget):
    assert widget.live.layout.display == "none"  # before any run: nothing
    assert widget.cluster.run(ddpkit.rank) == [0, 1]
    assert widget.plots_done.wait(5)
    assert widget.live.mode == "empty" and widget.live.plots.layout.display == "none"
    # notebooks 01, 06, 07, 10 record nothing: scrolled back to, the widget says so in words
    assert widget.live.layout.display != "none"
    summary = widget.live.summary.value
    assert "No recorded run to draw" in summary and "<code>rank</code>" in summary and "recording off" in summary
    assert "cluster.recording()" in summary
    assert trace_of([0, 1]) is None and trace_of([[], []]) is None


def _train(steps, width=64, depth=6, cap=0.02, sleep=0.0, fail_at=None):
    """A job: an OverlappedDDP MLP trained with train_step, recording only if the cluster does."""
    import torch

    from ddpkit.experiment import local_batch, train_step
    from ddpkit.models import build_model

    module = build_model("mlp", seed=0, width=width, depth=depth)
    model = ddpkit.OverlappedDDP(module, bucket_cap_mb=cap)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        if step == fail_at and ddpkit.rank() == 1:
            raise ValueError(f"rank 1 gave up at step {step}")
        x, y = local_batch(module, 8, step, ddpkit.rank(), ddpkit.world_size())
        losses.append(float(train_step(model, opt, x, y)))
        ddpkit.progress(step + 1, steps)
        time.sleep(sleep)
    return losses


def test_plot_tabs_after_a_job_that_records_by_hand(widget):
    """Jobs written before recording was a switch (own Recorder, return rec.trace()) still plot."""
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
    assert trace_of(results) is not None and widget.cluster.last_trace is None  # not a recorded run
    assert wait_for(lambda: widget.live.mode == "replay") and widget.plots_done.wait(30)
    assert widget.live.layout.display != "none"
    assert widget.live.tabs.titles == ("bucket fill", "timeline", "memory")
    assert widget.live.step.value == 1 and (widget.live.step.min, widget.live.step.max) == (0, 1)
    assert "<svg" in widget.live.panes["fill"].value and "step 1" in widget.live.panes["fill"].value
    assert "<svg" in widget.live.panes["timeline"].value and "bucket 0" in widget.live.panes["timeline"].value

    widget.cluster.run(ddpkit.rank)  # a later untraced run keeps the last run's plots
    assert widget.plots_done.wait(5) and widget.live.mode == "replay"


def test_a_recorded_run_draws_while_it_goes_then_replays_any_step(widget):
    c = widget.cluster
    frames = {name: [] for name in ("fill", "timeline", "memory", "loss", "summary")}
    running = {"on": False}
    for name in frames:
        (widget.live.summary if name == "summary" else widget.live.panes[name]).observe(
            lambda ch, name=name: frames[name].append((running["on"], ch["new"])), names="value")
    widget.record_toggle.value = True  # the widget's switch is the cluster's
    assert c.record
    running["on"] = True
    losses = c.run(_train, 40, sleep=0.04)
    running["on"] = False
    widget.record_toggle.value = False
    assert not c.record

    # cluster.run returned exactly what the job returned; the trace is kept on the cluster
    assert len(losses) == 2 and all(len(ls) == 40 for ls in losses)
    trace = c.last_trace
    assert trace.ranks == [0, 1] and trace.steps == list(range(40))
    # the plots changed while the run went: several different frames before run() returned
    for name in ("fill", "timeline", "loss"):
        live = {v for during, v in frames[name] if during}
        assert len(live) >= 2, f"{name}: {len(live)} frame(s) during the run"
    assert any(during and "recording" in v for during, v in frames["summary"])
    # mid-run, before the first loss and memory sample: "not recorded" would be untrue (00 said so)
    assert not any(during and "not recorded" in v for name in ("loss", "memory") for during, v in frames[name])
    assert any(during and "<code>_train</code>" in v for during, v in frames["summary"])  # which run

    # after the run: replay. The slider picks a step; every view draws that step
    assert wait_for(lambda: widget.live.mode == "replay") and widget.plots_done.wait(30)
    assert (widget.live.step.min, widget.live.step.max, widget.live.step.value) == (0, 39, 39)
    widget.live.step.value = 7
    assert widget.plots_done.wait(10) and wait_for(lambda: "step 7" in widget.live.panes["fill"].value)
    assert "Bucket fill · rank 0 · step 7" in widget.live.panes["fill"].value
    assert "Timeline · step 7" in widget.live.panes["timeline"].value
    widget.live.rank.value = 1
    assert wait_for(lambda: "Bucket fill · rank 1 · step 7" in widget.live.panes["fill"].value)
    # memory over the whole run, its peak and what was live at it
    memory = widget.live.panes["memory"].value
    assert "Memory per rank over time" in memory and "peak" in memory and "parameters" in memory
    assert "optimizer state" in memory and "gradients" in memory
    # the loss per step is the ranks' mean, and the default-style model learns
    from ddpkit.trace import loss_per_step

    mean = loss_per_step(trace.records)
    assert mean[3] == pytest.approx((losses[0][3] + losses[1][3]) / 2, rel=1e-6)
    assert f"step 39: {mean[39]:.3f}" in widget.live.panes["loss"].value
    assert mean[39] < mean[0]
    # what the live plots drew from, batch by batch, is what the figures compute from the trace
    from ddpkit.trace import memory_series

    live = widget.live.state.snapshot()
    assert live["memory"] == {rank: memory_series(trace.records, rank) for rank in trace.ranks}
    assert live["loss"] == pytest.approx(mean)


def test_save_trace_writes_a_chrome_trace(cluster_of, tmp_path, monkeypatch):
    import json

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cluster_of(2), "last_trace", None)  # this cluster object only
    widget = ClusterWidget(cluster_of(2), cell_output=None)
    request_close(widget)
    assert widget.save_button.disabled
    widget.save_trace()  # nothing recorded yet: says so
    assert "nothing recorded" in widget.message.value
    with widget.cluster.recording():
        widget.cluster.run(_train, 2)
    assert wait_for(lambda: not widget.save_button.disabled)
    widget.save_button.click()
    written = list(tmp_path.glob("ddpkit-trace-*.json"))
    assert len(written) == 1 and "ui.perfetto.dev" in widget.message.value
    events = json.loads(written[0].read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1} and any(e["ph"] == "f" for e in events)  # flows too


def test_memory_not_recorded_is_said_not_drawn(widget):
    def job():  # records collectives and spans, no memory, no loss
        import torch

        module = torch.nn.Linear(8, 8)
        model = ddpkit.NaiveDDP(module)
        ddpkit.trace.seam.recorder().next_step()
        with ddpkit.trace.seam.recorder().span("forward"):
            model(torch.ones(2, 8)).sum().backward()
        model.finish_gradient_synchronization()

    import ddpkit.trace.seam  # noqa: F401

    with widget.cluster.recording():
        widget.cluster.run(job)
    assert wait_for(lambda: widget.live.mode == "replay") and widget.plots_done.wait(30)
    assert "not recorded" in widget.live.panes["memory"].value and "<svg" not in widget.live.panes["memory"].value
    assert "not recorded" in widget.live.panes["loss"].value


def _records_then_rank_1_fails(steps):
    """Records a few steps on each rank (no collectives), then rank 1 raises."""
    rec = ddpkit.trace.seam.recorder()
    for step in range(steps):
        rec.next_step()
        with rec.span("forward"):
            time.sleep(0.005)
        rec.loss(1.0 / (step + 1))
    if ddpkit.rank() == 1:
        raise ValueError(f"rank 1 gave up after {steps} steps")
    return "rank 0 finished"


def test_a_failing_rank_turns_red_and_the_partial_trace_is_kept(widget):
    import ddpkit.trace.seam  # noqa: F401  (the job reaches it as ddpkit.trace.seam)

    with pytest.raises(ddpkit.RankError), widget.cluster.recording():
        widget.cluster.run(_records_then_rank_1_fails, 5)
    assert statuses(widget) == ["idle", "error"]
    assert "ddpkit-failed" in widget.ranks.status[1].value and "ddpkit-failed" not in widget.ranks.status[0].value
    assert wait_for(lambda: "rank 1 gave up after 5 steps" in widget.ranks.logs[1].value, 2.0)
    assert "ddpkit-traceback" in widget.ranks.logs[1].value
    trace = widget.cluster.last_trace  # what both ranks recorded until then
    assert len(trace.select(rank=1, cat="loss")) == 5 and len(trace.select(rank=0, cat="loss")) == 5
    assert wait_for(lambda: widget.live.mode == "replay")


def test_a_long_run_shows_its_status_in_the_running_cell(cluster_of, monkeypatch):
    from ddpkit.widget import status

    monkeypatch.setattr(status, "LONG_S", 0.3)
    shown = []
    w = ClusterWidget(cluster_of(2), cell_output=shown.append)
    try:
        w.cluster.run(ddpkit.rank)  # short: nothing in the cell
        assert shown == []
        with w.cluster.recording():
            w.cluster.run(_train, 30, sleep=0.03)
        assert len(shown) == 1 and "ddpkit-cell-status" in shown[0]._dom_classes
        line = shown[0].value
        assert "finished after" in line and "2 ranks" in line and "loss" in line
    finally:
        w.close()


def test_the_header_says_what_carries_the_ranks_bytes(cluster_of):
    c = cluster_of(2)
    expected = {"shm": "gloo, bytes through shared memory", "gloo": "gloo"}[c.transport]
    assert c.carried_by == expected  # the command line's headers say the same (test_cli)
    w = ClusterWidget(c, cell_output=None)
    try:
        assert f"backend {expected} &middot;" in w.header.value
    finally:
        w.close()


def test_a_series_of_runs_has_one_status_line_that_follows_it_to_its_end(cluster_of, monkeypatch):
    """compare and validate run many short jobs from one cell: one line for the series, which
    ends with the series (its last run, its whole time), not with its first long enough run."""
    from ddpkit.series import Series
    from ddpkit.widget import status

    monkeypatch.setattr(status, "LONG_S", 0.3)
    shown = []
    c = cluster_of(2)
    w = ClusterWidget(c, cell_output=shown.append)
    try:
        start = time.monotonic()
        with Series(c, runs=3) as series:
            for label, pause in (("first", 0.5), ("second", 0.2), ("third", 0.2)):
                series.next(label)
                c.run(time.sleep, pause)
        took = time.monotonic() - start
        assert len(shown) == 1  # the first run showed it, the next ones moved it on
        line = html.unescape(shown[0].value)
        assert "third" in line and "run 3 of 3" in line  # where the series ended
        seconds = float(re.search(r"finished after (\d+\.\d) s", line).group(1))
        assert 0.85 <= seconds <= took + 0.05  # the whole series, not the first run's 0.5 s
        c.run(time.sleep, 0.5)  # a run of its own afterwards: a line of its own
        assert len(shown) == 2 and "finished after 0." in shown[1].value
    finally:
        w.close()


def test_a_strategy_run_says_where_the_network_was_faster_than_this_machine_can_emulate(cluster_of, monkeypatch):
    """Beside a strategy run's step time, the panel and the cell's status line say, in compare's
    words, when the machine's own transport could not keep up with the emulated link."""
    import html

    from ddpkit.comm.emulator import OUTRAN_NOTE, outran_note
    from ddpkit.experiment import run_strategy
    from ddpkit.widget import status
    from helpers import SMALL_MLP

    monkeypatch.setattr(status, "LONG_S", 0.0)  # every run gets its line in the cell
    shown = []
    c = cluster_of(2)
    w = ClusterWidget(c, cell_output=shown.append)
    try:
        c.network = "0,1000"     # 0 us, 1000 GB/s: this machine's transport takes longer than the link
        c.run(run_strategy, "bucketed", steps=2, model_kwargs=SMALL_MLP)
        assert re.search(r"bucketed: \d+\.\d\d ms/step", w.progress.label.value), w.progress.label.value
        note = html.unescape(w.progress.note.value)
        share = int(re.search(r"bucketed (\d+)%", note).group(1)) / 100
        assert share >= OUTRAN_NOTE and w.progress.note.layout.display != "none"
        assert outran_note({"bucketed": share}, "alpha 0 us, 1000 GB/s") in note  # compare's sentence
        assert "faster than this machine can emulate" in html.unescape(shown[-1].value)  # and in the cell

        c.network = "20000,0.1"  # 20 ms a message: the link is the slower, its times are the network's
        c.run(run_strategy, "bucketed", steps=2, model_kwargs=SMALL_MLP)
        assert "ms/step" in w.progress.label.value
        assert w.progress.note.value == "" and w.progress.note.layout.display == "none"
        assert "emulate" not in shown[-1].value

        c.run(ddpkit.rank)       # not a strategy run: no step time, no note
        assert "ms/step" not in w.progress.label.value and w.progress.note.value == ""
    finally:
        w.close()
        c.network = None


def test_a_cell_that_shuts_the_cluster_down_says_so(cluster_of):
    shown = []
    c = cluster_of(2)
    w = ClusterWidget(c, cell_output=shown.append)
    try:
        w.stop_button.click()  # the button: the widget says so, nothing goes to a cell
        assert shown == [] and "stopped by the stop button" in w.header.value
        w.start_button.click()
        assert "stopped" not in w.header.value
        c.shutdown()           # the notebook's own code: a note in its cell, and in the header
        assert len(shown) == 1 and "shut the cluster down" in shown[0].value
        assert "stopped by cluster.shutdown()" in w.header.value
    finally:
        w.close()
        c.start()


def test_a_chatty_run_neither_floods_the_page_nor_grows_the_kernel(widget):
    """Hundreds of steps, thousands of records a second: frames are bounded by the redraw rate,
    batches by the streaming rate, the widget's state by its window; the trace is complete."""
    import tracemalloc

    from ddpkit.trace.live import INTERVAL_S
    from ddpkit.widget.live import FRAME_S

    c = widget.cluster
    sent = []
    c.subscribe(lambda kind, rank, **f: sent.append(kind) if kind == "records" else None)
    updates = []
    for v in (*widget.live.panes.values(), widget.live.summary):
        v.observe(lambda ch: updates.append(1), names="value")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        t = time.monotonic()
        with c.recording():
            c.run(_train, 200, width=8, depth=12, cap=0.0)  # a bucket per tensor: ~90 records/step/rank
        took = time.monotonic() - t
        assert widget.plots_done.wait(30)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    trace = c.last_trace
    n = len(trace.records)
    assert n > 20_000, f"only {n} records: not the chatty run this test needs"
    # nothing lost: every gradient of every step of both ranks
    assert len(trace.select(cat="grad_ready")) == 200 * 26 * 2
    assert len(trace.select(cat="loss")) == 200 * 2
    # bounded traffic: one batch per rank per interval (plus the last), a frame per FRAME_S per view
    assert len(sent) <= 2 * (took / INTERVAL_S + 2), (len(sent), took)
    assert len(updates) <= 5 * (took / FRAME_S + 3), (len(updates), took)
    # bounded state: the widget keeps a window, whatever the run's length
    from ddpkit.widget.state import KEEP_STEPS, MEMORY_POINTS

    assert widget.live.state.size() <= KEEP_STEPS * 2 * 200 + 2 * MEMORY_POINTS + 300
    # the kernel keeps the trace (compactly) and little else
    assert held / n < 1500, f"{held / n:.0f} bytes per record kept"


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


def test_a_run_is_labelled_with_the_number_of_the_cell_it_runs_in(monkeypatch):
    """"cell [10]" beside prompt [9]: IPython 9.9+ moves ``execution_count`` on before the cell
    runs, older ones after it; the running cell's own result has its number under both."""
    import types

    import IPython

    from ddpkit.widget import panel

    class Shell:  # what the widget reads of IPython's shell while cell [9] runs
        def __init__(self, counter_moved_on: bool):
            self.execution_count = 10 if counter_moved_on else 9
            # IPython's ExecutionResult of the running cell: its execution_count is the cell's
            self.displayhook = types.SimpleNamespace(exec_result=types.SimpleNamespace(execution_count=9))

    for moved_on in (True, False):
        monkeypatch.setattr(IPython, "get_ipython", lambda moved_on=moved_on: Shell(moved_on))
        assert panel._cell_number() == 9
        assert panel.run_label("job", panel._cell_number()) == "<code>job</code> (cell [9])"
    idle = Shell(True)
    idle.displayhook.exec_result = None  # no cell running (a button's callback): no number rather than a wrong one
    monkeypatch.setattr(IPython, "get_ipython", lambda: idle)
    assert panel._cell_number() is None


# ----------------------------------------------------------------------------- the views alone
def _step_records(buckets: int, layers: int = 32, rank: int = 0, step: int = 0, unit: bool = False):
    """One overlapped-DDP-like step: 2 gradients per layer, buckets launched in order."""
    from ddpkit.trace import Record

    recs = [Record("span", "compute", "forward", rank, step, 0, 1_000_000),
            Record("span", "compute", "backward", rank, step, 1_000_000, 9_000_000)]
    names = ["head.bias", "head.weight"] + [f"layers.{i}.0.{w}" for i in reversed(range(layers))
                                            for w in ("bias", "weight")]
    per = -(-len(names) // buckets)
    for k, name in enumerate(names):
        recs.append(Record("instant", "grad_ready", name, rank, step, 1_000_000 + 100_000 * k, bucket=k // per))
    for b in range(buckets):
        t = 1_000_000 + 100_000 * min((b + 1) * per - 1, len(names) - 1)
        recs.append(Record("span", "comm", "all_reduce" if not unit else "all_gather", rank, step, t,
                           t + 2_000_000, nbytes=1 << 20, bucket=None if unit else b, unit=f"u{b}" if unit else None))
    recs.append(Record("span", "compute", "step", rank, step, 9_500_000, 9_800_000))
    return recs


def test_the_fill_view_has_a_readable_row_per_layer():
    from ddpkit.trace import bucket_fill
    from ddpkit.widget.fill_view import fill_view

    svg = fill_view(bucket_fill(_step_records(4), 0, 0))
    assert "66 gradients in 33 layers (a row each), 4 buckets" in svg
    labels = re.findall(r'text-anchor="end"[^>]*>([^<]+)</text>', svg)
    assert labels[:3] == ["head", "layers.31.0", "layers.30.0"] and "bucket 3 all_reduce" in labels
    assert len([lb for lb in labels if lb.startswith(("head", "layers"))]) == 33
    assert svg.count("<circle") == 66


def test_every_view_labels_at_11_px_or_more_and_asks_for_its_width():
    """At a 1400 px window the tabs get the plots' own width (the loss wraps below when there is no
    room beside them), so an SVG font size is the size on screen: none below 11 px."""
    from ddpkit.trace import Record, Trace, bucket_fill, memory_peak, memory_series, timeline
    from ddpkit.widget.fill_view import fill_view
    from ddpkit.widget.live import PLOT_WIDTH, LivePlots
    from ddpkit.widget.loss_view import loss_view
    from ddpkit.widget.memory_view import memory_view
    from ddpkit.widget.timeline_view import WIDTH, timeline_view

    recs = _step_records(4) + _step_records(4, rank=1)
    mem = [Record("counter", "memory", "memory", 0, s, 1_000_000 * s,
                  args={"parameters": 100, "communication_buffers": 50, "optimizer_state": 10}) for s in range(4)]
    views = [fill_view(bucket_fill(_step_records(4), 0, 0)), timeline_view(timeline(Trace(recs, 2), [0], [0, 1])),
             memory_view({0: memory_series(mem, 0)}, 0, memory_peak(mem)), loss_view({0: 2.0, 1: 1.5, 2: 1.0})]
    for svg in views:
        sizes = [int(v) for v in re.findall(r'font-size="(\d+)"', svg)]
        assert sizes and min(sizes) >= 11, sizes
    assert PLOT_WIDTH >= WIDTH
    plots = LivePlots()
    try:
        assert plots.tabs.layout.flex == f"1 1 {PLOT_WIDTH}px"
    finally:
        plots.close()


def test_the_live_summary_never_says_step_none_and_the_loss_waits_for_every_rank():
    """Setup records only: "setting up", not "step None". A step whose loss one rank has sent and
    the other not yet: neither the status nor the plot shows it; both end on the same complete step."""
    from ddpkit.trace import Record
    from ddpkit.widget.live import LivePlots
    from ddpkit.widget.state import LiveState

    plots = LivePlots()
    try:
        plots.start(2)
        plots.state.add(0, [Record("span", "comm", "broadcast", 0, None, 0, 10)])
        summary = plots._live_frame()[0]
        assert "None" not in summary and "setting up" in summary
    finally:
        plots.close()
    state = LiveState(2)
    loss = lambda rank, step, v: Record("counter", "loss", "loss", rank, step, step, args={"loss": v})  # noqa: E731
    state.add(0, [loss(0, 0, 1.0), loss(0, 1, 0.5)])
    state.add(1, [loss(1, 0, 3.0)])  # rank 1's loss of step 1 is still on its way
    assert state.latest_loss() == (0, 2.0)
    assert state.snapshot()["loss"] == {0: 2.0}
    state.add(1, [loss(1, 1, 1.5)])
    assert state.latest_loss() == (1, 1.0) and state.snapshot()["loss"] == {0: 2.0, 1: 1.0}


def _only_communicates():
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    return float(t[0])


def test_a_later_recorded_run_without_steps_keeps_the_last_run_with_steps(widget):
    """02 used to end on "recorded run: 0 steps ... no training steps": a recorded run that only
    communicated replaced the training run above it. Now the training run stays, and says so."""
    c = widget.cluster
    with c.recording():
        c.run(_train, 4)
    assert wait_for(lambda: widget.live.mode == "replay") and widget.plots_done.wait(30)
    with c.recording():
        assert c.run(_only_communicates) == [2.0, 2.0]
    assert c.last_trace.steps == [] and c.last_trace.records  # the cluster keeps what it recorded
    assert widget.plots_done.wait(30)
    assert wait_for(lambda: "no training step" in widget.live.summary.value)
    assert "4 steps on 2 ranks" in widget.live.summary.value
    assert "<code>_train</code>" in widget.live.summary.value and "<code>_only_communicates</code>" in \
        widget.live.summary.value  # the run drawn, and the later one that was not
    assert "Bucket fill · rank 0 · step 3" in widget.live.panes["fill"].value
    # the status line of an unrecorded run names no loss (the recorded run's is not its own)
    c.run(int)
    assert "loss" not in widget._describe("now")


def _steps_without_compute():
    """A recorded job that counts steps but computes nothing: only collectives, between steps begun by
    hand (a loop through a wrapper would now be timed by the wrapper: ``forward_timed``)."""
    import torch
    import torch.distributed as dist

    from ddpkit.trace.seam import recorder

    for _ in range(2):
        recorder().next_step()
        dist.all_reduce(torch.ones(4))


def test_a_later_recorded_run_that_did_not_train_keeps_the_run_that_did(widget):
    """A run with steps but no compute (once 02's no_sync demo) would draw empty rows, "0 % hidden"."""
    c = widget.cluster
    with c.recording():
        c.run(_train, 3)
    assert wait_for(lambda: widget.live.mode == "replay") and widget.plots_done.wait(30)
    with c.recording():
        c.run(_steps_without_compute)
    assert c.last_trace.steps, "the steps begun by hand"
    assert widget.plots_done.wait(30)
    assert wait_for(lambda: "<code>_steps_without_compute</code>" in widget.live.summary.value)
    summary = widget.live.summary.value
    assert re.search(r"recorded run</b> of <code>_train</code>( \(cell \[\d+\]\))?: 3 steps", summary), summary
    assert "no training step" in summary
    assert "Bucket fill · rank 0 · step 2" in widget.live.panes["fill"].value


def _fsdp_step(units: int = 20, rank: int = 0, step: int = 0):
    """An FSDP-like step: an all-gather per unit in forward, backward with more all-gathers and
    reduce-scatters in flight together, no gradient-ready records."""
    from ddpkit.trace import Record

    recs = [Record("span", "compute", "forward", rank, step, 0, 4_000_000),
            Record("span", "compute", "backward", rank, step, 5_000_000, 20_000_000)]
    for u in range(units):  # forward: one at a time, all before backward's shading
        recs.append(Record("span", "comm", "all_gather", rank, step, 100_000 + 150_000 * u,
                           200_000 + 150_000 * u, nbytes=1 << 16, unit=f"u{u}"))
    for u in range(units):  # backward: each unit's all-gather overlaps the last one's reduce-scatter
        t = 5_000_000 + 700_000 * u
        recs.append(Record("span", "comm", "all_gather", rank, step, t, t + 500_000, nbytes=1 << 16, unit=f"u{u}"))
        recs.append(Record("span", "comm", "reduce_scatter", rank, step, t + 300_000, t + 900_000, nbytes=1 << 16,
                           unit=f"u{u}"))
    return recs


def test_the_fill_view_of_fsdp_counts_as_its_title_does_and_says_where_time_starts():
    """05 and 09: "99 collectives" in the title, "93 collectives" on the first row (that row's own
    count), and "ms since backward started" under forward's all-gathers, which come before it."""
    from ddpkit.trace import bucket_fill
    from ddpkit.viz import plot_bucket_fill
    from ddpkit.widget.fill_view import fill_view

    fig = bucket_fill(_fsdp_step(), 0, 0)
    assert fig.packed and len(fig.comm) == 60 and fig.origin == "the step's first collective launched"
    svg = fill_view(fig)
    assert "60 collectives, no gradient-ready records" in svg
    labels = re.findall(r'text-anchor="end"[^>]*>([^<]+)</text>', svg)
    assert labels[:2] == ["collectives", "2nd in flight"] and not any(re.match(r"\d+ collectives", lb) for lb in labels)
    assert "launched while the rows above were still in flight" in svg  # the rows say what they are
    assert "ms since the step&#x27;s first collective launched" in svg and "since backward started" not in svg
    assert "since backward started" in fill_view(bucket_fill(_step_records(4), 0, 0))  # DDP: backward comes first
    axes = plot_bucket_fill(_fsdp_step()).axes
    assert axes[-1].get_xlabel() == "time since the step's first collective launched (ms)"


def test_an_fsdp_run_opens_on_the_timeline_a_ddp_run_on_the_bucket_fill():
    """09 opened on the bucket fill tab, which for FSDP says "no gradient-ready records"."""
    from ddpkit.trace import Trace
    from ddpkit.widget.live import LivePlots

    plots = LivePlots()
    try:
        plots.show_trace(Trace(_fsdp_step() + _fsdp_step(rank=1), 2), "fsdp")
        plots._replay_frame()
        assert plots.tabs.selected_index == 1  # the timeline
        plots.show_trace(Trace(_step_records(4) + _step_records(4, rank=1), 2), "ddp")
        plots._replay_frame()
        assert plots.tabs.selected_index == 0  # back to the bucket fill the widget had left
        plots.tabs.selected_index = 2           # the learner picks memory: it stays
        plots.show_trace(Trace(_fsdp_step() + _fsdp_step(rank=1), 2), "fsdp")
        plots._replay_frame()
        assert plots.tabs.selected_index == 2
    finally:
        plots.close()


def test_a_new_figure_is_its_view_and_one_entry_in_the_list(monkeypatch):
    """Issue 48.7: the views were positional (four widgets, tab titles, a five-way zip, five-tuples):
    a figure is now a ``View`` and an entry in ``live.VIEWS``; its pane, tab, empty words follow."""
    from ddpkit.trace import Record, Trace
    from ddpkit.widget import live
    from ddpkit.widget.view import View

    def figure(frame, empty):
        return empty if frame.step is None else f"<p>{len(frame.records.records)} records of step {frame.step}</p>"

    count = View("count", "records", figure, pending="counting", missing="no steps to count")
    monkeypatch.setattr(live, "VIEWS", (*live.VIEWS, count))
    plots = live.LivePlots()
    try:
        assert plots.tabs.titles == ("bucket fill", "timeline", "memory", "records")
        assert "ddpkit-count-view" in plots.panes["count"]._dom_classes
        assert plots.plots.children == (plots.tabs, plots.panes["loss"])  # beside the tabs: title None
        plots.start(1)
        plots.state.add(0, [Record("span", "comm", "broadcast", 0, None, 0, 10)])
        plots._paint()
        assert plots.panes["count"].value == "counting"  # while live: what is coming
        plots.show_trace(Trace([Record("span", "comm", "broadcast", 0, None, 0, 10)], 1), "setup only")
        plots._paint()
        assert plots.panes["count"].value == "no steps to count"  # after the run: what it did not record
        plots.show_trace(Trace(_step_records(4), 1), "ddp")
        plots._paint()
        assert plots.panes["count"].value == f"<p>{len(_step_records(4))} records of step 0</p>"
        assert "Bucket fill · rank 0 · step 0" in plots.panes["fill"].value
        assert plots.tabs.selected_index == 0  # the new tab does not open itself: the bucket fill still does
    finally:
        plots.close()


def test_the_replay_never_draws_one_run_with_another_runs_index():
    """04's rounds of recorded runs, back to back: the next run's trace arrived (and emptied the
    index) while the painter drew the last one: KeyError 'steps', or a stale index kept for good."""
    from ddpkit.trace import Trace
    from ddpkit.widget.live import LivePlots

    two = Trace([r for s in range(2) for r in _step_records(4, step=s)], 1)
    three = Trace([r for s in range(3) for r in _step_records(4, step=s)], 1)
    plots = LivePlots()
    try:
        plots.show_trace(two, "first")
        plots._index(two)
        stale = plots._replay
        plots.show_trace(three, "second")
        plots._replay = stale  # the painter of the first run stored its index after the second arrived
        assert "3 steps on 1 rank" in plots._replay_frame()[0]
        plots._replay = {}     # ... or the second emptied it while the painter read it
        assert "3 steps on 1 rank" in plots._replay_frame()[0]
    finally:
        plots.close()


def test_the_kits_own_jobs_are_named_as_the_learner_started_them():
    """06 ended "No recorded run to draw: the last run, set_network": the job behind cluster.network = ..."""
    from ddpkit.widget.panel import run_label

    assert run_label("set_network", 12) == "setting <code>cluster.network</code> (cell [12])"
    assert run_label("naive_job", None) == "<code>naive_job</code>"


def test_the_timeline_view_gives_each_bucket_a_row_and_packs_many():
    from ddpkit.trace import Trace, overlap_fraction, timeline
    from ddpkit.widget.timeline_view import timeline_view

    recs = _step_records(4) + _step_records(4, rank=1)
    svg = timeline_view(timeline(Trace(recs, 2), [0], [0, 1]))
    assert [svg.count(f">bucket {b}<") for b in range(4)] == [2, 2, 2, 2]  # per rank, a row per bucket
    assert f"{overlap_fraction(Trace(recs, 2), steps=[0]):.0%} of communication time hidden" in svg
    assert "backward waiting for communication" in svg  # the span after the last gradient
    many = timeline_view(timeline(_step_records(20), [0], [0]))
    assert ">bucket 0<" not in many and many.count("<rect") > 20  # 20 buckets: packed rows
    fsdp = timeline_view(timeline(_step_records(9, unit=True), [0], [0]))
    assert ">collectives<" in fsdp and ">2nd in flight<" in fsdp and "all_gather u3" in fsdp  # FSDP's units: packed
    assert "launched while the rows above were still in flight" in fsdp  # the rows say what they are


def test_memory_and_loss_views_say_not_recorded_and_show_the_peak():
    from ddpkit.trace import Record, memory_peak, memory_series
    from ddpkit.widget.loss_view import loss_view
    from ddpkit.widget.memory_view import memory_view

    assert "not recorded" in memory_view({}, 0) and "<svg" not in memory_view({}, 0)
    assert "not recorded" in loss_view({})
    recs = [Record("counter", "memory", "memory", 0, s, 1_000_000 * s,
                   args={"parameters": 100, "gradients": 50 * (s % 2), "activations": 30 * (s == 3)})
            for s in range(6)]
    svg = memory_view({0: memory_series(recs, 0)}, 0, memory_peak(recs), marker_step=2)
    assert "peak 180 B on rank 0, step 3" in svg and "activations 30 B" in svg and 'stroke-dasharray="3,3"' in svg
    assert "step 0: 2.000  -&gt;  step 2: 1.000" in loss_view({0: 2.0, 1: 1.5, 2: 1.0}, marker_step=1)


def _torch_ddp_steps(steps):
    """A job: torch's own DDP (a small cap: several buckets) trained ``steps`` steps."""
    from ddpkit.experiment import local_batch, train_step, wrap
    from ddpkit.models import build_model

    module = build_model("mlp", seed=0, width=64, depth=6)
    model, opt = wrap("torch_ddp", module, bucket_cap_mb=0.02)
    for step in range(steps):
        train_step(model, opt, *local_batch(module, 8, step, ddpkit.rank(), ddpkit.world_size()))


def test_the_widget_and_the_plot_draw_torch_ddps_buckets_as_the_figure_has_them(widget):
    """torch's reducer picks the buckets (its gradient hooks cannot know them): the figure takes
    each gradient's bucket from the all-reduce that carried it, and both views draw exactly that."""
    from ddpkit.trace import bucket_fill, bucket_fill_order
    from ddpkit.viz import plot_bucket_fill
    from ddpkit.viz.style import bucket_colour

    with widget.cluster.recording():
        widget.cluster.run(_torch_ddp_steps, 3)
    trace = widget.cluster.last_trace
    order = bucket_fill_order(trace, rank=0, step=-1)
    fill = bucket_fill(trace, rank=0, step=-1)
    assert order == fill.ready and len(order) == 14  # 7 Linears: a weight and a bias each
    assert None not in {b for _, b, _ in order} and len(fill.buckets) >= 3  # every gradient in a bucket

    assert wait_for(lambda: widget.live.mode == "replay") and widget.plots_done.wait(30)
    svg = widget.live.panes["fill"].value
    assert f"step {fill.step}" in svg
    dots = re.findall(r'<circle [^>]*fill="([^"]+)"[^>]*><title>([^<:]+): bucket (\S+), ready', svg)
    assert sorted((name, int(b), colour) for colour, name, b in dots) == \
        sorted((name, b, bucket_colour(b)) for name, b, _ in order)  # no grey "bucket None" dot

    from matplotlib.colors import to_hex

    top = plot_bucket_fill(trace, rank=0, step=-1).axes[0]
    drawn = sorted(to_hex(c) for coll in top.collections for c in coll.get_facecolors())
    assert drawn == sorted(bucket_colour(b) for _, b, _ in order)
