"""The cluster widget: what a displayed ``ddpkit.Cluster`` shows in a notebook.

    cluster = ddpkit.Cluster(world_size=2)
    cluster            # -> ClusterWidget(cluster): ranks, their logs, progress, plots of the last run

Layout, top to bottom: a header (world size, backend, devices), start / restart / stop buttons,
one row per rank (status, pid, device, and the tail of what the rank printed), a progress bar
(steps done of total, from ``ddpkit.progress`` inside the ranks) and, after a run whose results
are traces, tabs with that run's bucket fill order, timeline and memory plots.

Threads. The cluster calls our observer from its pipe-reader threads (log lines) and from the
kernel's main thread while ``cluster.run`` waits (status, progress, results). The observer only
sets widget traits, which ipywidgets sends to the page as comm messages from whichever thread
sets them, so nothing here waits for the kernel to become idle. Two things would be too slow for
an observer and get their own thread: re-sending a rank's log on every printed line (coalesced
into one update per ``LOG_INTERVAL_S``), and drawing plots (rendered to PNG in the background).

This module is imported only when a cluster is displayed (a rank never pays for ipywidgets);
matplotlib and ``ddpkit.viz`` are imported only when there is something to plot.
"""
from __future__ import annotations

import html
import io
import logging
import sys
import threading
import time
import weakref

import ipywidgets as widgets

log = logging.getLogger("ddpkit.widget")

LOG_INTERVAL_S = 0.1  # at most ~10 log updates per second per widget: a chatty rank cannot flood the page

# One colour per RankState.status, so a glance finds the rank that failed.
STATUS_COLOURS = {
    "starting": "#b8860b", "idle": "#2e7d32", "running": "#1565c0",
    "error": "#c62828", "dead": "#6a1b9a", "stopped": "#616161",
}

# Keeps the log box scrolled to its newest line without any JavaScript: a flex column in
# reverse order starts at the bottom (the inner div keeps the lines in reading order).
_LOG_STYLE = ("display:flex;flex-direction:column-reverse;max-height:12em;overflow:auto;"
              "margin:0;padding:2px 6px;background:#f7f7f7;border:1px solid #ddd;"
              "font-family:monospace;font-size:11px;line-height:1.3;white-space:pre-wrap")


def _snapshot(lines) -> list[str]:
    """A copy of a deque another thread may append to (retried if it changed under us)."""
    for _ in range(10):
        try:
            return list(lines)
        except RuntimeError:  # "deque mutated during iteration"
            continue
    return []


