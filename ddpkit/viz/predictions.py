"""Predictions against measurements: one reveal, one learner's answers, a class's.

Plain records in (a reveal's attributes, ``tables.points``, ``class_rows``), a Figure out; nothing
here imports ``ddpkit.predictions``. Answers are predicted over measured on a log axis (1: right)."""
from __future__ import annotations

import math
import textwrap

from ddpkit.viz._common import new_figure

TERM_COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#8172b3", "#c44e52", "#937860", "#da8bc3", "#8c8c8c")
PREDICTED, REFERENCE = "#c44e52", "#2c2c2c"
RIGHT, WRONG = "#55a868", "#c44e52"
LIMIT = 16.0   # factors beyond 1/16 and 16 are drawn at the edge, as an arrow


def plot_reveal(reveal):
    """One reveal: the measurement stacked in its terms, the prediction (red) and reference (black)
    marked; "which is faster": the second bar is the first's time plus the parts of the difference."""
    q, m = reveal.question, reveal.measured
    fig = new_figure(1.9 + 0.22 * len(m.terms), 7.5)
    ax = fig.subplots()
    scale = 1.0   # "which is faster": a speed-up of the first is the second's time over its own
    if q.options:
        scale = m.times[q.options[0]]
        for y in (1, 0):
            ax.barh(y, scale, color="#c9d6e8", edgecolor="black", lw=0.4)
    _stack(ax, 0, scale if q.options else 0.0, m.terms)
    if reveal.prediction is not None:
        ax.plot([scale * reveal.prediction] * 2, [-0.45, 0.45], color=PREDICTED, lw=2.5, label="your prediction")
    if reveal.reference is not None:
        ax.plot([scale * reveal.reference] * 2, [-0.45, 0.45], color=REFERENCE, lw=1.2, ls="--",
                label=textwrap.fill(f"reference: {q.reference_from}", 48))  # a long one collapsed the axes
    if q.options:
        ax.set_yticks([1, 0], list(q.options))
        ax.set_xlabel("ms (the second bar: the first's time, then the parts of the difference)")
    else:
        ax.set_yticks([0], ["measured"])
        ax.set_xlabel(q.unit)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title(q.key, fontsize=9, loc="left")
    ax.grid(axis="x", alpha=0.3)
    return fig


def _stack(ax, y: float, start: float, terms) -> None:
    """Terms as segments along ``y`` from ``start``: positive to the right, negative (hatched) back."""
    at = start
    for i, t in enumerate(terms):
        colour = TERM_COLOURS[i % len(TERM_COLOURS)]
        label = t.label if len(t.label) <= 70 else t.label[:67] + "..."
        if t.value >= 0:
            ax.barh(y, t.value, left=at, color=colour, edgecolor="black", lw=0.4, label=label)
        else:
            ax.barh(y, -t.value, left=at + t.value, color="white", edgecolor=colour, hatch="///", lw=0.8, label=label)
        at += t.value


def factor(predicted: float, measured: float) -> float:
    """Predicted over measured, 1 where they are equal (0 = 0 too), kept within the axis."""
    if predicted == measured:
        return 1.0
    if predicted <= 0 or measured <= 0:
        return 1 / LIMIT if predicted < measured else LIMIT
    return min(max(predicted / measured, 1 / LIMIT), LIMIT)


def _factor_axis(ax, factors) -> None:
    """A log axis of factors, labelled 1/4x .. 4x (whole powers of two only: no smeared minor labels)."""
    from matplotlib.ticker import FixedLocator, NullLocator

    reach = max([2.0] + [max(f, 1 / f) for f in factors])
    top = 2 ** math.ceil(math.log2(reach))
    ticks = [2.0 ** k for k in range(-int(math.log2(top)), int(math.log2(top)) + 1)]
    ax.set_xscale("log", base=2)
    ax.set_xlim(1 / top / 1.25, top * 1.25)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(ticks, [f"{t:g}x" if t >= 1 else f"1/{1 / t:g}x" for t in ticks], fontsize=8)
    ax.axvline(1, color=RIGHT, lw=1)
    ax.grid(axis="x", alpha=0.3)


def plot_ledger(points):
    """One learner's answers (``tables.points``): a row each, predicted over measured, green if close."""
    fig = new_figure(1.3 + 0.32 * max(len(points), 1))
    ax = fig.subplots()
    factors = [factor(p.predicted, p.measured) for p in points]
    for i, (p, f) in enumerate(zip(points, factors, strict=True)):
        edge = ">" if f >= LIMIT else "<" if f <= 1 / LIMIT else "o"   # beyond the axis: an arrow at its edge
        ax.scatter(f, i, color=RIGHT if p.close else WRONG, marker=edge, zorder=3, s=36)
    _factor_axis(ax, factors)
    ax.set_yticks(range(len(points)), [p.label for p in points], fontsize=8)
    ax.set_ylim(len(points) - 0.5, -0.5)
    ax.set_xlabel("predicted / measured (1x: right)\nwhich is faster: your speed-up over the measured one")
    ax.set_title("your predictions against your runs (green: close)", fontsize=10, loc="left")
    return fig


def plot_class(rows):
    """A class's ledgers (``tables.class_rows``): a row per question, a dot per learner, the median a bar."""
    rows = [r for r in rows if r.misses]
    fig = new_figure(1.3 + 0.32 * max(len(rows), 1))
    ax = fig.subplots()
    every = []
    for i, r in enumerate(rows):
        dots = [m if r.kind == "faster" else 1 + m for m in r.misses]
        middle = r.median_miss if r.kind == "faster" else 1 + r.median_miss
        dots = [factor(d, 1.0) for d in dots]
        every += dots
        ax.scatter(dots, [i] * len(dots), color="#4c72b0", alpha=0.7, zorder=3)
        ax.plot([factor(middle, 1.0)] * 2, [i - 0.35, i + 0.35], color="black", lw=2)
    _factor_axis(ax, every)
    ax.set_yticks(range(len(rows)), [r.question for r in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("predicted / measured, each learner against their own run (bar: the median)")
    ax.set_title("the class's predictions", fontsize=10, loc="left")
    return fig
