"""A reveal: the prediction against the learner's own run, the miss, and why; plain data and its
words (``viz.plot_reveal`` draws it), HTML in a notebook, text elsewhere.
"""
from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass

from ddpkit.predictions import explain
from ddpkit.predictions.ledger import Entry, machine, now
from ddpkit.predictions.question import Question, Setting, spread_words
from ddpkit.predictions.reading import Measured


@dataclass
class Reveal:
    """``state``: "answered", "skipped", or "late" (the measurement was shown before an answer)."""

    question: Question
    setting: Setting
    state: str
    prediction: float | None
    measured: Measured
    reference: float | None = None
    source: str = ""

    @property
    def miss(self) -> float | None:
        return explain.miss(self.question, self.prediction, self.measured)

    @property
    def direction_right(self) -> bool | None:
        if self.question.kind != "faster":
            return None
        return explain.direction_right(self.prediction, self.measured.value)

    @property
    def sentence(self) -> str:
        return explain.explain(self.question, self.prediction, self.measured)

    def rows(self) -> list[tuple[str, str]]:
        """(what, value) per line: prediction, measurement (and spread), miss, reference (and whether it lands)."""
        q, fmt, m = self.question, self.question.format, self.measured
        said = {"answered": fmt(self.prediction), "skipped": "skipped",
                "late": "none: the measurement was shown before an answer"}[self.state]
        rows = [("your prediction", said), ("measured", fmt(m.value))]
        if m.spread is not None:
            low, high = m.spread
            rows.append(("its rounds", spread_words(low, high, q.options)))
        if self.miss is not None:
            rows.append(("miss", self._miss_words()))
        if self.reference is not None:
            rows.append((f"reference ({q.reference_from})", fmt(self.reference) + self._trust()))
        return rows

    def _trust(self) -> str:
        """Whether the reference lands on this run (a time within tolerance of the spread's ends), in words."""
        q, m = self.question, self.measured
        if q.lands(self.reference, m.value, m.spread):
            return ": lands on this run" + (" (within its rounds, give or take the model's tolerance)"
                                            if q.quantity == "time" else ", exactly")
        if q.quantity == "time":
            return (": outside this run's rounds by more than the model's tolerance: the machine was busier "
                    "than the model's inputs, or the model leaves a part of the step out (the terms below)")
        return ": does not land on this run: the difference is a term of the accounting below"

    def _miss_words(self) -> str:
        """"-4.02 MiB (-50.0%)", "-1.00 KiB (-0.01%)" (never "-0.00 MiB (-0%)"), "exact";
        "which is faster": your speed-up over the measured one ("x0.80")."""
        q, d = self.question, self.miss
        if q.kind == "faster":
            return f"x{d:.2f} (your speed-up over the measured one; x1.00 is right)"
        if round(d * q.scale, 6) == 0:
            return "none: exact"
        return q.format_change(d, self.measured.value)

    def lines(self) -> list[str]:
        q, note = self.question, f"  ({self.measured.note})" if self.measured.note else ""
        rows = [f"  {what}: {value}" + (note if what == "measured" else "") for what, value in self.rows()]
        return [f"Q ({q.key}): {q.words(self.setting)}", *rows, f"  {self.sentence}"]

    def text(self) -> str:
        return "\n".join(self.lines())

    def __str__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p, cycle):
        p.text(self.text())

    def figure(self):
        from ddpkit.viz.predictions import plot_reveal   # matplotlib loads only when a picture is drawn

        return plot_reveal(self)

    def _repr_html_(self) -> str:
        note = f" <span style='font-weight:normal;color:#555'>({html.escape(self.measured.note)})</span>"
        cells = "".join(f"<tr><td style='padding-right:1em'>{html.escape(a)}</td><td><b>{html.escape(b)}</b>"
                        f"{note if a == 'measured' and self.measured.note else ''}</td></tr>" for a, b in self.rows())
        buf = io.BytesIO()
        self.figure().savefig(buf, format="png", dpi=90, bbox_inches="tight")
        img = base64.b64encode(buf.getvalue()).decode()
        return (f"<div class='ddpkit-reveal' style='border-left:4px solid #4c72b0;padding-left:8px'>"
                f"<div><b>Reveal.</b> {html.escape(self.question.words(self.setting))}</div><table>{cells}</table>"
                f"<p class='ddpkit-reveal-sentence'>{html.escape(self.sentence)}</p>"
                f"<img src='data:image/png;base64,{img}'/></div>")

    def entry(self) -> Entry:
        """This reveal as a ledger entry."""
        q, m = self.question, self.measured
        return Entry(question=q.key, text=q.words(self.setting), unit=q.unit, kind=q.kind, quantity=q.quantity,
                     state="skipped" if self.prediction is None else "answered", prediction=self.prediction,
                     measurement=m.value, miss=self.miss, direction_right=self.direction_right,
                     reference=self.reference, world_size=m.world_size or self.setting.world_size,
                     network=m.network or self.setting.network or "loopback", machine=machine(),
                     source=self.source, time=now(), options=q.options)
