"""A question the course asks before a measurement: its words, its unit, and what an answer means.

Two kinds:

- ``number``: a quantity in ``unit`` (bytes in B/KiB/MiB, memory in MiB, time in ms, a count);
- ``faster``: which of two ``options`` is faster, and by how much. The answer is one signed number,
  ``+x``: the first option is faster by x %, ``-x``: the second is. "Faster by x %" means the slower
  one's step takes x % longer than the faster one's, so the two directions read alike (both
  options' times within a few % of each other: a small x either way).

``quantity`` says how a reference answer is held to a measurement (``lands``): bytes, memory and
counts exactly, times within the cost model's tolerance (``TIME_TOLERANCE``).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "ms": 1, "collectives": 1, "%": 1}
QUANTITIES = ("bytes", "memory", "count", "time")

# How far a time the cost model predicts may sit from the measured one and still "land": the model's
# own documented accuracy on a small shared machine (notebook 07: the DDP family mostly within ten
# percent over several rounds, now and then twenty, one loaded round further). A `faster` reference
# lands when the ratio of the two times it predicts is within that of the measured ratio for each
# time: a factor (1 + TIME_TOLERANCE) ** 2 either way (so where the two are close, either winner).
# On a machine other programs share, one timing round can move by more than that; ``lands`` then
# counts the tolerance from the ends of the measurement's own rounds (``spread``).
TIME_TOLERANCE = 0.25


@dataclass(frozen=True)
class Question:
    """One question, as the course asks it. ``text`` may name settings in braces (``{world_size}``),
    filled from ``setting`` and what ``ask`` is given. ``reference(setting, **extra)``: the answer the
    formulas or the cost model give (a time question's takes the cost model's predicted times as
    ``extra``; without them, None). ``read(setting, *what_the_cell_left)``: the measurement, as a
    ``reading.Measured``."""

    key: str                      # "02.naive_bytes": the notebook, then a name
    text: str
    unit: str
    quantity: str
    kind: str = "number"
    options: tuple[str, ...] = ()
    setting: dict = field(default_factory=dict)
    reference: Callable | None = field(default=None, compare=False)
    read: Callable | None = field(default=None, compare=False)   # (what the measuring cell left) -> Measured
    hint: str = ""                # what to think about, shown under the question
    reference_from: str = "the formulas"   # whose answer the reference is, in the reveal's words

    def __post_init__(self):
        if self.kind not in ("number", "faster"):
            raise ValueError(f"{self.key}: kind must be 'number' or 'faster', got {self.kind!r}")
        if self.unit not in UNITS:
            raise ValueError(f"{self.key}: unknown unit {self.unit!r}; valid: {', '.join(UNITS)}")
        if self.quantity not in QUANTITIES:
            raise ValueError(f"{self.key}: quantity must be one of {', '.join(QUANTITIES)}, got {self.quantity!r}")
        if (self.kind == "faster") != (len(self.options) == 2):
            raise ValueError(f"{self.key}: a 'faster' question has two options, a number none")

    @property
    def scale(self) -> float:
        """Base units (bytes, ms, collectives, %) per unit of the answer."""
        return UNITS[self.unit]

    def settings(self, **given) -> dict:
        """The question's setting with ``given`` on top; a ValueError for a name it does not have."""
        unknown = set(given) - set(self.setting)
        if unknown:
            raise ValueError(f"question {self.key!r} has no setting {', '.join(sorted(unknown))}; "
                             f"it has: {', '.join(self.setting) or 'none'}")
        return {**self.setting, **given}

    def words(self, setting: dict | None = None) -> str:
        """The question's text with its setting filled in."""
        return self.text.format(**(setting if setting is not None else self.setting))

    def reference_answer(self, setting: dict | None = None, *measured_by, **extra) -> float | None:
        """The formulas' (or the cost model's) answer, in the question's unit; None where unknown.
        ``measured_by``: what the measuring cell left, where the reference is in it (the cost model's
        predictions beside a measurement); ``extra``: the cost model's predicted times."""
        if self.reference is None:
            return None
        return self.reference(setting if setting is not None else self.setting, *measured_by, **extra)

    def check(self, value) -> float:
        """``value`` as an answer to this question, or a ValueError saying what one looks like."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{self.key}: an answer is a finite number ({self.describe_answer()}), got {value!r}")
        if self.kind == "number" and value < 0:
            raise ValueError(f"{self.key}: {self.unit} cannot be negative, got {value}")
        return float(value)

    def faster_answer(self, option: str, by_percent: float) -> float:
        """The signed answer for "``option`` is faster by ``by_percent`` %"."""
        if option not in self.options:
            raise ValueError(f"{self.key}: the options are {' and '.join(map(repr, self.options))}, got {option!r}")
        by = self.check(by_percent)
        if by < 0:
            raise ValueError(f"{self.key}: say which one is faster, and by a percentage >= 0, got {by_percent}")
        return by if option == self.options[0] else -by

    def describe_answer(self) -> str:
        if self.kind == "faster":
            return (f"+x: {self.options[0]} is faster by x %, -x: {self.options[1]} is; "
                    "or answer(option, x)")
        return f"in {self.unit}"

    def format(self, value: float | None) -> str:
        """An answer or a measurement in the question's words: "8.04 MiB", "overlapped faster by 12%"."""
        if value is None:
            return "-"
        if self.kind == "faster":
            if abs(value) < 0.5:
                return "no difference"
            return f"{self.options[0] if value > 0 else self.options[1]} faster by {abs(value):.0f}%"
        if self.unit == "collectives":
            return f"{value:.0f} collectives" if value != 1 else "1 collective"
        digits = 0 if self.unit == "B" else 2
        return f"{value:,.{digits}f} {self.unit}"

    def lands(self, reference: float, measured: float, spread: tuple[float, float] | None = None) -> bool:
        """Whether a reference answer lands where the measurement is: exactly for bytes, memory
        and counts (to the byte); for a time, within ``TIME_TOLERANCE`` of each time (a "which is
        faster": the ratio of the two, within that for each). ``spread``: the lowest and highest
        value the measurement's own rounds give (``faster_spread``): on a shared machine a time is
        known only that well, and the tolerance is counted from its ends."""
        if self.quantity != "time":
            return round(reference * self.scale) == round(measured * self.scale)
        low, high = spread if spread is not None else (measured, measured)
        if self.kind == "faster":
            k = (1 + TIME_TOLERANCE) ** 2
            return time_ratio(low) / k <= time_ratio(reference) <= time_ratio(high) * k
        return low * (1 - TIME_TOLERANCE) <= reference <= high * (1 + TIME_TOLERANCE)


def faster_by(time_first: float, time_second: float) -> float:
    """The signed answer two measured times give: +x when the first is faster by x % (the second
    takes x % longer), -x when the second is."""
    if not (time_first > 0 and time_second > 0):
        raise ValueError(f"step times must be > 0, got {time_first} and {time_second}")
    if time_first <= time_second:
        return 100 * (time_second / time_first - 1)
    return -100 * (time_first / time_second - 1)


def faster_spread(first_rounds, second_rounds) -> tuple[float, float]:
    """The lowest and highest signed answer two options' rounds of timings give (ms each): the
    first's slowest round against the second's fastest, and the other way round."""
    return (faster_by(max(first_rounds), min(second_rounds)), faster_by(min(first_rounds), max(second_rounds)))


def time_ratio(signed: float) -> float:
    """The second option's time over the first's, from a signed answer (``faster_by``'s inverse)."""
    return 1 + signed / 100 if signed >= 0 else 1 / (1 - signed / 100)
