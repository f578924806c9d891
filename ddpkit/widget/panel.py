"""ClusterWidget: what a displayed ``ddpkit.Cluster`` shows, and the observer that keeps it current.

Top to bottom: a header (world size, backend, devices, and how the cluster stopped if it did);
start / restart / stop, a **record** toggle (``cluster.record``) and **save trace** (the last
recorded run as a Chrome trace for Perfetto); one row per rank (``RankRows``); after a desync, each
rank's collectives around the one where they parted (``desync_view``), kept until the next desync
under a line naming the run it came from; the run's progress and, after a strategy run, its step
time, with a note where the emulated network was faster than this machine can emulate
(``RunProgress``); the plots of a recorded run, live and then replayed (``LivePlots``), or a line
saying that no run was recorded. During a long run a compact status line also appears in the
running cell (``CellStatus``).

A learner scrolls back to the widget after Run All: whatever it still shows names its run (the
job's function and the cell it ran in, ``run_label``).

Threads. The cluster calls ``_on_event`` from its pipe-reader threads (log lines) and from the
thread that waits in ``cluster.run`` (everything else). The observer only updates state and sets
traits, which ipywidgets sends to the page from whichever thread sets them, so nothing waits for
the kernel to become idle; what is slow or frequent (logs, drawing) goes through a ``Throttle``.
"""
from __future__ import annotations

import html
import logging
import os
import time

import ipywidgets as widgets

from ddpkit.widget.desync_view import desync_view
from ddpkit.widget.live import LivePlots
from ddpkit.widget.progress import RunProgress
from ddpkit.widget.ranks import STATUS_COLOURS, RankRows
from ddpkit.widget.status import CellStatus, kernel_display

log = logging.getLogger("ddpkit.widget")


