"""The bucket fill view: when each layer's gradients became ready in one step, and each bucket's
collective, from launch to completion (SVG; see ``svg.py``).

It draws ``ddpkit.trace.bucket_fill``'s figure, as ``ddpkit.viz.plot_bucket_fill`` does: one row
per layer, in the order its gradients became ready (backward runs from the last layer to the
first, so the head is on top), a dot per gradient coloured by bucket; below, a row per bucket's
(or FSDP unit's) collective, or, past a screenful, rows packed by how many were in flight at once.
Behind both: backward computing, then waiting for communication after its last gradient was ready.
Time counts from backward's start, or from the first collective where one came earlier (FSDP's
all-gathers in forward); the axis says which.
"""
from __future__ import annotations

from ddpkit.trace.figures import PACKED_NOTE, BucketFill, bucket_fill
from ddpkit.units import plural
from ddpkit.viz.style import BUCKET_COLOURS, WAIT_COLOUR, bucket_colour
from ddpkit.widget.svg import Scale, Svg, collective_bars, message, x_axis
from ddpkit.widget.view import NO_STEPS, NO_STEPS_YET, Frame, View

WIDTH = 860
ROW = 15           # px per row: 11 px labels, never scaled down (the tabs are WIDTH wide)
LEFT = 150         # px for row labels


def fill_view(fig: BucketFill) -> str:
    """HTML (an SVG) of one rank's step, ``ddpkit.trace.bucket_fill(...)``."""
    rank, step, ready, rows, comm, lanes = fig.rank, fig.step, fig.ready, fig.rows, fig.comm, fig.comm_rows
    if not ready and not comm:
        return message(f"Rank {rank}, step {step}: no gradient-ready or collective records yet.")
    t0, t1 = fig.t0, fig.t1
    top = 34
    fill_h = ROW * max(len(rows), 1)
    comm_top = top + fill_h + 22
    height = comm_top + ROW * max(len(lanes), 1) + 44
    svg = Svg(WIDTH, height, "ddpkit-fill")
    x = Scale(0.0, max((t1 - t0) / 1e6, 1e-3), LEFT, WIDTH - 16)
    ms = lambda ns: x((ns - t0) / 1e6)  # noqa: E731

    for (a, b), colour, what in [(iv, "#f6d5bd", "backward computing") for iv in fig.computing] + \
                                [(iv, WAIT_COLOUR, "backward waiting for communication") for iv in fig.waiting]:
        svg.rect(ms(a), top - 4, ms(b) - ms(a), height - top - 40, colour, title=what, opacity=0.6)
    repeats = f", the {len(BUCKET_COLOURS)} colours repeating" if len(fig.buckets) > len(BUCKET_COLOURS) else ""
    what = (f"{plural(len(ready), 'gradient')} in {plural(len(rows), 'layer')} (a row each), "
            f"{plural(len(fig.buckets), 'bucket')} (dot colour = bucket{repeats})"
            if ready else f"{plural(len(comm), 'collective')}, no gradient-ready records")
    svg.text(4, 14, f"Bucket fill · rank {rank} · step {step}: {what}", size=13, weight="bold")
    svg.text(4, 28, "rows: layers, in the order their gradients became ready; shaded: backward computing, "
             "then grey: waiting for communication", size=11, fill="#555")

    for i, (label, grads) in enumerate(rows):
        y = top + i * ROW + ROW / 2
        svg.text(LEFT - 6, y + 4, label, size=11, anchor="end")
        svg.line(LEFT, y, WIDTH - 16, y, stroke="#eee")
        for name, bucket, t in grads:
            svg.circle(ms(t), y, 4, bucket_colour(bucket),
                       title=f"{name}: bucket {bucket}, ready at {(t - t0) / 1e6:.2f} ms", stroke="#333",
                       stroke_width=0.4)
    if not rows:
        svg.text(LEFT, top + 10, "no gradient-ready records in this step (FSDP reports its units' collectives only)",
                 size=11, fill="#555")

    svg.text(4, comm_top - 6, "collectives (launch -> completion)", size=11, weight="bold")
    if fig.packed:  # rows "collectives", "2nd in flight", ...: say what they are
        svg.text(LEFT + 90, comm_top - 6, f"rows: {PACKED_NOTE}", size=11, fill="#555")
    for i, (label, rs) in enumerate(lanes):
        y = comm_top + i * ROW
        svg.text(LEFT - 6, y + ROW / 2 + 4, label, size=11, anchor="end")
        collective_bars(svg, rs, y + 2, ROW - 4, ms, t1,
                        when=lambda r: f"launched at {(r.start_ns - t0) / 1e6:.2f} ms, took {r.dur_ns / 1e6:.2f} ms")
    if not lanes:
        svg.text(LEFT, comm_top + 10, "no collectives in this step", size=11, fill="#555")
    x_axis(svg, x, height - 40, f"ms since {fig.origin}", fmt=lambda v: f"{v:g}")
    return svg.html()


def _figure(frame: Frame, empty: str) -> str:
    if frame.step is None:
        return message(empty)
    return fill_view(bucket_fill(frame.records, frame.rank, frame.step))


def _reports_ready(records) -> bool:
    """The DDP wrappers report when each gradient became ready; FSDP reports its units' collectives
    only, and its bucket fill would be one line saying so."""
    return any(r.kind == "instant" and r.cat == "grad_ready" for r in records)


FILL = View("fill", "bucket fill", _figure, pending=NO_STEPS_YET, missing=NO_STEPS, opens=_reports_ready)
