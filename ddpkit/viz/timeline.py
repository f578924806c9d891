"""Per-rank timeline: a compute row above a row per bucket, the hidden communication shaded.

The same picture as the widget's live timeline (``ddpkit/widget/timeline_view.py``), drawn
with matplotlib for a notebook or a file: backward is split where its computing ended (its last
gradient ready) from where it only waited for communication; each bucket has its own row and
colour (past ``MAX_BUCKET_ROWS`` buckets, or for FSDP's units, collectives share a few packed
rows, still coloured by bucket or unit); the title's percentage is ``overlap_fraction`` over
exactly the steps and ranks drawn, so it matches a printout that asks for the same steps.
"""
from __future__ import annotations

from ddpkit.trace import as_trace, backward_phases, overlap_fraction, overlap_intervals
from ddpkit.viz._common import OVERLAP_COLOUR, SPAN_COLOURS, WAIT_COLOUR, bucket_colour, new_figure, no_data

MAX_BUCKET_ROWS = 8
MAX_PACKED_ROWS = 4


def _pick_steps(trace, steps) -> list[int]:
    """None: every training step; an int: that one (-1 = last); a list/range: those."""
    if steps is None:
        return trace.steps
    if isinstance(steps, int):
        return [trace.resolve_step(steps)]
    return [trace.resolve_step(s) for s in steps]


def comm_rows(comm) -> list[tuple[str, list]]:
    """(label, collectives) per row: a row per bucket while there are few, else packed rows
    (each collective in the first row free when it launched)."""
    comm = sorted(comm, key=lambda r: r.start_ns)
    buckets = list(dict.fromkeys(r.bucket for r in comm))
    if comm and None not in buckets and len(buckets) <= MAX_BUCKET_ROWS:
        return [(f"bucket {b}", [r for r in comm if r.bucket == b]) for b in sorted(buckets)]
    return [(f"comm {i + 1}", row) for i, row in enumerate(pack_rows(comm, MAX_PACKED_ROWS))]


def pack_rows(comm, max_rows: int | None = None) -> list[list]:
    """Collectives (sorted by launch) packed greedily into rows: each into the first row that is
    free when it launches; past ``max_rows`` rows the last row takes the rest."""
    rows: list[list] = []
    for r in comm:
        for row in rows:
            if (row[-1].end_ns or row[-1].start_ns) <= r.start_ns:
                row.append(r)
                break
        else:
            if max_rows is None or len(rows) < max_rows:
                rows.append([r])
            else:
                rows[-1].append(r)
    return rows


def comm_colour(r):
    """A bucket's colour, or a stable colour per FSDP unit name."""
    if r.bucket is not None or r.unit is None:
        return bucket_colour(r.bucket)
    return bucket_colour(sum(map(ord, r.unit)))


