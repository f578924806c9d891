"""Bucket fill order: when each gradient became ready in backward, and when its bucket was sent."""
from __future__ import annotations

from ddpkit.trace import as_trace, bucket_fill_order, launch_order
from ddpkit.viz._common import bucket_colour, new_figure, no_data

MAX_NAMED_ROWS = 40  # beyond this many gradients, label every k-th row only


def plot_bucket_fill(trace, rank: int = 0, step: int = -1):
    """Top: each gradient's ready time (rows in ready order, colour = bucket). Bottom: each
    bucket's collective from launch to completion. Time in ms from the start of backward."""
    trace = as_trace(trace)
    fig = new_figure(6.0)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1.2])
    if not trace.steps:
        no_data(top, "no training steps recorded (call recorder.next_step() before each step)")
        bottom.set_visible(False)
        return fig
    s = trace.resolve_step(step)
    ready = bucket_fill_order(trace, rank, s)
    comm = [r for r in launch_order(trace, rank, s) if r.bucket is not None or r.unit is not None]
    backward = trace.select(rank=rank, step=s, kind="span", cat="compute", name="backward")
    # t = 0 is the start of backward (else the first event we have)
    starts = [r.start_ns for r in backward] + [t for _, _, t in ready] + [r.start_ns for r in comm]
    if not starts:
        no_data(top, f"rank {rank}, step {s}: no backward, grad_ready or collective records")
        bottom.set_visible(False)
        return fig
    t0 = min(starts)
    ms = lambda ns: (ns - t0) / 1e6  # noqa: E731

    for ax in (top, bottom):
        for r in backward:
            ax.axvspan(ms(r.start_ns), ms(r.end_ns), color="#dd8452", alpha=0.12, lw=0)

    # --- top: one row per gradient, in the order they became ready -------------------
    if ready:
        names = [name for name, _, _ in ready]
        top.scatter([ms(t) for _, _, t in ready], range(len(ready)),
                    c=[bucket_colour(b) for _, b, _ in ready], s=22, zorder=3, edgecolors="none")
        every = max(1, -(-len(names) // MAX_NAMED_ROWS))
        top.set_yticks(range(0, len(names), every), names[::every], fontsize=7)
        top.set_ylim(len(names) - 0.5, -0.5)  # the first gradient ready at the top
        top.set_ylabel("gradient (ready order)")
    else:
        no_data(top, "no grad_ready records in this step: only a strategy that launches\n"
                     "collectives from gradient hooks (OverlappedDDP) records when each gradient is ready")
    top.set_title(f"Bucket fill order: rank {rank}, step {s}  "
                  f"(shaded: backward; colour: bucket)")
    top.grid(axis="x", alpha=0.3)

    # --- bottom: each bucket's (or FSDP unit's) collective, launch -> completion ------
    if comm:
        labels = []
        units = {}  # FSDP collectives have a unit, not a bucket: one colour per unit
        for r in comm:
            if r.bucket is None:
                units.setdefault(r.unit, len(units))
        for row, r in enumerate(comm):
            label = f"bucket {r.bucket}" if r.bucket is not None else f"{r.unit}"
            labels.append(f"{label} ({r.name})")
            end = r.end_ns if r.end_ns is not None else r.start_ns
            bottom.barh(row, max(ms(end) - ms(r.start_ns), 1e-3), left=ms(r.start_ns), height=0.6,
                        color=bucket_colour(r.bucket if r.bucket is not None else units[r.unit]),
                        edgecolor="black", lw=0.5)
            bottom.plot(ms(r.start_ns), row, marker="|", color="black", ms=10)
        every = max(1, -(-len(labels) // 12))
        bottom.set_yticks(range(0, len(labels), every), labels[::every], fontsize=7)
        bottom.set_ylim(len(comm) - 0.5, -0.5)
        bottom.set_ylabel("collective\n(launch order)")
    else:
        no_data(bottom, "no bucket collectives recorded in this step")
    bottom.set_xlabel("time since backward started (ms)")
    bottom.grid(axis="x", alpha=0.3)

    buckets = sorted({b for _, b, _ in ready if b is not None} | {r.bucket for r in comm if r.bucket is not None})
    if 0 < len(buckets) <= 12:
        from matplotlib.lines import Line2D

        handles = [Line2D([], [], ls="", marker="o", color=bucket_colour(b), label=f"bucket {b}") for b in buckets]
        top.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7,
                   ncol=2 if len(buckets) > 12 else 1, title="bucket", title_fontsize=7)
    return fig
