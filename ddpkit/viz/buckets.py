"""Bucket fill order: when each layer's gradients became ready in backward, and when its bucket
was sent. It draws ``ddpkit.trace.bucket_fill``'s figure, as the widget's bucket fill view does,
with matplotlib."""
from __future__ import annotations

from ddpkit.trace import as_trace, bucket_fill
from ddpkit.trace.figures import PACKED_NOTE
from ddpkit.units import plural
from ddpkit.viz._common import new_figure, no_data
from ddpkit.viz.style import WAIT_COLOUR, bucket_colour, comm_colour


def plot_bucket_fill(trace, rank: int = 0, step: int = -1):
    """Top: a row per layer, a dot per gradient when ready, coloured by bucket. Bottom: each bucket's
    collective. Shaded: backward computing, then waiting (ms from backward's or the first collective's start)."""
    trace = as_trace(trace)
    if not trace.steps:
        fig = new_figure(2.0)
        no_data(fig.subplots(), "no training steps recorded (call recorder.next_step() before each step)")
        return fig
    fill = bucket_fill(trace, rank, step)
    s, rows, lanes = fill.step, fill.rows, fill.comm_rows
    fig = new_figure(1.6 + 0.2 * max(len(rows), 3) + 0.25 * max(len(lanes), 1))
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[max(len(rows), 3), 1.4 * max(len(lanes), 1)])
    if fill.t0 is None:
        no_data(top, f"rank {rank}, step {s}: no backward, grad_ready or collective records")
        bottom.set_visible(False)
        return fig
    t0 = fill.t0
    ms = lambda ns: (ns - t0) / 1e6  # noqa: E731

    for ax in (top, bottom):
        for a, b in fill.computing:
            ax.axvspan(ms(a), ms(b), color="#dd8452", alpha=0.12, lw=0)
        for a, b in fill.waiting:
            ax.axvspan(ms(a), ms(b), color=WAIT_COLOUR, alpha=0.35, lw=0)

    if rows:
        for i, (_, grads) in enumerate(rows):
            top.scatter([ms(t) for _, _, t in grads], [i] * len(grads), c=[bucket_colour(b) for _, b, _ in grads],
                        s=26, zorder=3, edgecolors="black", linewidths=0.3)
        top.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=9)
        top.set_ylim(len(rows) - 0.5, -0.5)  # the first layer ready at the top
        top.set_ylabel("layer (ready order)")
    else:
        no_data(top, "no grad_ready records in this step: only a strategy that acts from gradient\n"
                     "hooks (the DDP wrappers, while recording) records when each gradient is ready")
    buckets = fill.buckets
    what = f"{plural(len(fill.ready), 'gradient')} in {plural(len(buckets), 'bucket')}"
    top.set_title(f"Bucket fill order: rank {rank}, step {s}: {what}\n"
                  "(dot colour: bucket; shaded: backward computing, grey: waiting for communication)", fontsize=10)
    top.grid(axis="x", alpha=0.3)

    if lanes:
        for i, (_, rs) in enumerate(lanes):
            for r in rs:
                end = r.end_ns if r.end_ns is not None else r.start_ns
                bottom.barh(i, max(ms(end) - ms(r.start_ns), 1e-3), left=ms(r.start_ns), height=0.6,
                            color=comm_colour(r), edgecolor="black", lw=0.5)
                bottom.plot(ms(r.start_ns), i, marker="|", color="black", ms=10)
        bottom.set_yticks(range(len(lanes)), [label for label, _ in lanes], fontsize=9)
        bottom.set_ylim(len(lanes) - 0.5, -0.5)
        bottom.set_ylabel("collectives")
        if fill.packed:  # rows "collectives", "2nd in flight", ...: say what they are
            bottom.set_title(PACKED_NOTE, fontsize=8, loc="left")
    else:
        no_data(bottom, "no collectives recorded in this step")
    bottom.set_xlabel(f"time since {fill.origin} (ms)")
    bottom.grid(axis="x", alpha=0.3)
    if 0 < len(buckets) <= 12:
        from matplotlib.lines import Line2D

        handles = [Line2D([], [], ls="", marker="o", color=bucket_colour(b), label=f"bucket {b}") for b in buckets]
        top.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
                   title="bucket", title_fontsize=8)
    return fig