def _cell_number() -> int | None:
    """The number of the notebook cell running now (its "[8]"), or None outside a running cell.

    Read from the running cell's own result, not ``shell.execution_count``: IPython up to 9.8
    moves that counter on after the cell, 9.9 and later before it runs (ipython#15088), so the
    counter is one too high in a new kernel; the result holds the cell's number in both."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    result = getattr(getattr(shell, "displayhook", None), "exec_result", None)  # set while a cell runs
    return getattr(result, "execution_count", None)


# Jobs the kit runs on the ranks itself, in the words of what the learner did to start them.
KIT_JOBS = {"set_network": "setting <code>cluster.network</code>"}


def run_label(name: str | None, cell: int | None) -> str:
    """HTML naming a run: "<code>naive_job</code> (cell [8])", "a lambda (cell [3])", "a job",
    "setting <code>cluster.network</code> (cell [12])" (a job of the kit's own, ``KIT_JOBS``)."""
    if name in KIT_JOBS:
        what = KIT_JOBS[name]
    elif not name or name == "<lambda>":
        what = "a lambda" if name else "a job"
    else:
        what = f"<code>{html.escape(name)}</code>"
    return what + (f" (cell [{cell}])" if cell is not None else "")


def trace_of(results):
    """The run's merged ``ddpkit.trace.Trace`` if ``results`` are traces, else None.

    A run is traced when every rank returned a ``Trace`` (``recorder.trace()``), a ``Recorder``,
    or a list of ``Record`` (jobs that record by hand); their records are merged into one Trace.
    """
    from ddpkit.trace import Record, Recorder, Trace

    if not isinstance(results, (list, tuple)) or not results:
        return None
    for part in results:
        if isinstance(part, (Trace, Recorder)):
            continue
        if not (isinstance(part, (list, tuple)) and all(isinstance(r, Record) for r in part)):
            return None
    trace = Trace.merge(results)
    return trace if trace.records else None


class ClusterWidget(widgets.VBox):
    """An ipywidgets view of a Cluster: status and log per rank, buttons, progress, plots.

    ``cell_output``: how to show something in the running cell (default: IPython's
    ``display`` inside a notebook kernel, else nothing)."""

    def __init__(self, cluster, log_lines: int = 200, cell_output="kernel"):
        self.cluster = cluster
        self.header = widgets.HTML()
        self.start_button = widgets.Button(description="start", icon="play", tooltip="start the ranks")
        self.restart_button = widgets.Button(description="restart", icon="refresh",
                                             tooltip="stop every rank and start fresh ones")
        self.stop_button = widgets.Button(description="stop", icon="stop", tooltip="stop every rank")
        for button, action in ((self.start_button, "start"), (self.restart_button, "restart"),
                               (self.stop_button, "shutdown")):
            button.on_click(lambda _b, action=action: self._act(action))
        self.record_toggle = widgets.ToggleButton(value=cluster.record, description="record", icon="circle",
                                                  tooltip="record the next runs: live plots, then a step slider")
        self.record_toggle.observe(self._toggle_recording, names="value")
        self.save_button = widgets.Button(description="save trace", icon="download", disabled=True,
                                          tooltip="write the last recorded run as a Chrome trace (open it in "
                                                  "ui.perfetto.dev)")
        self.save_button.on_click(lambda _b: self.save_trace())
        for b in (self.start_button, self.restart_button, self.stop_button, self.record_toggle, self.save_button):
            b.layout.width = "auto"
        self.message = widgets.HTML()  # what a button did, or why it failed
        self.ranks = RankRows(cluster, log_lines)
        self.progress = RunProgress(cluster)
        self.live = LivePlots()
        self.desync_note = widgets.HTML(layout=widgets.Layout(display="none"))  # which run parted
        self.desync_note.add_class("ddpkit-desync-note")
        self.desync = widgets.HTML(layout=widgets.Layout(display="none"))  # the last desync's lanes
        self.desync.add_class("ddpkit-desync-view")
        self.cell_status = CellStatus(self._describe, kernel_display() if cell_output == "kernel" else cell_output)
        self._stopped_how = ""     # how the ranks came to be stopped, for the header
        self._by_button = False    # a button is acting (its effects are not the notebook's doing)
        self._recorded_run = False
        self._run = run_label(None, None)  # the job running now, or the last one
        self._series = False       # the job runs inside an announced series (compare, a sweep)
        self._closed = False
        super().__init__([
            self.header,
            widgets.HBox([self.start_button, self.restart_button, self.stop_button, self.record_toggle,
                          self.save_button, self.message], layout=widgets.Layout(flex_flow="row wrap")),
            self.ranks, self.desync_note, self.desync, self.progress, self.live,
        ])
        self.add_class("ddpkit-cluster")
        self.refresh()
        if cluster.last_trace is not None:
            self._show_trace(cluster.last_trace, "a run from before this widget was shown")
        cluster.subscribe(self._on_event)

    # ------------------------------------------------------------------ buttons
    def _act(self, action: str) -> None:
        """``cluster.<action>()`` for a button; a failure is shown here (a click has no cell to raise in)."""
        for b in (self.start_button, self.restart_button, self.stop_button):
            b.disabled = True
        self.message.value = ""
        self.ranks.errors.clear()  # the user asked for a fresh start (or a stop): old errors are done
        self._by_button = True
        try:
            getattr(self.cluster, action)()
            if action == "shutdown":
                self._stopped_how = f"by the stop button at {time.strftime('%H:%M:%S')}"
        except Exception as exc:
            log.debug("cluster widget: %s failed", action, exc_info=True)
            self.message.value = (f"<span style='color:{STATUS_COLOURS['error']}'>"
                                  f"{html.escape(type(exc).__name__)}: {html.escape(str(exc))}</span>")
        finally:
            self._by_button = False
            self.refresh()

    def _toggle_recording(self, change) -> None:
        self.cluster.record = change["new"]

    def save_trace(self, path: str | None = None) -> str | None:
        """Write the last recorded run as Chrome trace JSON (``ddpkit.trace.to_chrome_trace``)."""
        from ddpkit.trace import to_chrome_trace

        trace = self.live.trace
        if trace is None:
            self.message.value = "nothing recorded yet: switch on record (or use cluster.recording()) and run a job"
            return None
        path = path or f"ddpkit-trace-{time.strftime('%Y%m%d-%H%M%S')}.json"
        try:
            to_chrome_trace(trace, path)
        except OSError as exc:
            self.message.value = f"<span style='color:#c62828'>could not write {html.escape(path)}: {exc}</span>"
            return None
        self.message.value = (f"wrote <code>{html.escape(os.path.abspath(path))}</code>: open it at "
                              "<a href='https://ui.perfetto.dev' target='_blank'>ui.perfetto.dev</a>")
        return path

    # ------------------------------------------------------------------ events from the cluster
    def close(self) -> None:
        """Close the widget and stop following the cluster."""
        self._closed = True
        self.cluster.unsubscribe(self._on_event)
        self.ranks.close()
        self.live.close()
        super().close()

    def _on_event(self, kind: str, rank, **fields) -> None:
        """The cluster's observer: cheap, sets state and traits only."""
        if self._closed:
            return
        if kind == "status":
            self._status(rank, fields)
        elif kind == "log":
            self.ranks.changed(rank)
        elif kind == "progress":
            self.progress.update()
        elif kind == "records":
            self.live.add(rank, fields["records"])
        elif kind == "job":
            self._job(fields)
        elif kind == "tick":
            self.cell_status.tick()
        elif kind == "results":
            self._results(self.cluster.last_results)
        elif kind == "trace":
            self._show_trace(self.cluster.last_trace)
        elif kind == "recording":
            self.record_toggle.value = fields["on"]
        elif kind == "label":
            if fields["label"] is None:  # a series ended: its line keeps its last run's label
                self.cell_status.series(False)
            self.progress.announce(fields["label"], fields.get("run"), fields.get("runs"))
            if fields["label"] is not None:
                self.cell_status.series(True)
        elif kind == "desync":
            self._desync(fields["diagnosis"])

    def _status(self, rank, fields) -> None:
        ranks = self.cluster.ranks
        if rank is None and any(r.status == "starting" for r in ranks):
            self._stopped_how = ""  # fresh ranks: the old run's errors stay until a rank's next job
            self.progress.update()
        elif rank is None and ranks and all(r.status == "stopped" for r in ranks) and not self._by_button:
            self._stopped_how = f"by cluster.shutdown() at {time.strftime('%H:%M:%S')}"
            self.cell_status.shut_down(len(ranks))
        elif rank is not None and 0 <= rank < len(ranks):
            if ranks[rank].status == "running":  # a new job: forget the last one's error
                self.ranks.errors.pop(rank, None)
                self.ranks.notes.pop(rank, None)
                self.progress.update()
            if isinstance(fields.get("traceback"), str):
                self.ranks.errors[rank] = fields["traceback"]
        self.refresh()

    def _desync(self, diagnosis) -> None:
        """The ranks' collectives parted: mark their rows (until their next job), draw their lanes
        under a line naming the run (until the next desync: a notebook's later runs, which work,
        must not wipe the diagnosis a learner scrolls back to)."""
        for rank in diagnosis.ranks:
            self.ranks.notes[rank] = f"desync at collective #{diagnosis.index}"
        self.desync_note.value = (
            f"<b style='color:#c62828'>The last desync</b>: the run of {self._run} at {time.strftime('%H:%M:%S')}, "
            "drawn here until the next one (later runs that worked do not replace it)")
        self.desync.value = desync_view(diagnosis)
        self.desync.layout.display = self.desync_note.layout.display = None
        self.refresh()

    def _job(self, fields) -> None:
        self.cell_status.job(fields["phase"])
        if fields["phase"] == "start":
            self._run = run_label(fields.get("name"), _cell_number())
            self._series = self.progress.announced is not None
            self.progress.measured(None)  # the last job's step time is not this one's
            self._recorded_run = fields["recorded"]
            if fields["recorded"]:
                self.live.start(self.cluster.world_size, self._run)
        else:
            self.progress.update()
            if not fields["recorded"]:
                self.live.unrecorded(self._run, self._series)

    def _results(self, results) -> None:
        """A job returned: its step time (and whether the network was faster than this machine can
        emulate), if it timed a strategy; its plots, if it recorded by hand."""
        self.progress.measured(results, self.cluster.network)
        if not self._recorded_run:
            trace = trace_of(results)  # a job that recorded by hand
            if trace is not None:
                self._show_trace(trace, self._run)

    def _show_trace(self, trace, label: str | None = None) -> None:
        if trace is not None:
            self.live.show_trace(trace, label if label is not None else self._run)
            self.save_button.disabled = False

    @property
    def plots_done(self):
        """Set when no drawing is pending (tests wait on it)."""
        return self.live.painter.idle

    # ------------------------------------------------------------------ drawing the state
    def refresh(self) -> None:
        """Redraw header, buttons and every rank's row from the cluster's current state."""
        c = self.cluster
        ranks = list(c.ranks)
        devices = ", ".join(d for d in c.devices if d) or "none"
        stopped = bool(ranks) and all(r.status == "stopped" for r in ranks)
        state = (f" &middot; <b style='color:{STATUS_COLOURS['stopped']}'>stopped {html.escape(self._stopped_how)}"
                 "</b> (start brings it back)" if stopped else "")
        self.header.value = (f"<b>ddpkit cluster</b> &middot; world size {c.world_size} &middot; "
                             f"backend {html.escape(c.carried_by)} &middot; devices "
                             f"{html.escape(devices)}{state}")
        # start only from stopped (start() refuses otherwise); restart is always offered: it is
        # the way out of a dead or wedged rank (a click waits while a cell runs, so it cannot
        # land in the middle of cluster.run)
        self.start_button.disabled = not stopped
        self.restart_button.disabled = False
        self.stop_button.disabled = stopped
        self.ranks.refresh()

    def _describe(self, when: str) -> str:
        """The compact status line (``CellStatus``): each rank's state, what runs, how far."""
        dots = " ".join(f"<span title='rank {r.rank}: {r.status}' style='color:"
                        f"{STATUS_COLOURS.get(r.status, 'black')}'>&#9679;</span>" for r in self.cluster.ranks)
        states = sorted({r.status for r in self.cluster.ranks})
        parts = [f"{dots} <b>ddpkit</b> {self.cluster.world_size} ranks {'/'.join(states)}"]
        if self.progress.layout.display != "none":
            parts.append(self.progress.label.value)
            if self.progress.note.value:  # the step time above is this machine's, not the network's
                parts.append(self.progress.note.value)
        # the recorded run going on (or just done): the newest step every rank's loss has reached,
        # as the loss plot shows it; an unrecorded run has none (not the last recorded run's)
        latest = self.live.state.latest_loss() if self._recorded_run else None
        if latest is not None:
            parts.append(f"loss {latest[1]:.4f} at step {latest[0]}")
        parts.append(html.escape(when))
        return f"<span style='font-size:12px'>{' &middot; '.join(parts)}</span>"
