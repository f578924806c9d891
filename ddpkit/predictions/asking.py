"""Asking in a notebook: the learner's answer taken before the cell that measures it runs.

    q = ddpkit.ask("02.naive_bytes")     # shows the question (a form where widgets render, text elsewhere)
    q.answer(8.0)                        # what the form's Submit does; q.skip() its Skip
    ...the measuring cell...             # runs: the answer is locked (run first: it says so)
    q.reveal(trace)                      # prediction, measurement, the miss taken apart; kept in the ledger

The cell after the question's is the measuring one: when it starts (IPython's ``pre_run_cell``),
the answer is locked, and if none was given, that cell prints a line saying so before it measures;
the reveal then shows the measurement without a prediction and keeps nothing. Running the
question's cell again asks again. Answers for runs nobody types into: ``unattended``.
"""
from __future__ import annotations

import sys

from ddpkit.predictions import course, unattended
from ddpkit.predictions.ledger import append
from ddpkit.predictions.question import Question
from ddpkit.predictions.reveal import Reveal

STATES = ("waiting", "answered", "skipped", "late")


class Ask:
    """One question asked: its state ("waiting", "answered", "skipped", "late": the measurement
    began before an answer), the prediction (in the question's unit; "which is faster": signed),
    and, once measured, its ``Reveal``."""

    def __init__(self, question: Question, setting: dict, ledger=None):
        self.question, self.setting = question, setting
        self.state, self.prediction, self.source = "waiting", None, ""
        self.locked = False
        self.revealed: Reveal | None = None
        self.kept_in = None           # the ledger file the reveal was written to
        self._ledger = ledger
        self._listeners: list = []

    # ------------------------------------------------------------------ answering
    def answer(self, value, by_percent=None, *, source: str = "code") -> Ask:
        """Predict: a number in the question's unit; for "which is faster", ``answer(option, percent)``
        (or the signed number: +x, the first option faster by x %)."""
        self._check_open()
        q = self.question
        if by_percent is not None or isinstance(value, str):
            if q.kind != "faster":
                raise ValueError(f"{q.key} asks for a number {q.describe_answer()}, not an option")
            if by_percent is None:
                raise ValueError(f"{q.key}: say by how many % {value!r} is faster: answer({value!r}, percent)")
            value = q.faster_answer(value, by_percent)
        self.prediction, self.state, self.source = q.check(value), "answered", source
        self._changed()
        return self

    def skip(self, *, source: str = "code") -> Ask:
        """No prediction for this one (the reveal still shows the measurement)."""
        self._check_open()
        self.prediction, self.state, self.source = None, "skipped", source
        self._changed()
        return self

    def _check_open(self) -> None:
        if self.locked:
            raise RuntimeError(f"{self.question.key}: the measuring cell has run, so this answer is locked; run the "
                               "question's cell again to ask again (then the measuring cell)")

    def measurement_started(self) -> str | None:
        """The cell after the question's began: lock the answer; the line to print if none was given."""
        if self.locked:
            return None
        self.locked = True
        message = None
        if self.state == "waiting":
            self.state = "late"
            message = (f"[ddpkit] No prediction for the question above ({self.question.key}): this cell measures it. "
                       "Run the question's cell again, answer (or skip), then this cell, to have your answer "
                       "scored.")
        self._changed()
        return message

    # ------------------------------------------------------------------ revealing
    def reveal(self, *measured_by, **options) -> Reveal:
        """Read the measurement from what the measuring cell left (``measured_by``: the question's
        reader says what, e.g. a trace, ``run_strategy`` results, a sweep), score the prediction,
        keep it in the ledger (an answer or a skip, once), and return the ``Reveal``."""
        q = self.question
        if q.read is None:
            raise ValueError(f"{q.key} has no reader: give its measurement to a Reveal yourself")
        try:
            measured = q.read(self.setting, *measured_by, **options)
        except (TypeError, KeyError, AttributeError, IndexError, StopIteration) as exc:
            given = ", ".join(type(x).__name__ for x in measured_by) or "nothing"
            wants = (q.read.__doc__ or "what its measuring cell left").strip().splitlines()[0]
            raise ValueError(f"{q.key}: cannot read the measurement from {given} ({type(exc).__name__}: {exc}); "
                             f"it reads {wants}") from exc
        reveal = Reveal(q, self.setting, self.state if self.state != "waiting" else "late", self.prediction,
                        measured, q.reference_answer(self.setting, *measured_by), self.source)
        self.locked = True
        first = self.revealed is None
        self.revealed = reveal
        if first and self.state in ("answered", "skipped"):
            path = unattended.ledger_path(self._ledger, self.source == "unattended")
            if path is not None:
                append(path, reveal.entry())
                self.kept_in = path
        self._changed()
        return reveal

    # ------------------------------------------------------------------ showing
    def text(self) -> str:
        """The question in plain text, with how to answer where no form shows."""
        q = self.question
        lines = [f"Predict first ({q.key}): {q.words(self.setting)} Answer {q.describe_answer()}."]
        if q.hint:
            lines.append(f"  {q.hint}")
        lines.append(f"  Write down why. Then answer: <this question>.answer(...) or .skip(); now: {self.status()}")
        return "\n".join(lines)

    def status(self) -> str:
        q = self.question
        if self.revealed is not None:
            kept = f"; kept in {self.kept_in}" if self.kept_in else ""
            return f"measured {q.format(self.revealed.measured.value)} (the reveal is below the measuring cell){kept}"
        return {"waiting": "waiting for your answer",
                "answered": f"your answer: {q.format(self.prediction)}"
                            + (" (locked: measured next)" if self.locked else "; now run the next cell"),
                "skipped": "skipped" + ("" if self.locked else "; now run the next cell"),
                "late": "no answer: the measuring cell ran first"}[self.state]

    def __repr__(self) -> str:
        return f"<ddpkit.ask {self.question.key!r}: {self.status()}>"

    def on_change(self, callback) -> None:
        """Call ``callback(self)`` whenever the state changes (the form follows it)."""
        self._listeners.append(callback)

    def _changed(self) -> None:
        for callback in list(self._listeners):
            callback(self)


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
        asked.answer(value, source="unattended") if what == "answer" else asked.skip(source="unattended")
    shell = _shell()
    if shell is not None:
        _watch(shell, asked)
    if show:
        _show(asked, shell)
    return asked


