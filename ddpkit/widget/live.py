"""The plots of a recorded run: drawn while it streams in, replayed step by step after it.

While the run goes (``start``, then ``add`` for each batch of records a rank streams): the
current step's bucket fill, a rolling timeline of the last ``ROLLING_STEPS`` steps of every
rank, each rank's memory over time and the loss per step, redrawn at most every ``FRAME_S``
seconds from a bounded ``LiveState`` -- frames coalesce, the records never do (the cluster keeps
them all in ``last_trace``). After it (``show_trace``): a step slider replays any recorded step;
the memory view shows the whole run, its peak and what was live at it.

What stays drawn is what a learner scrolling back after Run All should find: the last recorded
run that *trained* (a step with forward or backward in it), named by its job and cell. A later
recorded run with nothing of the kind to draw (a job that only communicated, or ``no_sync``
micro-batches counted as steps with no compute recorded) does not replace it; the summary says
that it happened. Before any run was recorded, one line says why there is nothing to draw.

The views are a list, ``VIEWS`` (each a ``view.View`` in its own file): a pane each, redrawn
from one ``view.Frame`` -- the live window, or the replayed step. Every view draws a figure
computed by ``ddpkit.trace.figures`` -- ``bucket_fill``, ``timeline``, ``memory_series`` and its
peak, ``loss_per_step`` -- the functions the matplotlib plots (``ddpkit.viz``) draw from too, so
the widget and the plots cannot disagree. The panes are HTML widgets holding SVG (``svg.py``):
cheap to draw while ranks share the CPU, and readable by a test as text.
"""
from __future__ import annotations

import bisect
import html
from collections import defaultdict

import ipywidgets as widgets

from ddpkit.trace.figures import loss_per_step, memory_series, peak_of
from ddpkit.trace.records import Trace
from ddpkit.units import plural
from ddpkit.widget.fill_view import FILL
from ddpkit.widget.loss_view import LOSS
from ddpkit.widget.memory_view import MEMORY
from ddpkit.widget.state import LiveState
from ddpkit.widget.throttle import Throttle
from ddpkit.widget.timeline_view import TIMELINE
from ddpkit.widget.view import Frame

# The views, tabs in this order (the first one whose ``opens`` says so is opened for a run), then
# those drawn beside the tabs (``title`` None). A new figure: its file, and an entry here.
VIEWS = (FILL, TIMELINE, MEMORY, LOSS)

FRAME_S = 0.5       # at most two redraws a second
PLOT_WIDTH = 880    # px the tabs ask for: the views' SVG width (860) and the tab's padding
ROLLING_STEPS = 3   # the live timeline's window


def trained(trace) -> bool:
    """Did the run train: is there a step with a compute span (forward, backward, ...) to draw?"""
    return any(r.cat == "compute" and r.step is not None for r in trace.records)


