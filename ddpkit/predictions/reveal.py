"""A reveal: the prediction against the measurement of the learner's own run, the miss, and why.

Plain data and its words; ``ddpkit.viz.plot_reveal`` draws it. In a notebook a ``Reveal`` shows
itself as HTML (its lines, then the picture), elsewhere as text.
"""
from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass

from ddpkit.predictions import explain
from ddpkit.predictions.ledger import Entry, machine, now
from ddpkit.predictions.question import Question
from ddpkit.predictions.reading import Measured


@dataclass
class Reveal:
    """``state``: "answered", "skipped", or "late" (the measurement ran before an answer)."""

    question: Question
    setting: dict
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

    def lines(self) -> list[str]:
        q, fmt = self.question, self.question.format
        said = {"answered": fmt(self.prediction), "skipped": "skipped",
                "late": "none: the measurement ran before an answer"}[self.state]
        note = f"  ({self.measured.note})" if self.measured.note else ""
        out = [f"Q ({q.key}): {q.words(self.setting)}",
               f"  your prediction: {said}",
               f"  measured:        {fmt(self.measured.value)}{note}"]
        if self.miss is not None:
            out.append(f"  miss:            {self._miss_words()}")
        if self.reference is not None:
            out.append(f"  reference ({q.reference_from}): {fmt(self.reference)}")
        out.append(f"  {self.sentence}")
        return out

    def _miss_words(self) -> str:
        """"-4.02 MiB (-50%)", or for "which is faster" "-599 points" (of the signed %)."""
        q, m = self.question, self.miss
        if q.kind == "faster":
            return f"{m:+.0f} points"
        rel = f" ({m / abs(self.measured.value):+.0%})" if self.measured.value else ""
        return f"{m:+,.{0 if q.unit in ('B', 'collectives') else 2}f} {q.unit}{rel}"

    def text(self) -> str:
        return "\n".join(self.lines())

    def __str__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p, cycle):
        p.text(self.text())

    def figure(self):
        from ddpkit.viz.predictions import plot_reveal

        return plot_reveal(self)

    def _repr_html_(self) -> str:
        q, fmt = self.question, self.question.format
        said = {"answered": fmt(self.prediction), "skipped": "skipped",
                "late": "none (the measurement ran first)"}[self.state]
        rows = [("your prediction", said), ("measured", fmt(self.measured.value))]
        if self.miss is not None:
            rows.append(("miss", self._miss_words()))
        if self.reference is not None:
            rows.append((f"reference ({q.reference_from})", fmt(self.reference)))
        cells = "".join(f"<tr><td style='padding-right:1em'>{html.escape(a)}</td>"
                        f"<td><b>{html.escape(b)}</b></td></tr>" for a, b in rows)
        buf = io.BytesIO()
        self.figure().savefig(buf, format="png", dpi=90, bbox_inches="tight")
        img = base64.b64encode(buf.getvalue()).decode()
        return (f"<div class='ddpkit-reveal' style='border-left:4px solid #4c72b0;padding-left:8px'>"
                f"<div><b>Reveal.</b> {html.escape(q.words(self.setting))}</div><table>{cells}</table>"
                f"<p class='ddpkit-reveal-sentence'>{html.escape(self.sentence)}</p>"
                f"<img src='data:image/png;base64,{img}'/></div>")

    def entry(self) -> Entry:
        """This reveal as a ledger entry."""
        return Entry(question=self.question.key, text=self.question.words(self.setting), unit=self.question.unit,
                     kind=self.question.kind, quantity=self.question.quantity,
                     state="skipped" if self.prediction is None else "answered", prediction=self.prediction,
                     measurement=self.measured.value, miss=self.miss, direction_right=self.direction_right,
                     reference=self.reference, world_size=self.measured.world_size or self.setting.get("world_size"),
                     network=self.measured.network or self.setting.get("network") or "loopback",
                     machine=machine(), source=self.source, time=now())
