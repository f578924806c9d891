"""The miss, taken apart: one sentence built from the numbers of a prediction and a ``Measured``.

For a number: the measurement's terms, and what the miss looks like (a common reading it equals,
terms left out or counted twice, a whole factor). For "which is faster": who won by how much, the
difference split into the step's parts, naming the one that decided it.
"""
from __future__ import annotations

import itertools
import math

from ddpkit.predictions.question import Question
from ddpkit.predictions.reading import Measured, Term

CLOSE = 0.02     # a prediction within 2% of a reading (or a term) is that reading
RIGHT = {"bytes": 0.005, "memory": 0.005, "count": 0.0, "time": 0.10}  # "right", per quantity


def miss(question: Question, prediction: float | None, measured: Measured) -> float | None:
    """Prediction minus measurement; "which is faster": prediction over measurement (1: right)."""
    if prediction is None:
        return None
    return prediction / measured.value if question.kind == "faster" else prediction - measured.value


def is_right(question: Question, prediction: float | None, measured: Measured) -> bool:
    """Within ``RIGHT`` of the measurement; "which is faster": the same winner, within 10 %."""
    if prediction is None:
        return False
    if question.kind == "faster":
        return bool(direction_right(prediction, measured.value)) and \
            abs(math.log(prediction / measured.value)) <= math.log(1 + RIGHT["time"])
    return abs(prediction - measured.value) <= RIGHT[question.quantity] * abs(measured.value) + 1e-12


def direction_right(prediction: float | None, measured: float) -> bool | None:
    """"Which is faster": did the prediction name the winner (within 0.5 %: "no difference")? None: none."""
    if prediction is None:
        return None
    if abs(math.log(measured)) < 0.005:
        return abs(math.log(prediction)) < 0.05
    return (prediction > 1) == (measured > 1)


def explain(question: Question, prediction: float | None, measured: Measured) -> str:
    """One sentence: the measurement in its terms, and what the miss (if any) looks like."""
    if question.kind == "faster":
        return _explain_faster(question, prediction, measured)
    return _explain_number(question, prediction, measured)


def _shown(question: Question, value: float) -> str:
    """``question.format(value)``, but 0 where it rounds to nothing: never "-0.00 MiB"."""
    words = question.format(value)
    return question.format(0.0) if not any(d in words for d in "123456789") else words


def _terms(question: Question, terms: list[Term]) -> str:
    return " + ".join(f"{_shown(question, t.value)} ({t.label})" for t in terms)


def _explain_number(q: Question, p: float | None, m: Measured) -> str:
    whole = f"{q.format(m.value)} = {_terms(q, m.terms)}" if len(m.terms) > 1 else \
        f"{q.format(m.value)} ({m.terms[0].label})"
    if p is None:
        return f"No prediction; the run measured {whole}."
    if is_right(q, p, m):
        return f"Right: your {q.format(p)} is what the run measured, {whole}."
    d = p - m.value
    reading = _closest(p, [r for r in m.readings if abs(r.value - m.value) > CLOSE * abs(m.value)])
    if reading is not None:
        return f"Your {q.format(p)} matches {reading.label}, {q.format(reading.value)}; the run measured {whole}."
    subset = _subset_like(abs(d), m.terms)
    if subset:
        names = " and ".join(t.label for t in subset)
        if d < 0:
            return f"You are {q.format(-d)} short, the size of {names}: the run measured {whole}."
        return f"You are {q.format(d)} over, as if {names} counted twice: the run measured {whole}."
    factor = _factor(p, m.value, m.world_size)
    if factor:
        return f"Your {q.format(p)} is {factor}: the run measured {whole}."
    off = f"You are {q.format_change(d, m.value)} off; the run measured {whole}"
    if len(m.terms) == 1:
        return off + "."
    biggest = max(m.terms, key=lambda t: abs(t.value))
    share = abs(biggest.value) / abs(m.value) if m.value else 0.0
    return f"{off}, {share:.0%} of it {biggest.label}: check that term first."


def _explain_faster(q: Question, p: float | None, m: Measured) -> str:
    first, second = q.options
    t1, t2 = m.times[first], m.times[second]
    result = f"Measured: {q.format(m.value)} ({t1:.1f} ms for {first}, {t2:.1f} ms for {second})"
    if p is None:
        said = "no prediction was made"
    elif direction_right(p, m.value):
        said = f"you said {q.format(p)}: the right one{', and close' if is_right(q, p, m) else ''}"
    else:
        said = f"you said {q.format(p)}: the other way round"
    diff, slower = t2 - t1, max(t1, t2)
    parts = ", ".join(f"{t.label} {t.value:+.1f} ms" for t in m.terms)
    decided = max(m.terms, key=lambda t: abs(t.value)).label.split(", ")[0].split(" (")[0].split(":")[0]
    return (f"{result}; {said}. Of the {abs(diff):.1f} ms between them ({second}'s time minus {first}'s: "
            f"{diff:+.1f} ms, {abs(diff) / slower:.0%} of the slower one's), {parts}; the largest part: {decided}.")


def _closest(p: float, readings: list[Term]) -> Term | None:
    near = [r for r in readings if abs(p - r.value) <= CLOSE * max(abs(r.value), 1e-12)]
    return min(near, key=lambda r: abs(p - r.value)) if near else None


def _subset_like(gap: float, terms: list[Term]) -> list[Term] | None:
    """The fewest terms whose sum is within ``CLOSE`` of ``gap`` (up to 8 terms: 255 subsets)."""
    useful = [t for t in terms if abs(t.value) > 0][:8]
    for k in range(1, len(useful) + 1):
        for combo in itertools.combinations(useful, k):
            total = sum(t.value for t in combo)
            if total > 0 and abs(total - gap) <= CLOSE * total:
                return list(combo)
    return None


def _factor(p: float, m: float, world_size: int | None) -> str | None:
    """"2x the run's", "1/4 of the run's (N = 4)" where the prediction is a whole factor off."""
    if not (p > 0 and m > 0):
        return None
    for k in sorted({2, 3, 4, 8} | ({world_size} if world_size and world_size > 1 else set())):
        n = f" (N = {k}: as if sharded, or not, once too often)" if k == world_size else ""
        if abs(p / m - k) <= CLOSE * k:
            return f"{k}x the run's{n}"
        if abs(m / p - k) <= CLOSE * k:
            return f"1/{k} of the run's{n}"
    return None