def trace_of(results):
    """The run's merged ``ddpkit.trace.Trace`` if ``results`` are traces, else None.

    A run is traced when every rank returned a ``Trace`` (``recorder.trace()``), a ``Recorder``,
    or a list of ``Record``; the ranks' records are merged into one Trace for the plots.
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
    """An ipywidgets view of a Cluster: status and log per rank, buttons, progress, plots."""

    def __init__(self, cluster, log_lines: int = 200):
        self.cluster = cluster
        self.log_lines = log_lines
        self.header = widgets.HTML()
        self.start_button = widgets.Button(description="start", icon="play", tooltip="start the ranks")
        self.restart_button = widgets.Button(description="restart", icon="refresh",
                                             tooltip="stop every rank and start fresh ones")
        self.stop_button = widgets.Button(description="stop", icon="stop", tooltip="stop every rank")
        for button, action in ((self.start_button, "start"), (self.restart_button, "restart"),
                               (self.stop_button, "shutdown")):
            button.on_click(lambda _b, action=action: self._act(action))
            button.layout.width = "auto"
        self.message = widgets.HTML()  # why the last button press failed, if it did
        self.rank_status: list[widgets.HTML] = []
        self.rank_logs: list[widgets.HTML] = []
        self.rank_box = widgets.VBox()
        self.progress = widgets.IntProgress(value=0, min=0, max=1, description="steps",
                                            layout=widgets.Layout(width="50%"))
        self.progress_label = widgets.Label()
        self.progress_box = widgets.HBox([self.progress, self.progress_label],
                                         layout=widgets.Layout(display="none"))
        self.plots = widgets.Tab(layout=widgets.Layout(display="none"))
        self.plots_done = threading.Event()  # set when no plots are being drawn
        self.plots_done.set()
        self._errors: dict[int, str] = {}  # rank -> traceback, when the cluster sends one
        self._log_lock = threading.Lock()
        self._log_dirty: set[int] = set()
        self._log_timer: threading.Timer | None = None
        self._last_log_flush = 0.0
        self._plot_generation = 0
        self._closed = False
        super().__init__([
            self.header,
            widgets.HBox([self.start_button, self.restart_button, self.stop_button, self.message]),
            self.rank_box, self.progress_box, self.plots,
        ])
        self.add_class("ddpkit-cluster")
        self.refresh()
        cluster.subscribe(self._on_event)

    # ------------------------------------------------------------------ buttons
    def _act(self, action: str) -> None:
        """Call ``cluster.<action>()`` for a button; a failure is shown here (a click has no cell to raise in)."""
        for b in (self.start_button, self.restart_button, self.stop_button):
            b.disabled = True
        self.message.value = ""
        self._errors.clear()  # the user asked for a fresh start (or a stop): old errors are done
        try:
            getattr(self.cluster, action)()
        except Exception as exc:
            log.debug("cluster widget: %s failed", action, exc_info=True)
            self.message.value = (f"<span style='color:{STATUS_COLOURS['error']}'>"
                                  f"{html.escape(type(exc).__name__)}: {html.escape(str(exc))}</span>")
        finally:
            self.refresh()

    # ------------------------------------------------------------------ events from the cluster
    def close(self) -> None:
        """Close the widget and stop following the cluster."""
        self._closed = True
        self.cluster.unsubscribe(self._on_event)
        super().close()

    def _on_event(self, kind: str, rank, **fields) -> None:
        """The cluster's observer: cheap, sets traits only (called from the cluster's threads)."""
        if self._closed:
            return
        if kind == "status":
            if rank is None and any(r.status == "starting" for r in self.cluster.ranks):
                # fresh ranks (no progress yet). The old run's errors stay until a rank's next
                # job (the cluster restarts by itself after a fault, and the reason it did
                # should stay readable); the buttons clear them (see _act).
                self._show_progress()
            elif rank is not None and self._rank_state(rank) is not None:
                if self._rank_state(rank).status == "running":  # a new job: forget the last one's
                    self._errors.pop(rank, None)
                    self._show_progress()
                tb = fields.get("traceback")
                if isinstance(tb, str):
                    self._errors[rank] = tb
            self.refresh()
        elif kind == "log":
            self._log_changed(rank)
        elif kind == "progress":
            self._show_progress()
        elif kind == "results":
            self.show_results(self.cluster.last_results)

    def _rank_state(self, rank: int):
        ranks = self.cluster.ranks
        return ranks[rank] if 0 <= rank < len(ranks) else None

    # ------------------------------------------------------------------ drawing the state
    def refresh(self) -> None:
        """Redraw header, buttons, every rank's row and log from the cluster's current state."""
        c = self.cluster
        ranks = list(c.ranks)
        if len(self.rank_status) != len(ranks):
            self.rank_status = [widgets.HTML() for _ in ranks]
            self.rank_logs = [widgets.HTML() for _ in ranks]
            for s in self.rank_status:
                s.add_class("ddpkit-rank-status")
            for lg in self.rank_logs:
                lg.add_class("ddpkit-rank-log")
            self.rank_box.children = [w for pair in zip(self.rank_status, self.rank_logs, strict=True) for w in pair]
        devices = ", ".join(d for d in c.devices if d) or "none (stopped)"
        self.header.value = (f"<b>ddpkit cluster</b> &middot; world size {c.world_size} &middot; "
                             f"backend {html.escape(c.backend)} &middot; devices {html.escape(devices)}")
        # start only from stopped (start() refuses otherwise); restart is always offered: it is
        # the way out of a dead or wedged rank (a click waits while a cell runs, so it cannot
        # land in the middle of cluster.run)
        stopped = all(r.status == "stopped" for r in ranks)
        self.start_button.disabled = not stopped
        self.restart_button.disabled = False
        self.stop_button.disabled = stopped
        for r in ranks:
            colour = STATUS_COLOURS.get(r.status, "black")
            where = f" &middot; pid {r.pid}" if r.pid and r.status != "stopped" else ""
            where += f" &middot; {html.escape(r.device)}" if r.device else ""
            self.rank_status[r.rank].value = (
                f"<b>rank {r.rank}</b> <span class='ddpkit-status' style='color:{colour};"
                f"font-weight:bold'>{r.status}</span>{where}")
        self.flush_logs(all_ranks=True)

    def _log_changed(self, rank: int) -> None:
        """Mark a rank's log as changed; send it now or within LOG_INTERVAL_S, coalescing lines."""
        with self._log_lock:
            self._log_dirty.add(rank)
            if self._log_timer is not None:
                return  # an update is already on its way and will include this line
            wait = self._last_log_flush + LOG_INTERVAL_S - time.monotonic()
            if wait > 0:
                self._log_timer = threading.Timer(wait, self.flush_logs)
                self._log_timer.daemon = True
                self._log_timer.start()
                return
        self.flush_logs()

    def flush_logs(self, all_ranks: bool = False) -> None:
        """Send the tail (``log_lines``) of each changed rank's log to its log box."""
        with self._log_lock:
            dirty = set(range(len(self.rank_logs))) if all_ranks else self._log_dirty
            self._log_dirty = set()
            if self._log_timer is not None:
                self._log_timer.cancel()
                self._log_timer = None
            self._last_log_flush = time.monotonic()
        for rank in sorted(dirty):
            state = self._rank_state(rank)
            if state is None or rank >= len(self.rank_logs):
                continue
            lines = _snapshot(state.log)[-self.log_lines:]
            text = html.escape("\n".join(lines))
            error = self._errors.get(rank)  # .get: the main thread may clear it meanwhile
            if error:
                tb = html.escape(error.rstrip())
                text += f"\n<span style='color:{STATUS_COLOURS['error']}'>{tb}</span>"
            self.rank_logs[rank].value = f"<div style='{_LOG_STYLE}'><div>{text}</div></div>" if text else ""

    def _show_progress(self) -> None:
        """One bar for the run: the slowest rank's steps done, of the total it reported."""
        steps = {r.rank: r.progress for r in self.cluster.ranks if r.progress is not None}
        if not steps:
            self.progress_box.layout.display = "none"
            return
        done = min(d for d, _ in steps.values())
        total = max(max(t for _, t in steps.values()), 1)
        self.progress.max = total
        self.progress.value = min(done, total)
        self.progress_label.value = f"{done} / {total} steps"
        self.progress_box.layout.display = "flex"

    # ------------------------------------------------------------------ plots of the last run
    def show_results(self, results) -> None:
        """If ``results`` are traces, draw their plots into tabs (in a background thread)."""
        trace = trace_of(results)
        if trace is None:
            return  # not a traced run: the last traced run's plots stay
        self._plot_generation += 1
        self.plots_done.clear()
        threading.Thread(target=self._draw_plots, args=(trace, self._plot_generation),
                         daemon=True, name="ddpkit-widget-plots").start()

    def _draw_plots(self, trace, generation: int) -> None:
        try:
            from ddpkit import viz

            tabs = []
            for title, draw in (("bucket fill", viz.plot_bucket_fill),
                                ("timeline", viz.plot_timeline),
                                ("memory", viz.plot_memory)):
                try:
                    image = widgets.Image(value=_png(draw(trace)), format="png")
                    image.add_class("ddpkit-plot")
                    image.layout.max_width = "100%"  # shrinks with a narrow notebook
                    tabs.append((title, image))
                except Exception as exc:  # e.g. a run with no memory samples has no memory plot
                    tabs.append((title, widgets.HTML(f"<i>no {title} plot: {html.escape(str(exc))}</i>")))
            if generation != self._plot_generation:
                return  # a newer run's plots are on their way
            self.plots.children = [w for _, w in tabs]
            self.plots.titles = tuple(t for t, _ in tabs)
            self.plots.selected_index = 0
            self.plots.layout.display = "flex"
        except Exception as exc:  # shown where the plots would be: a thread has no cell to print in
            log.debug("cluster widget: drawing the run's plots failed", exc_info=True)
            if generation == self._plot_generation:
                self.plots.children = [widgets.HTML(
                    f"<i>could not draw this run's plots: {html.escape(type(exc).__name__)}: "
                    f"{html.escape(str(exc))}</i>")]
                self.plots.titles = ("plots",)
                self.plots.layout.display = "flex"
        finally:
            if generation == self._plot_generation:
                self.plots_done.set()


_SHOWN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cluster -> its open widget


def show(cluster) -> ClusterWidget:
    """Display ``cluster``'s widget in the notebook: one per cluster while it is open, a new one
    once it was closed. A Cluster shown as a cell's value comes here (``ddpkit`` registers this
    with IPython: the cluster itself knows nothing of widgets)."""
    from IPython.display import display

    widget = _SHOWN.get(cluster)
    if widget is None or widget._closed:
        widget = _SHOWN[cluster] = ClusterWidget(cluster)
    display(widget)
    return widget


def _png(fig) -> bytes:
    """A matplotlib Figure as PNG bytes; forgotten by pyplot if it was made there (not shown twice)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt = sys.modules.get("matplotlib.pyplot")  # never import pyplot just for this
    if plt is not None:
        plt.close(fig)  # a no-op for a Figure pyplot does not manage
    return buf.getvalue()
