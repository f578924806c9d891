"""The bucket fill view: when each layer's gradients became ready in one step, and each bucket's
collective, from launch to completion (SVG; see ``svg.py``).

One row per layer, in the order its gradients became ready (backward runs from the last layer
to the first, so the head is on top): the default MLP's 66 gradients are 33 rows, a dot each,
coloured by bucket. Below, one row per bucket (or FSDP unit). Behind both: backward computing,
then waiting for communication after its last gradient was ready.
"""
from __future__ import annotations

from ddpkit.trace.figures import backward_phases, fill_rows
from ddpkit.viz._common import WAIT_COLOUR, bucket_colour
from ddpkit.viz.timeline import pack_rows
from ddpkit.widget.svg import Scale, Svg, collective_bars, message, x_axis

WIDTH = 860
ROW = 14           # px per row: 11 px labels stay readable
LEFT = 150         # px for row labels
MAX_ROWS = 36      # more layers than this are merged, neighbours together
MAX_COMM_ROWS = 16  # more collectives than this share packed rows


def fill_view(records, rank: int, step: int) -> str:
    """HTML (an SVG) for one rank's step; ``records`` may hold other ranks and steps too."""
    mine = [r for r in records if r.rank == rank and r.step == step]
    ready = sorted(((r.name, r.bucket, r.start_ns) for r in mine if r.kind == "instant" and r.cat == "grad_ready"),
                   key=lambda g: g[2])
    comm = sorted((r for r in mine if r.kind == "span" and r.cat == "comm"), key=lambda r: r.start_ns)
    if not ready and not comm:
        return message(f"Rank {rank}, step {step}: no gradient-ready or collective records yet.")
    computing, waiting = backward_phases(mine, rank, step)
    starts = [a for a, _ in computing] + [t for _, _, t in ready] + [r.start_ns for r in comm]
    t0 = min(starts)
    t1 = max([t for _, _, t in ready] + [r.end_ns or r.start_ns for r in comm] + [b for _, b in computing + waiting])
    rows = fill_rows(ready, MAX_ROWS)
    lanes = _comm_rows(comm)
    top = 34
    fill_h = ROW * max(len(rows), 1)
    comm_top = top + fill_h + 22
    height = comm_top + ROW * max(len(lanes), 1) + 44
    svg = Svg(WIDTH, height, "ddpkit-fill")
    x = Scale(0.0, max((t1 - t0) / 1e6, 1e-3), LEFT, WIDTH - 16)
    ms = lambda ns: x((ns - t0) / 1e6)  # noqa: E731

    for (a, b), colour, what in [(iv, "#f6d5bd", "backward computing") for iv in computing] + \
                                [(iv, WAIT_COLOUR, "backward waiting for communication") for iv in waiting]:
        svg.rect(ms(a), top - 4, ms(b) - ms(a), height - top - 40, colour, title=what, opacity=0.6)
    buckets = sorted({b for _, b, _ in ready if b is not None} | {r.bucket for r in comm if r.bucket is not None})
    what = (f"{len(ready)} gradients, {len(buckets)} buckets (dot colour = bucket)" if ready
            else f"{len(comm)} collectives, no gradient-ready records")
    svg.text(4, 14, f"Bucket fill · rank {rank} · step {step}: {what}", size=12, weight="bold")
    svg.text(4, 28, "rows: layers, in the order their gradients became ready; shaded: backward computing, "
             "then grey: waiting for communication", size=10, fill="#555")

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
    for i, (label, rs) in enumerate(lanes):
        y = comm_top + i * ROW
        svg.text(LEFT - 6, y + ROW / 2 + 4, label, size=11, anchor="end")
        collective_bars(svg, rs, y + 2, ROW - 4, ms, t1,
                        when=lambda r: f"launched at {(r.start_ns - t0) / 1e6:.2f} ms, took {r.dur_ns / 1e6:.2f} ms")
    if not lanes:
        svg.text(LEFT, comm_top + 10, "no collectives in this step", size=11, fill="#555")
    x_axis(svg, x, height - 40, "ms since backward started", fmt=lambda v: f"{v:g}")
    return svg.html()


def _comm_rows(comm) -> list[tuple[str, list]]:
    """One row per bucket (or unit) while there are few; else collectives packed into rows
    (greedily: each into the first row free at its launch), so 66 of them fit on a screen."""
    keys = []
    for r in comm:
        key = (r.name, r.bucket if r.bucket is not None else r.unit)
        if key not in keys:
            keys.append(key)
    if len(keys) <= MAX_COMM_ROWS:
        def label(key):
            name, which = key
            return f"{'bucket ' if isinstance(which, int) else ''}{which if which is not None else ''} {name}".strip()

        return [(label(k), [r for r in comm if (r.name, r.bucket if r.bucket is not None else r.unit) == k])
                for k in keys]
    rows = pack_rows(comm)
    return [(f"{len(row)} collectives" if i == 0 else "", row) for i, row in enumerate(rows)]
