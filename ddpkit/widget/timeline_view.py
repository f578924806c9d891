"""The timeline view: a few steps of every rank, compute above communication (SVG).

It draws ``ddpkit.trace.timeline``'s figure, as ``ddpkit.viz.plot_timeline`` does. Per rank, a
compute row -- forward, backward *computing*, backward *waiting* for communication (after its
last gradient was ready), sync, optimizer step -- and under it one row per bucket (each bucket's
collectives in its own row and colour, so eight async all-reduces in flight at once stay eight
bars), or, past eight buckets or for FSDP's units, the collectives packed into a few rows by
how many were in flight at once ("collectives", "2nd in flight", ...; the subtitle says so),
coloured by bucket or unit. Green behind the comm rows: communication hidden under backward's
computing. The title's percentage is ``ddpkit.trace.overlap_fraction`` over exactly the steps
and ranks drawn.
"""
from __future__ import annotations

from ddpkit.trace.figures import PACKED_NOTE, Timeline, timeline
from ddpkit.units import plural
from ddpkit.viz.style import OVERLAP_COLOUR, SPAN_COLOURS, WAIT_COLOUR
from ddpkit.widget.svg import Scale, Svg, collective_bars, message, x_axis
from ddpkit.widget.view import NO_STEPS, NO_STEPS_YET, Frame, View

WIDTH = 860
LEFT = 140
ROW = 16


def timeline_view(fig: Timeline) -> str:
    """HTML (an SVG) of ``ddpkit.trace.timeline(...)``."""
    if fig.t0 is None:
        return message("No spans recorded in these steps yet.")
    steps, t0, t1 = fig.steps, fig.t0, fig.t1
    top = 68 if fig.packed else 54  # under the title, its subtitle(s) and a band for the "step N" labels
    heights = [ROW * (1 + max(len(lane.comm_rows), 1)) + 10 for lane in fig.lanes]
    height = top + sum(heights) + 70
    svg = Svg(WIDTH, height, "ddpkit-timeline")
    x = Scale(0.0, max((t1 - t0) / 1e6, 1e-3), LEFT, WIDTH - 12)
    ms = lambda ns: x((ns - t0) / 1e6)  # noqa: E731
    which = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    svg.text(4, 14, f"Timeline · {which} · {plural(len(fig.lanes), 'rank')}: {fig.overlap:.0%} of communication time "
             "hidden under backward computing", size=13, weight="bold")
    units = any(r.bucket is None and r.unit is not None for lane in fig.lanes for _, rs in lane.comm_rows for r in rs)
    what = "unit" if units else "bucket"   # FSDP's collectives are its units', the DDP wrappers' their buckets'
    if fig.packed:  # FSDP's units, or more buckets than rows: rows by how many are in flight at once
        svg.text(4, 29, f"compute row above, the collectives below (colour = {what}); green: communication "
                 "while backward computes", size=11, fill="#555")
        svg.text(4, 43, f"collective rows: {PACKED_NOTE}", size=11, fill="#555")
    else:
        svg.text(4, 29, f"compute row above, one row per {what} below (colour = {what}); green: communication "
                 "while backward computes", size=11, fill="#555")

    y = top
    for lane, lane_height in zip(fig.lanes, heights, strict=True):
        comm_top = y + ROW
        rows = lane.comm_rows
        for a, b, _ in lane.hidden:  # hidden communication, behind the comm rows
            svg.rect(ms(a), comm_top, ms(b) - ms(a), ROW * max(len(rows), 1), OVERLAP_COLOUR, opacity=0.25,
                     title=f"hidden: {(b - a) / 1e6:.2f} ms")
        svg.text(LEFT - 6, y + ROW / 2 + 4, f"rank {lane.rank} compute", size=11, anchor="end")
        for r in lane.spans:
            svg.rect(ms(r.start_ns), y + 2, ms(r.end_ns) - ms(r.start_ns), ROW - 4,
                     SPAN_COLOURS.get(r.name, "#bbbbbb"), title=f"{r.name}: {r.dur_ns / 1e6:.2f} ms (step {r.step})")
        for a, b, s in lane.computing:
            svg.rect(ms(a), y + 2, ms(b) - ms(a), ROW - 4, SPAN_COLOURS["backward"],
                     title=f"backward computing: {(b - a) / 1e6:.2f} ms (step {s})")
        for a, b, _ in lane.waiting:
            svg.rect(ms(a), y + 2, ms(b) - ms(a), ROW - 4, WAIT_COLOUR, stroke=SPAN_COLOURS["backward"],
                     stroke_width=0.8, title=f"backward waiting for communication: {(b - a) / 1e6:.2f} ms")
        for i, (label, rs) in enumerate(rows):
            ry = comm_top + i * ROW
            svg.text(LEFT - 6, ry + ROW / 2 + 4, label, size=11, anchor="end", fill="#444")
            collective_bars(svg, rs, ry + 3, ROW - 6, ms, t1, when=lambda r: f"{r.dur_ns / 1e6:.2f} ms (step {r.step})")
        if not rows:
            svg.text(LEFT, comm_top + ROW / 2 + 4, "no collectives", size=11, fill="#555")
        y += lane_height
        svg.line(4, y - 5, WIDTH - 4, y - 5, stroke="#ddd")

    last_label = None
    for s, first in fig.step_starts.items():  # a dashed line where each step starts, labelled above the lanes
        svg.line(ms(first), top - 14, ms(first), y - 5, stroke="#000", width=0.8, dash="4,3", opacity=0.5)
        if last_label is None or ms(first) - last_label > 60:  # labels must not collide
            svg.text(ms(first) + 3, top - 5, f"step {s}", size=11, fill="#333")
            last_label = ms(first)
    x_axis(svg, x, y + 2, "ms")
    _legend(svg, y + 48)
    return svg.html()


def _legend(svg: Svg, y: float) -> None:
    items = [(SPAN_COLOURS["forward"], "forward"), (SPAN_COLOURS["backward"], "backward computing"),
             (WAIT_COLOUR, "backward waiting for comm"), (SPAN_COLOURS["sync"], "sync"),
             (SPAN_COLOURS["step"], "optimizer step"), (OVERLAP_COLOUR, "comm hidden under backward")]
    x = 8.0
    for colour, label in items:
        svg.rect(x, y - 9, 12, 10, colour, opacity=0.6 if colour == OVERLAP_COLOUR else None)
        svg.text(x + 16, y, label, size=11)
        x += 24 + 6.6 * len(label)  # about 6.6 px a character at 11 px


def _figure(frame: Frame, empty: str) -> str:
    return timeline_view(timeline(frame.records, frame.steps, frame.ranks)) if frame.steps else message(empty)


# Every run has a timeline: a run whose bucket fill has nothing to show (FSDP) opens here.
TIMELINE = View("timeline", "timeline", _figure, pending=NO_STEPS_YET, missing=NO_STEPS,
                opens=lambda records: True)