class LivePlots(widgets.VBox):
    """A pane per view (in tabs, or beside them), a summary line, and replay controls."""

    def __init__(self):
        self.summary = widgets.HTML()
        self.summary.add_class("ddpkit-live-summary")
        self.panes = {view.name: widgets.HTML() for view in VIEWS}  # a view's name -> what shows it
        for name, pane in self.panes.items():
            pane.add_class("ddpkit-plot")
            pane.add_class(f"ddpkit-{name}-view")
        self._tabbed = [view for view in VIEWS if view.title is not None]
        # The tabs ask for their plots' full width (860 px): drawn at their own size, an 11 px
        # label stays 11 px; where the row has no room beside them, the views beside wrap below.
        self.tabs = widgets.Tab([self.panes[view.name] for view in self._tabbed],
                                layout=widgets.Layout(flex=f"1 1 {PLOT_WIDTH}px", min_width="0"))
        self.tabs.titles = tuple(view.title for view in self._tabbed)
        self.step = widgets.IntSlider(description="replay step", min=0, max=0, continuous_update=True,
                                      layout=widgets.Layout(width="60%"), style={"description_width": "initial"})
        self.step.add_class("ddpkit-step-slider")
        self.rank = widgets.Dropdown(description="bucket fill of rank", options=[0], value=0,
                                     style={"description_width": "initial"}, layout=widgets.Layout(width="220px"))
        self.controls = widgets.HBox([self.step, self.rank])
        beside = [self.panes[view.name] for view in VIEWS if view.title is None]
        self.plots = widgets.HBox([self.tabs, *beside], layout=widgets.Layout(flex_flow="row wrap"))
        super().__init__([self.summary, self.plots, self.controls], layout=widgets.Layout(display="none"))
        self.add_class("ddpkit-live")
        self.state = LiveState()
        self.mode = "empty"   # "live" while a run streams in, "replay" once its trace is here
        self.trace = None
        self.label = ""       # HTML naming the run shown (its job and cell, ``panel.run_label``)
        self._starting = ""   # ... and the one streaming in now
        self.last_trained = None          # (trace, label): the last run shown that trained
        self.later_without_steps = None   # (records, label) of a later recorded run with no step to draw
        self._replay: dict = {}
        self._tab_chosen = False          # the tab for the run shown is chosen (``_open_tab``)
        self._auto_tab: int | None = None  # the tab the widget opened itself, last time it did
        self.painter = Throttle(self._paint, FRAME_S, inline=False, name="ddpkit-widget-plots")
        self.step.observe(lambda _: self.painter.request(), names="value")
        self.rank.observe(lambda _: self.painter.request(), names="value")

    # ------------------------------------------------------------------ fed by the widget
    def start(self, world_size: int, label: str = "") -> None:
        """A recorded run begins (``label``: HTML naming it): draw as records arrive."""
        self.state, self.mode, self.trace, self._replay = LiveState(world_size), "live", None, {}
        self._tab_chosen = False
        self._starting = label
        self._set_ranks(world_size)
        self.controls.children = [self.rank]
        self.summary.value = ("<b style='color:#c62828'>&#9679; recording</b>" + (f" {label}" if label else "")
                              + ": waiting for the first records")
        self.plots.layout.display = None
        self.layout.display = "flex"

    def unrecorded(self, label: str, series: bool = False) -> None:
        """A run without recording ended (``label`` names it). While nothing recorded was ever
        drawn, one line says why the widget has no plots; a drawn run stays as it is."""
        if self.mode != "empty":
            return
        inside = (" It was part of <code>compare()</code> or a sweep: those record the runs they measure inside "
                  "the ranks, for the figures they print, and keep those records there, so there is no trace "
                  "here to draw." if series else "")
        self.summary.value = (
            f"<b>No recorded run to draw</b>: the last run, {label}, ran with the cluster's recording off, as "
            f"every run of this cluster so far.{inside} A run inside <code>with cluster.recording():</code> (or "
            "with <b>record</b> switched on above) is drawn here: its bucket fill, every rank's timeline, memory "
            "and the loss.")
        self.plots.layout.display = "none"
        self.controls.children = []
        self.layout.display = "flex"

    def add(self, rank: int, records) -> None:
        if self.mode == "live":
            self.state.add(rank, records)
            self.painter.request()

    def show_trace(self, trace, label: str = "") -> None:
        """A run's whole trace (``label``: HTML naming its job and cell): replay it (the slider
        picks the step). Indexing a long trace takes a moment, so it happens on the drawing
        thread, not on the one that called ``run``.

        A trace that did not train (no forward or backward recorded in a step: a job that only
        set up or communicated, ``no_sync`` micro-batches) does not replace the last one that
        did: that view stays, and its summary names the later run that had nothing to draw."""
        self.plots.layout.display = None
        self.layout.display = "flex"
        if not trained(trace) and self.last_trained is not None:
            (self.trace, self.label), self.mode, self._replay = self.last_trained, "replay", {}
            self.later_without_steps = (len(trace.records), label)
            self._set_ranks(max(self.trace.world_size, len(self.trace.ranks)))
            self.painter.request()
            return
        if trained(trace):
            self.last_trained = (trace, label)
        self.later_without_steps = None
        self.trace, self.label, self.mode, self._replay = trace, label, "replay", {}
        self._tab_chosen = False
        self._set_ranks(max(trace.world_size, len(trace.ranks)))
        self.painter.request()

    def _index(self, trace) -> dict:
        """What the replay draws from: records by step, the loss, each rank's memory and its peak;
        it names the trace it was made from (a newer run may arrive while it is made)."""
        by_step = defaultdict(list)
        for r in trace.records:
            by_step[r.step].append(r)
        memory = {rank: memory_series(trace.records, rank) for rank in trace.ranks}
        steps = trace.steps
        replay = dict(trace=trace, by_step=by_step, steps=steps, losses=loss_per_step(trace.records), memory=memory,
                      peak=peak_of(memory), t0=min((r.start_ns for r in trace.records), default=0))
        self._replay = replay
        if steps:
            with self.step.hold_trait_notifications():
                self.step.min, self.step.max = steps[0], steps[-1]
                self.step.value = steps[-1]
            self.controls.children = [self.step, self.rank]
        else:
            self.controls.children = []
        return replay

    def _set_ranks(self, n: int) -> None:
        options = list(range(max(n, 1)))
        if list(self.rank.options) != options:
            self.rank.options = options
            self.rank.value = 0

    def _open_tab(self, records) -> None:
        """Open the tab that has something to show for this run, once: the first whose view
        ``opens`` for its records (the bucket fill where gradients report when they were ready,
        the DDP wrappers; else the timeline, FSDP). A tab the learner picked (one the widget did
        not open itself) stays."""
        if self._tab_chosen:
            return
        self._tab_chosen = True
        wanted = next((i for i, view in enumerate(self._tabbed) if view.opens(records)), 0)
        current = self.tabs.selected_index
        if current != wanted and current in (0, self._auto_tab):
            self.tabs.selected_index = wanted
            self._auto_tab = wanted

    # ------------------------------------------------------------------ drawing (painter thread)
    def _paint(self) -> None:
        drawn = self._live_frame() if self.mode == "live" else self._replay_frame() if self.mode == "replay" else None
        if drawn is None:
            return
        summary, frame = drawn
        values = [(self.summary, summary)] + [(self.panes[view.name], view.draw(frame)) for view in VIEWS]
        for w, value in values:
            if w.value != value:  # an unchanged view costs the page nothing
                w.value = value

    def _live_frame(self) -> tuple[str, Frame] | None:
        """The summary line and the frame of the run streaming in (None before its first record)."""
        snap = self.state.snapshot()
        if not snap["count"]:
            return None
        rank = self.rank.value
        window = Trace(snap["records"], self.state.world_size)
        steps, latest = window.steps, snap["latest"]
        # Draw finished steps: a rank's newest step may still be half streamed (its records
        # leave once its collectives completed), and a half-drawn step would flicker.
        finished = [s for s in steps if all(s < newest for newest in latest.values())] or steps
        if any(all(s < newest for newest in latest.values()) for s in steps):  # a whole step to judge by
            self._open_tab([r for r in snap["records"] if r.step in finished])
        # the step drawn in full: the newest one this rank finished (or, before that, the one it is in)
        mine = [s for s in steps if s < latest.get(rank, -1)] or [s for s in steps if latest.get(rank) == s]
        losses = snap["loss"]
        frame = Frame(live=True, records=window, rank=rank, step=mine[-1] if mine else None,
                      steps=finished[-ROLLING_STEPS:], ranks=window.ranks, memory=snap["memory"],
                      t0=snap["t0"] or 0, peak=peak_of(snap["memory"]), losses=losses, marker=None)
        newest = max(snap["latest"].values(), default=None)
        where = f"step {newest}" if newest is not None else "setting up (no training step yet)"
        # the newest step every rank's loss has reached: the value the loss plot ends on
        loss_text = f" &middot; loss {losses[max(losses)]:.4f} at step {max(losses)}" if losses else ""
        who = f" {self._starting}" if self._starting else ""
        summary = (f"<b style='color:#c62828'>&#9679; recording</b>{who}: {where} &middot; "
                   f"{snap['count']:,} records so far{loss_text} &middot; plots redraw every {FRAME_S:g} s")
        return summary, frame

    def _replay_frame(self) -> tuple[str, Frame] | None:
        """The summary line and the frame of the step the slider picks (None: no run to replay)."""
        # Read once: the thread that waits in cluster.run may hand over the next run's trace (and
        # empty the index) while this one draws; an index is only used with the trace it came from.
        trace, rp = self.trace, self._replay
        if trace is None:
            return None
        if rp.get("trace") is not trace:
            rp = self._index(trace)  # setting the slider here requests one more paint: harmless
        steps, step = rp["steps"], None
        if steps:
            step = steps[max(bisect.bisect_right(steps, self.step.value) - 1, 0)]  # a recorded step
            self._open_tab(trace.records)
        records = Trace(rp["by_step"][step] if steps else [], trace.world_size)  # the figures read this step only
        frame = Frame(live=False, records=records, rank=self.rank.value, step=step, steps=[step] if steps else [],
                      ranks=records.ranks or trace.ranks, memory=rp["memory"], t0=rp["t0"], peak=rp["peak"],
                      losses=rp["losses"], marker=step)
        return self._replay_summary(trace, rp, step), frame

    def _replay_summary(self, trace, rp: dict, step) -> str:
        span = (max((r.end_ns or r.start_ns) for r in trace.records) - rp["t0"]) / 1e9 if trace.records else 0
        where = f"showing step {step}; slide to replay another" if step is not None else "no steps to replay"
        later = ""
        if self.later_without_steps is not None:
            records, label = self.later_without_steps
            later = (f" &middot; <i>a later recorded run{f', {label},' if label else ''} made {records:,} records "
                     "but no training step to draw (no forward or backward recorded; cluster.last_trace holds "
                     "it): this is the last run that trained</i>")
        of = f" of {self.label}" if self.label else ""
        over = f"{span:.1f} s" if span >= 1 else f"{span * 1e3:.0f} ms"
        return (f"<b>recorded run</b>{of}: {plural(len(rp['steps']), 'step')} on "
                f"{plural(len(trace.ranks), 'rank')}, {len(trace.records):,} records over {over} &middot; "
                f"{html.escape(where)}{later}")

    def close(self) -> None:
        self.painter.close()
        super().close()

