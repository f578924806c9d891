"""The ledger: every answer a learner gave, one JSON line each, beside the notebooks.

    append(path, entry)               # what a reveal does (``Ask.reveal``)
    entries = read(path)              # one learner's file, oldest first
    print(learner_table(entries))     # ``python -m ddpkit ledger``
    rows = class_rows({"ana": read("ana.jsonl"), "ben": read("ben.jsonl")})
    print(class_table(rows))          # ``python -m ddpkit ledger ana.jsonl ben.jsonl ...``

``ddpkit.viz.plot_ledger`` and ``plot_class`` draw them. A line is an ``Entry``'s fields; a
line that is not one (a hand edit, a cut-off write) is a ValueError naming the file and line.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

RIGHT_SHARE = 0.10   # the class table's "close": within 10% (numbers) or 10 points (which is faster)


@dataclass(frozen=True)
class Entry:
    """One answer, scored: the question, the prediction (None: skipped), the measurement of the
    learner's own run, the miss (prediction - measurement, in ``unit``; "which is faster": in
    percentage points of the signed answer), and where it was measured."""

    question: str
    text: str
    unit: str
    kind: str
    quantity: str
    state: str                        # "answered" or "skipped"
    prediction: float | None
    measurement: float
    miss: float | None
    direction_right: bool | None      # "which is faster" only: the winner named
    reference: float | None
    world_size: int | None
    network: str | None
    machine: str
    source: str                       # "typed" (the form), "code" (Ask.answer), "unattended"
    time: str

    @property
    def relative_miss(self) -> float | None:
        """The miss over the measurement (numbers; None for "which is faster" and skips)."""
        if self.miss is None or self.kind == "faster" or not self.measurement:
            return None
        return self.miss / abs(self.measurement)

    @property
    def close(self) -> bool:
        if self.miss is None:
            return False
        if self.kind == "faster":
            return bool(self.direction_right) and abs(self.miss) <= 100 * RIGHT_SHARE
        return abs(self.relative_miss or 0.0) <= RIGHT_SHARE


def machine() -> str:
    """What the run ran on, in a few words: the OS, the CPU's cores, a GPU's name."""
    words = f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores"
    try:
        import torch

        if torch.cuda.is_available():
            words += f", {torch.cuda.get_device_name(0)}"
    except Exception:  # a machine without torch's CUDA: the CPU words are the description
        pass
    return words


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def append(path, entry: Entry) -> None:
    """Add ``entry`` as one line at the end of ``path`` (made with its folder if missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(dataclasses.asdict(entry)) + "\n")


FIELDS = {f.name for f in dataclasses.fields(Entry)}


def read(path) -> list[Entry]:
    """The entries of one ledger file, oldest first."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no ledger at {path}")
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            if not isinstance(d, dict) or set(d) != FIELDS:
                raise ValueError(f"fields {sorted(set(d) ^ FIELDS) if isinstance(d, dict) else d!r}")
            out.append(Entry(**d))
        except (json.JSONDecodeError, ValueError, TypeError) as exc:
            raise ValueError(f"{path}, line {i}: not a ledger entry ({exc})") from None
    return out


def latest(entries: list[Entry]) -> dict[str, Entry]:
    """Each question's last entry (an answer given again replaces the one before)."""
    return {e.question: e for e in entries}


WHOLE = ("B", "collectives")  # units counted in whole numbers


def format_value(value: float | None, unit: str, kind: str) -> str:
    if value is None:
        return "skipped"
    if kind == "faster":
        return f"{value:+.0f}%"
    if unit in WHOLE:
        return f"{value:,.0f} {unit[:-1] if unit.endswith('s') and value == 1 else unit}"
    return f"{value:,.2f} {unit}"


def _share(v: float) -> str:
    return "0%" if abs(v) < 0.005 else f"{v:+.0%}"


def course_order(keys) -> list[str]:
    """The course's order (``course.QUESTIONS``), then any other question by name."""
    from ddpkit.predictions.course import QUESTIONS

    known = [k for k in QUESTIONS if k in keys]
    return known + sorted(k for k in keys if k not in QUESTIONS)


def _table(heads: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(heads)]

    def line(cells):  # the first column to the left, the numbers to the right
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs)

    return [line(heads)] + [line(r) for r in rows]


