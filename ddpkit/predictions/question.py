"""A question the course asks before a measurement: its words, its unit, its setting, what an answer means.

Two kinds: a number in ``unit`` (bytes, memory, a count, a ratio ``x``), or "which is faster"
(two ``options``), kept as the first option's speed-up over the second: ``3.0`` reads "<first>
3.00x faster", ``0.5`` "<second> 2.00x faster". ``lands`` holds a reference to a measurement:
exactly for bytes, memory and counts, times within ``TIME_TOLERANCE``.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

from ddpkit.units import human_bytes

UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "collectives": 1, "x": 1}
QUANTITIES = ("bytes", "memory", "count", "time")

# How far a predicted time may sit from the measured one and still "land": the cost model's own
# accuracy on a small shared machine (notebook 07). A speed-up lands within (1 + TIME_TOLERANCE) ** 2
# either way, counted from the ends of the measurement's rounds (``Measured.spread``).
TIME_TOLERANCE = 0.25


def _whole(name: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be a whole number >= {low}, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class Setting:
    """What a question is asked about: checked once, read by name everywhere after."""

    world_size: int
    network: str | None = None          # a preset's name, or "matched" (notebook 04's link)
    ranks_per_node: int | None = None
    model_kwargs: dict | None = None     # the course's MLP, sized (None: its default)
    model: object = None                 # the learner's own model (notebook 12)

    def __post_init__(self):
        _whole("world_size", self.world_size)
        if self.network is not None and not (isinstance(self.network, str) and self.network):
            raise ValueError(f"network must be a preset's name, got {self.network!r}")
        if self.ranks_per_node is not None:
            _whole("ranks_per_node", self.ranks_per_node)
            if self.world_size % self.ranks_per_node:
                raise ValueError(f"{self.world_size} ranks do not fill nodes of {self.ranks_per_node}")
        if self.model_kwargs is not None and not isinstance(self.model_kwargs, dict):
            raise ValueError(f"model_kwargs must be a dict, got {self.model_kwargs!r}")

    def given(self) -> tuple[str, ...]:
        """The names this setting gives a value (the ones a question can be asked with)."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name) is not None)


