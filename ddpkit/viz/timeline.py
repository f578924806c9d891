"""Per-rank timeline: a compute row above a row per bucket, the hidden communication shaded.

The trace's timeline figure, as the widget draws it: backward split where its computing ended;
a row and colour per bucket (past eight, rows shared by how many were in flight); the title's
percentage ``overlap_fraction`` over exactly the steps and ranks drawn.
"""
from __future__ import annotations

import textwrap

from ddpkit.trace import as_trace, timeline
from ddpkit.trace.figures import PACKED_NOTE
from ddpkit.units import plural
from ddpkit.viz._common import new_figure, no_data
from ddpkit.viz.style import OVERLAP_COLOUR, SPAN_COLOURS, WAIT_COLOUR, bucket_colour, comm_colour


def plot_timeline(trace, steps=None, ranks=None):
    """Per rank: forward, backward computing / waiting, sync and step above one row per bucket
    (each collective from launch to completion); green: communication hidden under backward.
    ``steps``: None (every training step), an int (-1: the last) or a list; ``ranks``: None (all)."""
    trace = as_trace(trace)
    fig_data = timeline(trace, steps if trace.steps else [], ranks)
    lanes = fig_data.lanes
    heights = [1 + max(len(lane.comm_rows), 1) for lane in lanes]
    fig = new_figure(max(2.4, 1.2 + 0.32 * sum(heights)))
    ax = fig.subplots()
    if fig_data.t0 is None:
        no_data(ax, "no spans recorded in these steps (call recorder.next_step() before each step)")
        return fig
    t0, chosen = fig_data.t0, fig_data.steps
    ms = lambda ns: (ns - t0) / 1e6  # noqa: E731

    def bar(y, a, b, colour, **kw):
        ax.broken_barh([(ms(a), max((b - a) / 1e6, 1e-4))], (y - 0.38, 0.76), facecolors=colour, **kw)

    yticks, ylabels, y = [], [], 0.0
    for lane, height in zip(lanes, heights, strict=True):  # top to bottom: rank 0 first
        rows = lane.comm_rows
        comp_y = -y
        for a, b, _ in lane.computing:
            bar(comp_y, a, b, SPAN_COLOURS["backward"], edgecolors="black", linewidth=0.3)
        for a, b, _ in lane.waiting:
            bar(comp_y, a, b, WAIT_COLOUR, edgecolors=SPAN_COLOURS["backward"], linewidth=0.8)
        for a, b, _ in lane.hidden:  # hidden communication, behind the comm rows
            ax.broken_barh([(ms(a), (b - a) / 1e6)], (comp_y - 0.5 - len(rows), len(rows)),
                           color=OVERLAP_COLOUR, alpha=0.25, lw=0, zorder=0)
        for r in lane.spans:
            bar(comp_y, r.start_ns, r.end_ns, SPAN_COLOURS.get(r.name, "#bbbbbb"), edgecolors="black", linewidth=0.3)
        yticks.append(comp_y)
        ylabels.append(f"rank {lane.rank} compute")
        for i, (label, rs) in enumerate(rows):
            for r in rs:
                end = r.end_ns if r.end_ns is not None else r.start_ns
                bar(comp_y - 1 - i, r.start_ns, end, comm_colour(r), edgecolors="black", linewidth=0.3)
            yticks.append(comp_y - 1 - i)
            ylabels.append(label)
        y += height + 0.6

    last_label, span = None, ms(fig_data.t1) or 1.0
    for s, start in fig_data.step_starts.items():  # a dashed line where each step starts (any rank)
        ax.axvline(ms(start), color="black", ls="--", lw=0.8, alpha=0.6, zorder=0)
        if last_label is None or ms(start) - last_label > 0.06 * span:  # labels must not collide
            # above the axes, between them and the title: inside, it overprinted rank 0's first bar
            ax.annotate(f"step {s}", (ms(start), 1.0), xycoords=("data", "axes fraction"),
                        xytext=(2, 2), textcoords="offset points", fontsize=8, va="bottom", annotation_clip=False)
            last_label = ms(start)

    from matplotlib.patches import Patch

    units = any(r.bucket is None and r.unit is not None for lane in fig_data.lanes for _, rs in lane.comm_rows
                for r in rs)
    what = "unit" if units else "bucket"   # FSDP's collectives are its units', the DDP wrappers' their buckets'
    legend = [(SPAN_COLOURS["forward"], "forward"), (SPAN_COLOURS["backward"], "backward computing"),
              (WAIT_COLOUR, "backward waiting for comm"), (SPAN_COLOURS["sync"], "sync"),
              (SPAN_COLOURS["step"], "optimizer step"), (bucket_colour(0), f"collective (colour = {what})")]
    handles = [Patch(facecolor=c, edgecolor="black", lw=0.3) for c, _ in legend]
    handles.append(Patch(color=OVERLAP_COLOUR, alpha=0.25))
    labels = [t for _, t in legend] + ["comm hidden under backward"]
    if fig_data.packed:  # rows "collectives", "2nd in flight", ...: say what they are
        handles.append(Patch(color="none"))
        labels.append("collective rows: " + textwrap.fill(PACKED_NOTE, 34))
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_yticks(yticks, ylabels, fontsize=8)
    ax.set_ylim(-y + 0.3, 0.8)
    clock = next((r.clock for lane in lanes for r in lane.spans), "host")
    ax.set_xlabel("time (ms)" + ("" if clock == "host" else ", GPU time from CUDA events"))
    which = f"step {chosen[0]}" if len(chosen) == 1 else f"steps {chosen[0]}-{chosen[-1]}"
    ax.set_title(f"Timeline, {plural(len(lanes), 'rank')}, {which}: "
                 f"{fig_data.overlap:.0%} of communication time hidden under backward computing", pad=14)
    ax.grid(axis="x", alpha=0.3)
    return fig