def learner_table(entries: list[Entry]) -> str:
    """One learner's answers, the last per question, in the course's order: predicted, measured,
    the miss, whether it was close (within 10%, or the right winner within 10 points)."""
    last = latest(entries)
    rows = []
    for key in course_order(last):
        e = last[key]
        digits = 0 if e.unit in WHOLE else 2
        miss = "" if e.miss is None else (f"{e.miss:+.0f} pts" if e.kind == "faster" else
                                          "0" if abs(e.relative_miss or 0.0) < 0.005 else
                                          f"{e.miss:+,.{digits}f} ({_share(e.relative_miss)})")
        rows.append([key, format_value(e.prediction, e.unit, e.kind), format_value(e.measurement, e.unit, e.kind), miss,
                     "" if e.prediction is None else ("yes" if e.close else "no"), str(e.world_size or "")])
    lines = _table(["question", "predicted", "measured", "miss", "close", "ranks"], rows)
    answered = [e for e in last.values() if e.prediction is not None]
    lines += ["", f"{len(answered)} of {len(last)} questions answered, {sum(e.close for e in answered)} close "
              f"(numbers within {RIGHT_SHARE:.0%}; which is faster: the right one, within {100 * RIGHT_SHARE:.0f} "
              "points). Signed answers: +x = the first option faster by x %."]
    return "\n".join(lines)


@dataclass(frozen=True)
class ClassRow:
    """One question over a class: the learners who answered it and how their misses fell."""

    question: str
    kind: str
    unit: str
    learners: int                     # who have an entry for it (answered or skipped)
    answered: int
    median_miss: float | None         # numbers: relative (a share); "which is faster": points
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
    """One row per question over ``{learner: entries}``, each learner's last answer."""
    per_question: dict[str, list[Entry]] = {}
    for entries in ledgers.values():
        for key, e in latest(entries).items():
            per_question.setdefault(key, []).append(e)
    rows = []
    for key in course_order(per_question):
        es = per_question[key]
        kind, unit = es[0].kind, es[0].unit
        answered = [e for e in es if e.prediction is not None]
        misses = [e.miss if kind == "faster" else e.relative_miss for e in answered]
        misses = [m for m in misses if m is not None]
        rows.append(ClassRow(key, kind, unit, len(es), len(answered),
                             statistics.median(misses) if misses else None,
                             _quartiles(misses) if misses else None,
                             sum(bool(e.direction_right) for e in answered) if kind == "faster" else None,
                             sum(e.close for e in answered), tuple(misses)))
    return rows


def class_table(rows: list[ClassRow]) -> str:
    """The class's view: per question, how many answered, the median miss and its spread (the middle
    half of the misses), how many named the right winner (which is faster), how many were close."""
    def miss(v, kind):
        return f"{v:+.0f} pts" if kind == "faster" else _share(v)

    table = []
    for r in rows:
        table.append([r.question, f"{r.answered}/{r.learners}",
                      "" if r.median_miss is None else miss(r.median_miss, r.kind),
                      "" if r.spread is None else f"{miss(r.spread[0], r.kind)} .. {miss(r.spread[1], r.kind)}",
                      "-" if r.direction_right is None else f"{r.direction_right}/{r.answered}",
                      f"{r.close}/{r.answered}"])
    lines = _table(["question", "answered", "median miss", "spread (middle half)", "right winner", "close"], table)
    lines += ["", "miss: prediction - measurement, each against the learner's own run; numbers as a share of the "
              "measurement, which is faster in points of the signed answer (+x: the first option faster by x %).",
              f"close: within {RIGHT_SHARE:.0%} (numbers), the right winner within {100 * RIGHT_SHARE:.0f} points "
              "(which is faster)."]
    return "\n".join(lines)


def read_class(paths) -> dict[str, list[Entry]]:
    """``{learner: entries}`` from ledger files, each learner named by its file's name (without
    .jsonl); two files of one name are told apart by their folder."""
    paths = [Path(p) for p in paths]
    names = [p.stem for p in paths]
    out = {}
    for p, name in zip(paths, names, strict=True):
        key = name if names.count(name) == 1 else f"{p.parent.name}/{name}"
        out[key] = read(p)
    return out
