"""Per-rank timeline: compute and communication lanes, overlap shaded, steps marked."""
from __future__ import annotations

from ddpkit.trace import as_trace, overlap_intervals
from ddpkit.viz._common import COMM_COLOURS, OVERLAP_COLOUR, SPAN_COLOURS, new_figure, no_data


def _pick_steps(trace, steps) -> list[int]:
    """None: every training step; an int: that one (-1 = last); a list/range: those."""
    if steps is None:
        return trace.steps
    if isinstance(steps, int):
        return [trace.resolve_step(steps)]
    return [trace.resolve_step(s) for s in steps]


def plot_timeline(trace, steps=None, ranks=None):
    """One row group per rank: compute lane (forward/backward/sync/step) above a comm lane
    (each collective from launch to completion); green: communication hidden under backward."""
    trace = as_trace(trace)
    ranks = trace.ranks if ranks is None else list(ranks)
    fig = new_figure(max(2.2, 0.9 + 1.1 * len(ranks)))
    ax = fig.subplots()
    chosen = _pick_steps(trace, steps) if trace.steps else []
    records = [r for r in trace.records if r.step in chosen and r.rank in ranks and r.kind == "span"]
    if not records:
        no_data(ax, "no spans recorded in these steps (call recorder.next_step() before each step)")
        return fig
    t0 = min(r.start_ns for r in records)
    ms = lambda ns: (ns - t0) / 1e6  # noqa: E731

    yticks, ylabels, seen = [], [], {}  # seen: legend entry -> (colour, alpha)
    comm_ns = hidden_ns = 0  # for the title: overlap_fraction over just these ranks and steps
    for i, rank in enumerate(ranks):
        base = 3 * (len(ranks) - 1 - i)  # rank 0 at the top; lanes: comm at base, compute at base+1
        comp_y, comm_y = base + 1.2, base
        for s in chosen:  # the overlap, behind both lanes
            comm, _, both = overlap_intervals(trace.records, rank, s)
            comm_ns += sum(b - a for a, b in comm)
            hidden_ns += sum(b - a for a, b in both)
            for a, b in both:
                ax.broken_barh([(ms(a), (b - a) / 1e6)], (comm_y - 0.45, 1.65 + 0.45),
                               color=OVERLAP_COLOUR, alpha=0.25, lw=0, zorder=1)
        for r in records:
            if r.rank != rank or r.end_ns is None and r.cat != "comm":
                continue
            end = r.end_ns if r.end_ns is not None else r.start_ns
            if r.cat == "comm":
                colour, y, h = COMM_COLOURS.get(r.name, "#7f7f7f"), comm_y - 0.35, 0.7
                key = r.name
            else:
                colour, y, h = SPAN_COLOURS.get(r.name, "#bbbbbb"), comp_y - 0.35, 0.7
                key = r.name
            seen[key] = (colour, 0.75 if r.cat == "comm" else 0.95)
            # translucent with an edge: collectives in flight together stay distinguishable
            ax.broken_barh([(ms(r.start_ns), max((end - r.start_ns) / 1e6, 1e-4))], (y, h),
                           facecolors=colour, edgecolors="black", linewidth=0.3,
                           alpha=seen[key][1], zorder=2)
        yticks += [comp_y, comm_y]
        ylabels += [f"rank {rank} compute", f"rank {rank} comm"]

    span = max(ms(r.start_ns if r.end_ns is None else r.end_ns) for r in records) or 1.0
    last_label = None
    for s in chosen:  # a dashed line where each step starts (earliest record on any rank)
        start = min((r.start_ns for r in records if r.step == s), default=None)
        if start is None:
            continue
        ax.axvline(ms(start), color="black", ls="--", lw=0.8, alpha=0.6, zorder=0)
        if last_label is None or ms(start) - last_label > 0.06 * span:  # labels must not collide
            ax.annotate(f"step {s}", (ms(start), 1.0), xycoords=("data", "axes fraction"),
                        xytext=(2, -10), textcoords="offset points", fontsize=8)
            last_label = ms(start)

    from matplotlib.patches import Patch

    # legend: compute spans in step order, then collectives, then the overlap
    order = [k for k in SPAN_COLOURS if k in seen] + sorted(k for k in seen if k not in SPAN_COLOURS)
    handles = [Patch(facecolor=seen[k][0], alpha=seen[k][1], edgecolor="black", lw=0.3) for k in order]
    handles.append(Patch(color=OVERLAP_COLOUR, alpha=0.25))
    ax.legend(handles, order + ["comm hidden under backward"], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_yticks(yticks, ylabels, fontsize=8)
    ax.set_ylim(-0.7, 3 * len(ranks) - 0.9)
    ax.set_xlabel("time (ms)" + ("" if trace.records[0].clock == "host" else ", GPU time from CUDA events"))
    frac = hidden_ns / comm_ns if comm_ns else 0.0
    which = f"step {chosen[0]}" if len(chosen) == 1 else f"steps {chosen[0]}-{chosen[-1]}"
    ax.set_title(f"Timeline, {len(ranks)} rank(s), {which}: "
                 f"{frac:.0%} of communication time hidden under backward")
    ax.grid(axis="x", alpha=0.3)
    return fig
