"""Asking in a notebook: the learner's answer, taken before its measurement is seen.

    q = ddpkit.ask("02.naive_bytes")     # shows the question (a form where widgets render, text elsewhere)
    q.answer(8.0)                        # what the form's Submit does; q.skip() its Skip
    ...the measuring cell...             # locks an answer given before it
    q.reveal(trace)                      # prediction, measurement, the miss taken apart; kept in the ledger

However the notebook is run (cell by cell, Run All, Run All Below), no number is seen before an
answer: in JupyterLab, while a question waits, every cell after it keeps its output back
(``holding.py``), and its reveal waits too; the answer (or a skip) shows them, the reveal scored
against this run's measurement, nothing run again. Where no output can be held back (IPython in a
terminal, a script), a measurement shown before an answer makes the question "late": shown, not
scored, not kept. Answers for runs nobody types into: ``unattended``.
"""
from __future__ import annotations

import sys

from ddpkit.predictions import course, unattended
from ddpkit.predictions.ledger import append
from ddpkit.predictions.question import Question, Setting
from ddpkit.predictions.reading import Measured
from ddpkit.predictions.reveal import Reveal

STATES = ("waiting", "answered", "skipped", "late")


class Ask:
    """One question asked: its state ("waiting", "answered", "skipped", "late": the measurement
    was shown before an answer), the prediction (in the question's unit; "which is faster": the
    first option's speed-up), and, once revealed, its ``Reveal`` (``revealed``)."""

    def __init__(self, question: Question, setting: Setting, ledger=None):
        self.question, self.setting = question, setting
        self.state, self.prediction, self.source = "waiting", None, ""
        self.locked = False
        self.can_wait = False          # a front end holds the measurement back until the answer
        self.pending: tuple[Measured, float | None] | None = None   # read, waiting for the answer
        self.revealed: Reveal | None = None
        self.revealed_on_answer = False
        self.kept_in = None            # the ledger file the reveal was written to
        self.keep_error: str | None = None
        self._ledger = ledger
        self._followers: list = []     # what redraws from this question: its form, held cells, a pending reveal
        self._html: str | None = None

    # ------------------------------------------------------------------ answering
    def answer(self, value, times=None, *, source: str = "code") -> Ask:
        """Predict: a number in the question's unit; "which is faster": ``answer(option, times)``,
        e.g. ``answer("overlapped", 1.5)``: overlapped's step takes two thirds of the other's."""
        self._check_open()
        q = self.question
        if q.kind == "faster":
            if not isinstance(value, str) or times is None:
                raise ValueError(f"{q.key}: say {q.describe_answer()}")
            value = q.faster_answer(value, times)
        elif times is not None or isinstance(value, str):
            raise ValueError(f"{q.key} asks for a number {q.describe_answer()}, not an option")
        self.prediction, self.state, self.source = q.check(value), "answered", source
        self._given()
        return self

    def skip(self, *, source: str = "code") -> Ask:
        """No prediction for this one (the reveal still shows the measurement)."""
        self._check_open()
        self.prediction, self.state, self.source = None, "skipped", source
        self._given()
        return self

    def _check_open(self) -> None:
        if self.locked:
            raise RuntimeError(f"{self.question.key}: the measurement has been shown, so this answer is locked")

    def _given(self) -> None:
        """An answer or a skip: where the measurement waits for it, reveal it now."""
        if self.pending is None:
            self._changed()
            return
        measured, reference = self.pending
        self.revealed_on_answer = True
        try:
            self._reveal(measured, reference)
        except OSError as exc:   # the ledger cannot be written: the reveal shows, and says so
            self.keep_error = str(exc)
            self._changed()

    def measurement_started(self, held: bool = False) -> str | None:
        """A cell after the question's began: an answer given is locked; with none, ``held`` (its
        output kept back) leaves the question open, else it is late: the line to print."""
        if self.locked or (self.state == "waiting" and held):
            return None
        self.locked = True
        message = None
        if self.state == "waiting":
            self.state = "late"
            message = (f"[ddpkit] No prediction for {self.question.key} above: this cell shows its measurement, "
                       "so it will not be scored.")
        self._changed()
        return message

    # ------------------------------------------------------------------ revealing
    def reveal(self, *measured_by, **options):
        """Read the measurement from what the measuring cell left (``measured_by``: the question's
        reader says what, e.g. a trace, ``run_strategy`` results, a sweep), score the prediction,
        keep it in the ledger (an answer or a skip, once), and return the ``Reveal``. While the
        question waits for its answer in a notebook: a placeholder that becomes the reveal when it
        is answered, against this measurement."""
        q = self.question
        try:
            measured = q.read(self.setting, *measured_by, **options)
        except (TypeError, KeyError, AttributeError, IndexError, StopIteration) as exc:
            given = ", ".join(type(x).__name__ for x in measured_by) or "nothing"
            wants = (q.read.__doc__ or "what its measuring cell left").strip().splitlines()[0]
            raise ValueError(f"{q.key}: cannot read the measurement from {given} ({type(exc).__name__}: {exc}); "
                             f"it reads {wants}") from exc
        reference = measured.reference if measured.reference is not None else q.reference(self.setting)
        if self.state == "waiting" and self.can_wait:
            from ddpkit.predictions.holding import PendingReveal

            self.pending = (measured, reference)
            self._changed()
            return PendingReveal(self)
        return self._reveal(measured, reference)

    def _reveal(self, measured: Measured, reference: float | None) -> Reveal:
        if self.state == "waiting":
            self.state = "late"
        self.locked, self.pending, self._html = True, None, None
        self.revealed = Reveal(self.question, self.setting, self.state, self.prediction, measured, reference,
                               self.source)
        if self.kept_in is None and self.state in ("answered", "skipped"):
            path = unattended.ledger_path(self._ledger, self.source == "unattended")
            if path is not None:
                append(path, self.revealed.entry())   # an OSError naming the path: nothing marked kept
                self.kept_in, self.keep_error = path, None
        self._changed()
        return self.revealed

    def reveal_html(self) -> str:
        """The reveal as HTML (drawn once: a form and a placeholder may both show it)."""
        if self._html is None:
            self._html = self.revealed._repr_html_()
        return self._html

    # ------------------------------------------------------------------ showing
    def text(self) -> str:
        """The question in plain text, with how to answer where no form shows."""
        q, name = self.question, "<this question>"
        lines = [f"Predict first ({q.key}): {q.words(self.setting)} Answer {q.describe_answer()}."]
        if q.hint:
            lines.append(f"  {q.hint}")
        lines.append(f"  Write down why. Then answer: {name}.answer(...) or .skip(); now: {self.status()}")
        return "\n".join(lines)

    def status(self) -> str:
        """Where the question stands, in words; never the measurement (the reveal shows it)."""
        wait = (": this run's measurement is in, held back until you answer (or skip)" if self.pending else
                ": the cells below keep their output back until you answer (or skip)" if self.can_wait else "")
        said = {"answered": f"your answer: {self.question.format(self.prediction)}", "skipped": "skipped",
                "late": "no answer: the measurement was shown first", "waiting": "waiting for your answer" + wait}
        if self.revealed is None:
            return said[self.state] + (" (locked: measured now)" if self.locked and self.state != "late" else "")
        kept = f"; kept in {self.kept_in}" if self.kept_in else f"; {self.keep_error}" if self.keep_error else ""
        return f"{said[self.state]}; revealed {'below' if self.revealed_on_answer else 'under its cell'}{kept}"

    def __repr__(self) -> str:
        return f"<ddpkit.ask {self.question.key!r}: {self.status()}>"

    def _repr_pretty_(self, p, cycle):
        """In a text front end, an answer that completed the reveal prints it."""
        p.text(self.revealed.text() if self.revealed is not None and self.revealed_on_answer else repr(self))

    def follow(self, follower) -> None:
        """Call ``follower.update(self)`` whenever the state changes (the form, held cells, a
        pending reveal follow it)."""
        self._followers.append(follower)

    def hand_over(self, newer: Ask) -> None:
        """The question asked again, still unanswered: ``newer`` takes over the measurement and the
        held cells waiting for this one (its form is gone, replaced by the newer's)."""
        if self.state != "waiting":
            return
        newer.pending = newer.pending or self.pending
        for f in self._followers:
            if hasattr(f, "switch"):
                f.switch(self, newer)
        self._followers = [f for f in self._followers if not hasattr(f, "switch")]

    def _changed(self) -> None:
        for f in list(self._followers):
            f.update(self)


