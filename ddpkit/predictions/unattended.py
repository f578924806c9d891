"""Answers for runs nobody types into: nbval, CI, a scripted run of the notebooks.

Two environment variables, read here and nowhere else in the package (``ask`` calls ``answers_given``
and ``ledger_path`` as a question is asked; a notebook's own code never needs them):

``DDPKIT_ANSWERS``
    ``skip``        every question skipped;
    ``reference``   every question answered with its reference answer where the setting alone gives
                    one (bytes, memory, counts, a collective's time), skipped where it needs the cost
                    model's profile of a run;
    a JSON object, or the path of a file holding one: ``{"02.naive_bytes": 8.0,
                    "04.overlapped_vs_bucketed": ["overlapped", 1.5], "10.parted_bytes": "skip"}``: a
                    number in the question's unit, for "which is faster" [option, how many times
                    faster], or "skip". A key that is not a question is an error naming the nearest
                    one (a key starting with "_" is a comment); a question it does not name is
                    left unanswered, as in a notebook run with no one at it.
    ``tests/conftest.py`` points it at ``notebooks/answers.json`` (one made-up learner's answers),
    so ``python -m pytest --nbval-lax notebooks/...`` runs every prediction cell headless.

``DDPKIT_LEDGER``
    where answers are kept (a JSONL file): a path, or ``off``. Unset: answers a learner gives go to
    ``predictions.jsonl`` in the notebook's folder, and answers taken from ``DDPKIT_ANSWERS`` are
    not kept (a CI run writes nothing beside the notebooks).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

ANSWERS = "DDPKIT_ANSWERS"
LEDGER = "DDPKIT_LEDGER"
DEFAULT_LEDGER = "predictions.jsonl"


def _table(spec: str) -> dict | str:
    spec = spec.strip()
    if spec in ("skip", "reference"):
        return spec
    if spec.startswith("{"):
        text, where = spec, f"${ANSWERS}"
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ValueError(f"${ANSWERS}={spec!r}: not 'skip', 'reference', a JSON object, nor a file")
        try:
            text, where = path.read_bytes().decode("utf-8"), str(path)
        except UnicodeDecodeError:
            raise ValueError(f"${ANSWERS}={spec!r}: not a JSON text file (not UTF-8: a binary file?)") from None
    try:
        table = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected a JSON object {{question key: answer}}, got a {type(table).__name__}")
    from ddpkit.predictions.course import QUESTIONS, nearest

    unknown = [k for k in table if k not in QUESTIONS and not k.startswith("_")]   # "_about": a comment
    if unknown:
        raise ValueError(f"{where}: no question {unknown[0]!r}{nearest(unknown[0])}; the course asks: "
                         f"{', '.join(QUESTIONS)}")
    return table


def answers_given(environ=None) -> dict | str | None:
    """What ``DDPKIT_ANSWERS`` gives: "skip", "reference", ``{key: answer}``, or None (unset)."""
    spec = (os.environ if environ is None else environ).get(ANSWERS)
    return None if not spec else _table(spec)


def answer_for(question, setting: dict, environ=None):
    """The unattended answer to ``question``: ("answer", value), ("skip", None) or None (none given).
    A ValueError where the value given cannot answer it."""
    table = answers_given(environ)
    if table is None:
        return None
    if table == "skip":
        return "skip", None
    if table == "reference":
        value = question.reference(setting)
        return ("answer", value) if value is not None else ("skip", None)
    if question.key not in table:
        return None
    value = table[question.key]
    if value == "skip":
        return "skip", None
    if question.kind == "faster":
        if not (isinstance(value, list) and len(value) == 2):
            raise ValueError(f"${ANSWERS}: {question.key} takes [option, how many times faster], got {value!r}")
        return "answer", question.faster_answer(*value)
    return "answer", question.check(value)


def ledger_path(given, unattended: bool, environ=None) -> Path | None:
    """Where this answer is kept: ``given`` (ask's ``ledger=``; False: nowhere), else
    ``DDPKIT_LEDGER``, else ``predictions.jsonl`` here for a learner's own answer, nowhere for an
    unattended one."""
    if given is False:
        return None
    if given is not None:
        return Path(given)
    spec = (os.environ if environ is None else environ).get(LEDGER)
    if spec:
        return None if spec == "off" else Path(spec)
    return None if unattended else Path.cwd() / DEFAULT_LEDGER