@dataclass(frozen=True, kw_only=True)
class Question:
    """One question: ``text`` with the setting's fields and ``facts(setting)`` (derived, never typed) in
    braces; ``read(setting, *cell's results)`` -> ``Measured``; ``reference(setting)``; ``needs``."""

    key: str                                   # "02.naive_bytes": the notebook, then a name
    text: str
    unit: str
    quantity: str
    setting: Setting
    read: Callable = field(compare=False)
    reference: Callable = field(compare=False)
    reference_from: str                        # whose answer the reference is, in the reveal's words
    options: tuple[str, ...] = ()              # "which is faster": the two, the first is "+"
    facts: Callable | None = field(default=None, compare=False)
    needs: tuple[str, ...] = ()
    hint: str = ""                             # what to think about, shown under the question

    def __post_init__(self):
        if self.unit not in UNITS:
            raise ValueError(f"{self.key}: unknown unit {self.unit!r}; valid: {', '.join(UNITS)}")
        if self.quantity not in QUANTITIES:
            raise ValueError(f"{self.key}: quantity must be one of {', '.join(QUANTITIES)}, got {self.quantity!r}")
        if len(self.options) not in (0, 2) or (self.options and (self.unit, self.quantity) != ("x", "time")):
            raise ValueError(f"{self.key}: 'which is faster' has two options, in x, of time; a number none")

    @property
    def kind(self) -> str:
        return "faster" if self.options else "number"

    @property
    def scale(self) -> float:
        """Base units (bytes, collectives) per unit of the answer."""
        return UNITS[self.unit]

    def settings(self, **given) -> Setting:
        """The setting with ``given`` on top; a ValueError for a name it lacks, a bad value, or a need unmet."""
        takes = (*self.setting.given(), *self.needs)
        unknown = sorted(set(given) - set(takes))
        if unknown:
            raise ValueError(f"question {self.key!r} has no setting {', '.join(unknown)}; it has: {', '.join(takes)}")
        setting = replace(self.setting, **given)
        missing = [n for n in self.needs if getattr(setting, n) is None]
        if missing:
            raise ValueError(f"question {self.key!r} needs {', '.join(f'{n}=' for n in missing)} (none given)")
        return setting

    def words(self, setting: Setting | None = None) -> str:
        """The question's text with its setting and facts filled in."""
        s = self.setting if setting is None else setting
        names = {f.name: getattr(s, f.name) for f in fields(s)}
        if self.facts is not None and all(getattr(s, n) is not None for n in self.needs):
            names.update(self.facts(s))
        return self.text.format(**names)

    def check(self, value) -> float:
        """``value`` as an answer to this question, or a ValueError saying what one looks like."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{self.key}: an answer is a finite number ({self.describe_answer()}), got {value!r}")
        if value < 0 or (self.unit == "x" and value == 0):
            raise ValueError(f"{self.key}: {self.unit} must be {'> 0' if self.unit == 'x' else '>= 0'}, got {value}")
        return float(value)

    def faster_answer(self, option: str, times: float) -> float:
        """The answer "``option`` is ``times`` x faster" as the first option's speed-up."""
        if option not in self.options:
            raise ValueError(f"{self.key}: the options are {' and '.join(map(repr, self.options))}, got {option!r}")
        by = self.check(times)
        if by < 1:
            raise ValueError(f"{self.key}: say which one is faster and how many times (1 or more: 1.5 = it takes "
                             f"two thirds of the other's time), got {times}")
        return by if option == self.options[0] else 1 / by

    def describe_answer(self) -> str:
        if self.kind == "faster":
            return f"which one, and how many times faster: answer({self.options[0]!r}, 1.5)"
        return f"in {self.unit}" if self.unit != "x" else "as a ratio (1.5 = one and a half times)"

    def format(self, value: float | None) -> str:
        """An answer or a measurement in the question's words: "8.04 MiB", "overlapped 1.39x faster"."""
        if value is None:
            return "-"
        if self.kind == "faster":
            return speedup_words(value, self.options)
        if self.unit == "collectives":
            return f"{value:.0f} collectives" if value != 1 else "1 collective"
        if self.unit == "x":
            return f"{value:.3g}x"
        return f"{value:,.{0 if self.unit == 'B' else 2}f} {self.unit}"

    def format_change(self, d: float, of: float | None = None) -> str:
        """A signed difference in the unit that shows it ("-42.04 KiB"), and as a share of ``of`` if given."""
        if self.unit in ("KiB", "MiB", "GiB"):
            amount = ("+" if d >= 0 else "-") + human_bytes(abs(d) * self.scale)
        else:
            digits = 0 if self.unit in ("B", "collectives") else 3
            amount = f"{d:+,.{digits}f}{'' if self.unit == 'x' else ' ' + self.unit}"
        if not of:
            return amount
        rel = d / abs(of)
        return f"{amount} ({rel:+.1%} of the measured)" if abs(rel) >= 0.0005 else f"{amount} (under 0.05%)"

    def lands(self, reference: float, measured: float, spread: tuple[float, float] | None = None) -> bool:
        """Whether a reference lands: bytes, memory, counts exactly (ratios to 0.1 %); a time within
        ``TIME_TOLERANCE`` of either end of the measurement's ``spread``."""
        if self.quantity != "time":
            if self.unit == "x":
                return math.isclose(reference, measured, rel_tol=1e-3)
            return round(reference * self.scale) == round(measured * self.scale)
        low, high = spread if spread is not None else (measured, measured)
        k = (1 + TIME_TOLERANCE) ** 2
        return low / k <= reference <= high * k


def from_the_run(setting: Setting) -> None:
    """A reference that needs the run: none from the setting alone; the reader gives it."""
    return None


def speedup(time_first: float, time_second: float) -> float:
    """The first option's speed-up over the second: the second's time over the first's."""
    if not (time_first > 0 and time_second > 0):
        raise ValueError(f"step times must be > 0, got {time_first} and {time_second}")
    return time_second / time_first


def speedup_spread(first_rounds, second_rounds) -> tuple[float, float]:
    """The lowest and highest speed-up two options' rounds give (each's slowest against the other's fastest)."""
    return speedup(max(first_rounds), min(second_rounds)), speedup(min(first_rounds), max(second_rounds))


def spread_words(low: float, high: float, options: tuple[str, ...]) -> str:
    """"overlapped 1.09x to 1.13x faster", or across the line: "bucketed 1.02x faster to overlapped 1.13x"."""
    if (low > 1) == (high > 1) and min(abs(math.log(low)), abs(math.log(high))) >= 0.005:
        winner, a, b = (options[0], low, high) if low > 1 else (options[1], 1 / high, 1 / low)
        return f"{winner} {a:.3g}x to {b:.3g}x faster"
    return f"{speedup_words(low, options)} to {speedup_words(high, options)}"


def speedup_words(value: float, options: tuple[str, ...]) -> str:
    """"overlapped 1.39x faster" from the first option's speed-up (the winner named, a ratio >= 1)."""
    if abs(math.log(value)) < 0.005:
        return "no difference"
    winner, by = (options[0], value) if value > 1 else (options[1], 1 / value)
    return f"{winner} {by:.3g}x faster"