def ask(key, *, ledger=None, show: bool = True, **setting) -> Ask:
    """Ask the course's question ``key`` (or a ``Question``) with ``setting`` on top of its own
    (e.g. ``world_size=4``), before the cell that measures it. Shows it (a form in JupyterLab,
    text elsewhere); answered at once where ``DDPKIT_ANSWERS`` gives an answer (``unattended``).
    ``ledger``: the JSONL file the reveal appends to (False: none; default: see ``unattended``)."""
    q = key if isinstance(key, Question) else course.question(key)
    asked = Ask(q, q.settings(**setting), ledger)
    given = unattended.answer_for(q, asked.setting)
    if given is not None:
        what, value = given
        if what == "skip":
            asked.skip(source="unattended")
        else:
            asked.prediction, asked.state, asked.source = value, "answered", "unattended"
    shell = _shell()
    if shell is not None:
        from ddpkit.predictions.holding import watch

        watch(shell, asked)
    if show:
        _show(asked, shell)
    return asked


def _shell():
    ipython = sys.modules.get("IPython")
    return ipython.get_ipython() if ipython is not None else None


def _show(asked: Ask, shell) -> None:
    if shell is None or getattr(shell, "kernel", None) is None:  # no front end that renders widgets
        print(asked.text())
        return
    from IPython.display import display

    from ddpkit.predictions.form import form, view_bundle

    display(view_bundle(form(asked), asked.text()), raw=True)   # the text: a front end without widgets