def _shell():
    ipython = sys.modules.get("IPython")
    return ipython.get_ipython() if ipython is not None else None


def _watch(shell, asked: Ask) -> None:
    """Lock ``asked`` when the next cell starts (printing there if it was not answered). Asking the
    same question again in this kernel replaces the earlier one, whose watch ends silently."""
    watching = shell.__dict__.setdefault("_ddpkit_asked", {})   # this kernel's questions, by key
    earlier = watching.pop(asked.question.key, None)
    if earlier is not None:
        shell.events.unregister("pre_run_cell", earlier)

    def next_cell(info=None):
        shell.events.unregister("pre_run_cell", next_cell)
        watching.pop(asked.question.key, None)
        source = getattr(info, "raw_cell", "") or ""
        if "ask(" in source and asked.question.key in source:  # the question's cell, run again: asks again
            return
        message = asked.measurement_started()
        if message:
            print(message)

    watching[asked.question.key] = next_cell
    shell.events.register("pre_run_cell", next_cell)


def _show(asked: Ask, shell) -> None:
    if shell is None or getattr(shell, "kernel", None) is None:  # no front end that renders widgets
        print(asked.text())
        return
    from IPython.display import display

    from ddpkit.predictions.form import form

    box = form(asked)
    bundle = box._repr_mimebundle_()
    bundle["text/plain"] = asked.text()   # what a front end without widgets shows
    display(bundle, raw=True)
