"""The timeline view: a few steps of every rank, compute above communication (SVG).

Per rank, a compute row -- forward, backward *computing*, backward *waiting* for communication
(after its last gradient was ready), sync, optimizer step -- and under it one row per bucket
(each bucket's collectives in its own row and colour, so eight async all-reduces in flight at
once stay eight bars), or, past eight buckets or for FSDP's units, the collectives packed into
a few rows, coloured by bucket or unit (``ddpkit.viz.timeline.comm_rows``: the same rows as the
matplotlib timeline). Green behind the comm rows:
communication hidden under backward's computing. The title's percentage is
``ddpkit.trace.overlap_fraction`` over exactly the steps and ranks drawn.
"""
from __future__ import annotations

from ddpkit.trace.figures import backward_phases, overlap_fraction, overlap_intervals
from ddpkit.trace.records import Trace
from ddpkit.viz._common import OVERLAP_COLOUR, SPAN_COLOURS, WAIT_COLOUR
from ddpkit.viz.timeline import comm_rows
from ddpkit.widget.svg import Scale, Svg, collective_bars, message, x_axis

WIDTH = 860
LEFT = 120
ROW = 16


def timeline_view(records, steps: list[int], ranks: list[int], world_size: int = 1) -> str:
    """HTML (an SVG) of ``steps`` on ``ranks``; ``records`` may hold more."""
    wanted_steps, wanted_ranks = set(steps), set(ranks)
    picked = [r for r in records if r.step in wanted_steps and r.rank in wanted_ranks]  # grad_ready too:
    chosen = [r for r in picked if r.kind == "span"]  # it says where backward's computing ended
    if not chosen:
        return message("No spans recorded in these steps yet.")
    t0 = min(r.start_ns for r in chosen)
    t1 = max((r.end_ns or r.start_ns) for r in chosen)
    layout = {rank: comm_rows([r for r in chosen if r.rank == rank and r.cat == "comm"]) for rank in ranks}
    top = 40
    heights = {rank: ROW * (1 + max(len(layout[rank]), 1)) + 10 for rank in ranks}
    height = top + sum(heights.values()) + 70
    svg = Svg(WIDTH, height, "ddpkit-timeline")
    x = Scale(0.0, max((t1 - t0) / 1e6, 1e-3), LEFT, WIDTH - 12)
    ms = lambda ns: x((ns - t0) / 1e6)  # noqa: E731
    trace = Trace(picked, world_size)
    frac = overlap_fraction(trace, steps=[s for s in steps if s in trace.steps], ranks=ranks)
    which = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    svg.text(4, 14, f"Timeline · {which} · {len(ranks)} rank(s): {frac:.0%} of communication time hidden "
             "under backward computing", size=12, weight="bold")
    svg.text(4, 29, "compute row above, one row per bucket below (colour = bucket); green: communication "
             "while backward computes", size=10, fill="#555")

    y = top
    for rank in ranks:
        mine = [r for r in picked if r.rank == rank]
        comm_top = y + ROW
        rows = layout[rank]
        for s in steps:  # hidden communication, behind the comm rows
            _, _, both = overlap_intervals(mine, rank, s)
            for a, b in both:
                svg.rect(ms(a), comm_top, ms(b) - ms(a), ROW * max(len(rows), 1), OVERLAP_COLOUR, opacity=0.25,
                         title=f"hidden: {(b - a) / 1e6:.2f} ms")
        svg.text(LEFT - 6, y + ROW / 2 + 4, f"rank {rank} compute", size=11, anchor="end")
        for r in mine:
            if r.kind != "span" or r.cat == "comm" or r.end_ns is None:
                continue
            if r.name == "backward":
                continue  # drawn below, split where its computing ended
            svg.rect(ms(r.start_ns), y + 2, ms(r.end_ns) - ms(r.start_ns), ROW - 4,
                     SPAN_COLOURS.get(r.name, "#bbbbbb"), title=f"{r.name}: {r.dur_ns / 1e6:.2f} ms (step {r.step})")
        for s in steps:
            computing, waiting = backward_phases(mine, rank, s)
            for a, b in computing:
                svg.rect(ms(a), y + 2, ms(b) - ms(a), ROW - 4, SPAN_COLOURS["backward"],
                         title=f"backward computing: {(b - a) / 1e6:.2f} ms (step {s})")
            for a, b in waiting:
                svg.rect(ms(a), y + 2, ms(b) - ms(a), ROW - 4, WAIT_COLOUR, stroke=SPAN_COLOURS["backward"],
                         stroke_width=0.8, title=f"backward waiting for communication: {(b - a) / 1e6:.2f} ms")
        for i, (label, rs) in enumerate(rows):
            ry = comm_top + i * ROW
            svg.text(LEFT - 6, ry + ROW / 2 + 4, label, size=10, anchor="end", fill="#444")
            collective_bars(svg, rs, ry + 3, ROW - 6, ms, t1, when=lambda r: f"{r.dur_ns / 1e6:.2f} ms (step {r.step})")
        if not rows:
            svg.text(LEFT, comm_top + ROW / 2 + 4, "no collectives", size=10, fill="#555")
        y += heights[rank]
        svg.line(4, y - 5, WIDTH - 4, y - 5, stroke="#ddd")

    for s in steps:  # a dashed line where each step starts
        first = min((r.start_ns for r in chosen if r.step == s), default=None)
        if first is not None:
            svg.line(ms(first), top - 4, ms(first), y - 5, stroke="#000", width=0.8, dash="4,3", opacity=0.5)
            svg.text(ms(first) + 3, top + 2, f"step {s}", size=10, fill="#333")
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
        svg.text(x + 16, y, label, size=10)
        x += 22 + 6.2 * len(label)
