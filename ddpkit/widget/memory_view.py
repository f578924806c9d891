"""The memory view: what each rank holds over time, stacked by category, and the peak (SVG).

A recorded ``train_step`` samples memory twice a step: at the end of forward (activations
alive, no gradients) and after the optimizer step (gradients and optimizer state alive);
strategies add their own samples (FSDP: the unsharded parameters it holds). Each point is
everything the rank holds then (``ddpkit.trace.memory_series``). The **peak** is the highest
point: the most one rank held at once among the samples, and the view lists what was live at it.
"""
from __future__ import annotations

from ddpkit.memory import CATEGORIES
from ddpkit.units import human_bytes
from ddpkit.viz.style import CATEGORY_COLOURS
from ddpkit.widget.svg import Scale, Svg, message, x_axis
from ddpkit.widget.view import Frame, View

WIDTH = 860
LEFT = 70
PANEL = 92       # px per rank
LEGEND = 180     # px at the right for the legend (11 px labels)
MAX_POINTS = 300  # per rank: longer series are thinned (keeping each bin's highest point)

NOT_RECORDED = ("Memory was not recorded in this run. A recorded run samples it in "
                "ddpkit.experiment.train_step (twice a step); a job with its own loop can call "
                "ddpkit.memory.record_memory(ddpkit.trace.seam.recorder(), model, optimizer).")
PENDING = "Memory: drawn once a rank has sent its first sample (a recorded train_step takes two a step)."

PEAK_MEANS = ("peak: the most one rank held at once among the samples (each point stacks the categories: "
              "model state, buffers, activations)")


def memory_view(series: dict[int, list], t0: int, peak=None, marker_step: int | None = None,
                empty: str = NOT_RECORDED) -> str:
    """HTML (an SVG): ``series`` is ``{rank: [(ns, step, {category: bytes}), ...]}`` (see
    ``ddpkit.trace.memory_series``), ``peak`` ``(rank, ns, step, sample)`` or None; a dashed
    line marks ``marker_step`` (the step the slider shows). No samples: the words ``empty``."""
    series = {rank: pts for rank, pts in series.items() if pts}
    if not series:
        return message(empty)
    present = {c for pts in series.values() for _, _, sample in pts for c in sample}
    cats = [c for c in CATEGORIES if c in present] + sorted(present - set(CATEGORIES))
    tallest = max(sum(sample.values()) for pts in series.values() for _, _, sample in pts) or 1
    t_end = max(t for pts in series.values() for t, _, _ in pts)
    t_first = min(pts[0][0] for pts in series.values())   # before it, the model is being built: no sample
    top = 36
    height = top + PANEL * len(series) + 86
    svg = Svg(WIDTH, height, "ddpkit-memory")
    x = Scale((t_first - t0) / 1e9, max((t_end - t0) / 1e9, (t_first - t0) / 1e9 + 1e-3), LEFT, WIDTH - LEGEND)
    sec = lambda ns: x((ns - t0) / 1e9)  # noqa: E731
    svg.text(4, 14, f"Memory per rank over time, by category (tallest {human_bytes(tallest)})", size=13,
             weight="bold")
    svg.text(4, 28, PEAK_MEANS, size=11, fill="#555")
    for i, (rank, pts) in enumerate(sorted(series.items())):
        base = top + (i + 1) * PANEL - 8
        y = Scale(0.0, tallest, base, base - PANEL + 16)
        svg.text(LEFT - 6, base - PANEL / 2 + 8, f"rank {rank}", size=11, anchor="end")
        svg.text(LEFT - 6, base - PANEL / 2 + 22, "max " + human_bytes(max(sum(p[2].values()) for p in pts)),
                 size=11, anchor="end", fill="#666")   # this rank's tallest point: one of them is the tallest
        svg.line(LEFT, base, WIDTH - LEGEND, base, stroke="#999")
        pts = _thin(pts)
        # Stacked areas: each category's area reaches from the baseline to the top of its layer,
        # drawn top layer first so the layers below paint over it (one edge per area, not two).
        tops, total = {}, [0] * len(pts)
        for c in cats:
            total = [b + sample.get(c, 0) for b, (_, _, sample) in zip(total, pts, strict=True)]
            tops[c] = total
        xs = [round(sec(t)) for t, _, _ in pts]
        for c in reversed(cats):
            if any(tops[c]):
                edge = [(px, round(y(v))) for px, v in zip(xs, tops[c], strict=True)]
                svg.path(edge + [(xs[-1], round(base)), (xs[0], round(base))], fill=CATEGORY_COLOURS.get(c, "#999"),
                         closed=True, title=f"rank {rank}: {c.replace('_', ' ')} and below")
        if marker_step is not None:
            at = [t for t, s, _ in pts if s == marker_step]
            if at:
                svg.line(sec(at[0]), base, sec(at[0]), base - PANEL + 12, stroke="#000", dash="3,3")
        if peak is not None and peak[0] == rank:
            px, py = sec(peak[1]), y(sum(peak[3].values()))
            svg.circle(px, py, 4, "#d62728", stroke="#000", stroke_width=0.6, title="peak")
            svg.text(px + 6, py + 4, "peak", size=11, fill="#d62728", weight="bold")
    x_axis(svg, x, top + PANEL * len(series) - 8, "seconds since the run started (from the first sample)")
    for j, c in enumerate(cats):  # the legend, right of the panels, stacking order bottom first
        ly = top + 12 + 16 * (len(cats) - 1 - j)
        svg.rect(WIDTH - LEGEND + 8, ly - 10, 11, 11, CATEGORY_COLOURS.get(c, "#999"))
        svg.text(WIDTH - LEGEND + 23, ly, c.replace("_", " "), size=11)
    if peak is not None:
        rank, t, step, sample = peak
        parts = " · ".join(f"{c.replace('_', ' ')} {human_bytes(sample[c])}" for c in cats if sample.get(c))
        where = f"rank {rank}, step {step}" if step is not None else f"rank {rank}, before the first step"
        svg.text(4, height - 30, f"peak {human_bytes(sum(sample.values()))} on {where}, "
                 f"{(t - t0) / 1e9:.2f} s in; live at it:", size=11, weight="bold")
        svg.text(4, height - 14, parts, size=11)
    return svg.html()


def _thin(pts: list) -> list:
    """At most MAX_POINTS points: each bin keeps its highest point, so no peak disappears."""
    if len(pts) <= MAX_POINTS:
        return pts
    per = -(-len(pts) // MAX_POINTS)
    return [max(pts[i:i + per], key=lambda p: sum(p[2].values())) for i in range(0, len(pts), per)]


def _figure(frame: Frame, empty: str) -> str:
    return memory_view(frame.memory, frame.t0, frame.peak, marker_step=frame.marker, empty=empty)


MEMORY = View("memory", "memory", _figure, pending=PENDING, missing=NOT_RECORDED)
