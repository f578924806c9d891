"""A learner's table and a class's, from ledger entries (``ledger.py``): what ``python -m ddpkit
ledger`` prints, and the plain rows ``ddpkit.viz.plot_ledger`` and ``plot_class`` draw.

    print(learner_table(read("predictions.jsonl")))
    rows = class_rows(read_class(["ana.jsonl", "ben.jsonl"]))
    print(class_table(rows))
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from ddpkit.predictions.ledger import RIGHT_SHARE, Entry, latest
from ddpkit.predictions.question import speedup_words

WHOLE = ("B", "collectives")  # units counted in whole numbers


def course_order(keys) -> list[str]:
    """The course's order (``course.QUESTIONS``), then any other question by name."""
    from ddpkit.predictions.course import QUESTIONS   # the course loads the formulas: only for a table

    known = [k for k in QUESTIONS if k in keys]
    return known + sorted(k for k in keys if k not in QUESTIONS)


def format_value(value: float | None, e: Entry) -> str:
    """A prediction or a measurement as the table shows it: "8.04 MiB", "overlapped 1.39x faster"."""
    if value is None:
        return "skipped"
    if e.kind == "faster":
        return speedup_words(value, e.options) if e.options else f"{value:.3g}x (the first option's)"
    if e.unit == "x":
        return f"{value:.3g}x"
    if e.unit in WHOLE:
        return f"{value:,.0f} {e.unit[:-1] if e.unit.endswith('s') and value == 1 else e.unit}"
    return f"{value:,.2f} {e.unit}"


def miss_words(e: Entry) -> str:
    """The miss: "+0.50 MiB (+6%)"; "which is faster": "x0.80" (your speed-up over the measured)."""
    if e.miss is None:
        return ""
    if e.kind == "faster":
        return f"x{e.miss:.2f}"
    rel = e.relative_miss or 0.0
    if abs(rel) < 0.0005:
        return "0"
    digits = 0 if e.unit in WHOLE else 3 if e.unit == "x" else 2
    return f"{e.miss:+,.{digits}f} ({rel:+.1%})"


def _table(heads: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(heads)]

    def line(cells):  # the first column to the left, the rest to the right
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs)

    return [line(heads)] + [line(r) for r in rows]


CLOSE_WORDS = (f"close: numbers within {RIGHT_SHARE:.0%}; which is faster: the winner named and the speed-up "
               f"within {RIGHT_SHARE:.0%}.")


def learner_table(entries: list[Entry]) -> str:
    """One learner's last answer per question, in the course's order: predicted, measured, miss, close."""
    last = latest(entries)
    rows = []
    for key in course_order(last):
        e = last[key]
        rows.append([key, format_value(e.prediction, e), format_value(e.measurement, e), miss_words(e),
                     "" if e.prediction is None else ("yes" if e.close else "no"), str(e.world_size or "")])
    lines = _table(["question", "predicted", "measured", "miss", "close", "ranks"], rows)
    answered = [e for e in last.values() if e.prediction is not None]
    lines += ["", f"{len(answered)} of {len(last)} questions answered, {sum(e.close for e in answered)} close. "
              "miss: prediction - measurement (its share of the measurement); which is faster: your speed-up "
              "over the measured (x1.00: right). " + CLOSE_WORDS]
    return "\n".join(lines)


@dataclass(frozen=True)
class ClassRow:
    """One question over a class: the learners who answered it and how their misses fell."""

    question: str
    kind: str
    unit: str
    learners: int                     # who have an entry for it (answered or skipped)
    answered: int
    median_miss: float | None         # numbers: relative (a share); "which is faster": the factor
    spread: tuple[float, float] | None  # the misses' lower and upper quartile (the same units)
    direction_right: int | None       # "which is faster": how many named the winner
    close: int
    misses: tuple[float, ...]         # every answer's miss, for the picture


def _quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) == 1:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def class_rows(ledgers: dict[str, list[Entry]]) -> list[ClassRow]:
    """A row per question over ``{learner: entries}`` (last answers); a ValueError where two learners'
    entries disagree on its kind or unit (two versions of the course)."""
    per_question: dict[str, list[tuple[str, Entry]]] = {}
    for learner, entries in ledgers.items():
        for key, e in latest(entries).items():
            per_question.setdefault(key, []).append((learner, e))
    rows = []
    for key in course_order(per_question):
        pairs = per_question[key]
        kinds = {}
        for learner, e in pairs:
            kinds.setdefault((e.kind, e.unit), learner)
        if len(kinds) > 1:
            said = "; ".join(f"{learner}: {kind} in {unit}" for (kind, unit), learner in
                             sorted(kinds.items(), key=lambda pair: pair[1]))
            raise ValueError(f"{key} is asked two ways in these ledgers ({said}): compare ledgers of one "
                             "version of the course")
        es = [e for _, e in pairs]
        kind, unit = es[0].kind, es[0].unit
        answered = [e for e in es if e.prediction is not None]
        misses = [e.miss if kind == "faster" else e.relative_miss for e in answered]
        misses = [m for m in misses if m is not None]
        middle = (math.exp(statistics.median(math.log(m) for m in misses)) if kind == "faster"
                  else statistics.median(misses)) if misses else None
        rows.append(ClassRow(key, kind, unit, len(es), len(answered), middle, _quartiles(misses) if misses else None,
                             sum(bool(e.direction_right) for e in answered) if kind == "faster" else None,
                             sum(e.close for e in answered), tuple(misses)))
    return rows


def class_table(rows: list[ClassRow]) -> str:
    """Per question: answers, the median miss and its middle half, right winners, how many close."""
    def miss(v, kind):
        return f"x{v:.2f}" if kind == "faster" else "0%" if abs(v) < 0.005 else f"{v:+.0%}"

    table = [[r.question, f"{r.answered}/{r.learners}", "" if r.median_miss is None else miss(r.median_miss, r.kind),
              "" if r.spread is None else f"{miss(r.spread[0], r.kind)} .. {miss(r.spread[1], r.kind)}",
              "-" if r.direction_right is None else f"{r.direction_right}/{r.answered}", f"{r.close}/{r.answered}"]
             for r in rows]
    lines = _table(["question", "answered", "median miss", "spread (middle half)", "right winner", "close"], table)
    lines += ["", "miss: prediction against measurement, each against the learner's own run: numbers as a share of "
              "the measurement; which is faster as the predicted speed-up over the measured (x1.00: right).",
              CLOSE_WORDS]
    return "\n".join(lines)


@dataclass(frozen=True)
class Point:
    """One answered question, as ``ddpkit.viz.plot_ledger`` draws it: plain numbers and words."""

    label: str          # the question, and predicted against measured in words
    kind: str
    predicted: float
    measured: float
    close: bool


def points(entries: list[Entry]) -> list[Point]:
    """A learner's last answer to each question, in the course's order, skips left out."""
    last = latest(entries)
    out = []
    for key in course_order(last):
        e = last[key]
        if e.prediction is not None:
            out.append(Point(f"{key}: {format_value(e.prediction, e)} vs {format_value(e.measurement, e)}", e.kind,
                             e.prediction, e.measurement, e.close))
    return out
