"""Predictions against measurements: one reveal, one learner's ledger, a class's ledgers."""
from __future__ import annotations

from ddpkit.viz._common import new_figure

TERM_COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#8172b3", "#c44e52", "#937860", "#da8bc3", "#8c8c8c")
PREDICTED, REFERENCE = "#c44e52", "#2c2c2c"


def plot_reveal(reveal):
    """One reveal (``ddpkit.predictions.Reveal``): the measurement stacked in its terms, with the
    prediction (red) and the formulas' answer (black) marked. "Which is faster": each option's ms
    per step, the second's split into the first's time and the parts of the difference, and
    where the prediction put the second option, given the first's measured time."""
    q, m = reveal.question, reveal.measured
    fig = new_figure(1.9 + 0.22 * len(m.terms), 7.5)
    ax = fig.subplots()
    if q.kind == "faster":
        first, second = q.options
        t1 = m.times[first]
        ax.barh(1, t1, color="#c9d6e8", edgecolor="black", lw=0.4)
        ax.barh(0, t1, color="#c9d6e8", edgecolor="black", lw=0.4)
        _stack(ax, 0, t1, m.terms)
        if reveal.prediction is not None:
            from ddpkit.predictions.question import time_ratio

            guess = t1 * time_ratio(reveal.prediction)
            ax.plot([guess, guess], [-0.4, 0.4], color=PREDICTED, lw=2.5, label="your prediction")
        ax.set_yticks([1, 0], [first, second])
        ax.set_xlabel("ms (the second bar: the first's time, then the parts of the difference)")
    else:
        _stack(ax, 0, 0.0, m.terms)
        if reveal.prediction is not None:
            ax.plot([reveal.prediction] * 2, [-0.45, 0.45], color=PREDICTED, lw=2.5, label="your prediction")
        if reveal.reference is not None:
            ax.plot([reveal.reference] * 2, [-0.45, 0.45], color=REFERENCE, lw=1.2, ls="--",
                    label=f"reference: {reveal.question.reference_from}")
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


def plot_ledger(entries):
    """One learner's answers (``ledger.read``), the last per question, one row each: predicted
    against measured. Numbers: predicted / measured on a log axis (the green line, 1: right), the
    two values beside the label; which is faster: the measured signed % (black) and the predicted
    (orange) joined, +x the first option faster by x %."""
    from ddpkit.predictions.ledger import course_order, format_value, latest

    last = latest(entries)
    answered = [last[k] for k in course_order(last) if last[k].prediction is not None]
    numbers = [e for e in answered if e.kind == "number" and e.prediction > 0 and e.measurement > 0]
    faster = [e for e in answered if e.kind == "faster"]
    fig = new_figure(1.2 + 0.34 * max(len(numbers), len(faster), 1))
    a, b = fig.subplots(1, 2)
    for i, e in enumerate(numbers):
        a.scatter(e.prediction / e.measurement, i, color="#4c72b0", zorder=3)
    a.axvline(1, color="#55a868", lw=1)
    a.set_xscale("log")
    a.set_yticks(range(len(numbers)), [f"{e.question}: {format_value(e.prediction, e.unit, e.kind)} vs "
                                       f"{format_value(e.measurement, e.unit, e.kind)}" for e in numbers], fontsize=7)
    a.set_xlabel("predicted / measured (1 = right)")
    a.set_title("numbers: predicted vs measured", fontsize=10)
    for i, e in enumerate(faster):
        b.plot([e.measurement, e.prediction], [i, i], color="grey", lw=1)
        b.scatter(e.measurement, i, color="black", zorder=3, label="measured" if i == 0 else None)
        b.scatter(e.prediction, i, color="#dd8452", zorder=3, label="predicted" if i == 0 else None)
    b.axvline(0, color="grey", lw=0.8)
    b.set_yticks(range(len(faster)), [e.question for e in faster], fontsize=7)
    b.set_xlabel("% faster (+: the first option)")
    b.set_title("which is faster", fontsize=10)
    if faster:
        b.legend(fontsize=7, loc="best")
    for ax in (a, b):
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    return fig


def plot_class(rows):
    """A class's ledgers (``ledger.class_rows``): one line per question, each learner's miss a dot,
    the median a bar. Numbers: predicted / measured on a log axis (1 = right); which is faster:
    the miss in points."""
    numbers = [r for r in rows if r.kind == "number" and r.misses]
    faster = [r for r in rows if r.kind == "faster" and r.misses]
    fig = new_figure(1.2 + 0.32 * max(len(numbers), len(faster), 1))
    a, b = fig.subplots(1, 2)
    for i, r in enumerate(numbers):
        ratios = [max(1 + m, 1e-3) for m in r.misses]
        a.scatter(ratios, [i] * len(ratios), color="#4c72b0", alpha=0.7, zorder=3)
        a.plot([max(1 + r.median_miss, 1e-3)] * 2, [i - 0.35, i + 0.35], color="black", lw=2)
    a.axvline(1, color="#55a868", lw=1)
    a.set_xscale("log")
    a.set_yticks(range(len(numbers)), [r.question for r in numbers], fontsize=8)
    a.set_xlabel("predicted / measured (1 = right)")
    a.set_title("numbers", fontsize=10)
    for i, r in enumerate(faster):
        b.scatter(r.misses, [i] * len(r.misses), color="#dd8452", alpha=0.7, zorder=3)
        b.plot([r.median_miss] * 2, [i - 0.35, i + 0.35], color="black", lw=2)
    b.axvline(0, color="#55a868", lw=1)
    b.set_yticks(range(len(faster)), [r.question for r in faster], fontsize=8)
    b.set_xlabel("miss, points (predicted - measured %)")
    b.set_title("which is faster", fontsize=10)
    for ax in (a, b):
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    return fig