def plot_timeline(trace, steps=None, ranks=None):
    """Per rank: forward, backward computing / waiting, sync and step above one row per bucket
    (each collective from launch to completion); green: communication hidden under backward."""
    trace = as_trace(trace)
    ranks = trace.ranks if ranks is None else list(ranks)
    chosen = _pick_steps(trace, steps) if trace.steps else []
    records = [r for r in trace.records if r.step in chosen and r.rank in ranks]
    spans = [r for r in records if r.kind == "span"]
    rows = {rank: comm_rows([r for r in spans if r.rank == rank and r.cat == "comm"]) for rank in ranks}
    heights = {rank: 1 + max(len(rows[rank]), 1) for rank in ranks}
    fig = new_figure(max(2.4, 1.2 + 0.32 * sum(heights.values())))
    ax = fig.subplots()
    if not spans:
        no_data(ax, "no spans recorded in these steps (call recorder.next_step() before each step)")
        return fig
    t0 = min(r.start_ns for r in spans)
    ms = lambda ns: (ns - t0) / 1e6  # noqa: E731

    def bar(y, a, b, colour, **kw):
        ax.broken_barh([(ms(a), max((b - a) / 1e6, 1e-4))], (y - 0.38, 0.76), facecolors=colour, **kw)

    yticks, ylabels, y = [], [], 0.0
    for rank in ranks:  # top to bottom: rank 0 first
        mine = [r for r in records if r.rank == rank]
        comp_y = -y
        for s in chosen:
            computing, waiting = backward_phases(mine, rank, s)
            for a, b in computing:
                bar(comp_y, a, b, SPAN_COLOURS["backward"], edgecolors="black", linewidth=0.3)
            for a, b in waiting:
                bar(comp_y, a, b, WAIT_COLOUR, edgecolors=SPAN_COLOURS["backward"], linewidth=0.8)
            _, _, both = overlap_intervals(mine, rank, s)
            for a, b in both:  # hidden communication, behind the comm rows
                ax.broken_barh([(ms(a), (b - a) / 1e6)], (comp_y - 0.5 - len(rows[rank]), len(rows[rank])),
                               color=OVERLAP_COLOUR, alpha=0.25, lw=0, zorder=0)
        for r in mine:
            if r.kind == "span" and r.cat != "comm" and r.name != "backward" and r.end_ns is not None:
                bar(comp_y, r.start_ns, r.end_ns, SPAN_COLOURS.get(r.name, "#bbbbbb"), edgecolors="black",
                    linewidth=0.3)
        yticks.append(comp_y)
        ylabels.append(f"rank {rank} compute")
        for i, (label, rs) in enumerate(rows[rank]):
            for r in rs:
                end = r.end_ns if r.end_ns is not None else r.start_ns
                bar(comp_y - 1 - i, r.start_ns, end, comm_colour(r), edgecolors="black", linewidth=0.3)
            yticks.append(comp_y - 1 - i)
            ylabels.append(label)
        y += heights[rank] + 0.6

    last_label, span = None, max(ms(r.end_ns or r.start_ns) for r in spans) or 1.0
    for s in chosen:  # a dashed line where each step starts (earliest record on any rank)
        start = min((r.start_ns for r in spans if r.step == s), default=None)
        if start is None:
            continue
        ax.axvline(ms(start), color="black", ls="--", lw=0.8, alpha=0.6, zorder=0)
        if last_label is None or ms(start) - last_label > 0.06 * span:  # labels must not collide
            ax.annotate(f"step {s}", (ms(start), 1.0), xycoords=("data", "axes fraction"),
                        xytext=(2, -10), textcoords="offset points", fontsize=8)
            last_label = ms(start)

    from matplotlib.patches import Patch

    legend = [(SPAN_COLOURS["forward"], "forward"), (SPAN_COLOURS["backward"], "backward computing"),
              (WAIT_COLOUR, "backward waiting for comm"), (SPAN_COLOURS["sync"], "sync"),
              (SPAN_COLOURS["step"], "optimizer step"), (bucket_colour(0), "collective (colour = bucket)")]
    handles = [Patch(facecolor=c, edgecolor="black", lw=0.3) for c, _ in legend]
    handles.append(Patch(color=OVERLAP_COLOUR, alpha=0.25))
    ax.legend(handles, [t for _, t in legend] + ["comm hidden under backward"], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_yticks(yticks, ylabels, fontsize=8)
    ax.set_ylim(-y + 0.3, 0.8)
    ax.set_xlabel("time (ms)" + ("" if spans[0].clock == "host" else ", GPU time from CUDA events"))
    frac = overlap_fraction(trace, steps=chosen, ranks=ranks)
    which = f"step {chosen[0]}" if len(chosen) == 1 else f"steps {chosen[0]}-{chosen[-1]}"
    ax.set_title(f"Timeline, {len(ranks)} rank(s), {which}: "
                 f"{frac:.0%} of communication time hidden under backward computing")
    ax.grid(axis="x", alpha=0.3)
    return fig
