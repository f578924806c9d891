"""The course's questions, one per measurement it asks the learner to predict (notebooks 01-12).

Each is declared once with its reader and reference (``times.py``, ``counts.py``); ``QUESTIONS`` is
the one list, by key ("<notebook>.<name>"); ``markdown_table`` is docs/predictions.md's (tested).

    ddpkit.ask("02.naive_bytes", world_size=2)    # before the measuring cell (asking.py)
    ...the measuring cell...
    q.reveal(trace)                               # after it: read, scored, taken apart, kept
"""
from __future__ import annotations

import difflib

from ddpkit.predictions import counts, times
from ddpkit.predictions.question import Question

QUESTIONS: dict[str, Question] = {q.key: q for q in sorted(counts.QUESTIONS + times.QUESTIONS, key=lambda q: q.key)}


def question(key: str) -> Question:
    """The course's question ``key``; a KeyError naming the nearest key and the valid ones."""
    try:
        return QUESTIONS[key]
    except KeyError:
        raise KeyError(f"no question {key!r}{nearest(key)}; the course asks: {', '.join(QUESTIONS)}") from None


def nearest(key: str) -> str:
    """" (did you mean '02.naive_bytes'?)" for a misspelt key, or nothing."""
    close = difflib.get_close_matches(str(key), QUESTIONS, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def markdown_table() -> str:
    """Every question as docs/predictions.md lists it: its words and its reference."""
    rows = ["| question | asks | reference |", "|---|---|---|"]
    for q in QUESTIONS.values():
        words = q.words()
        value = q.reference(q.setting) if not q.needs else None
        answer = f": {q.format(value)}" if value is not None else ""
        rows.append(f"| `{q.key}` | {words.replace('|', '/')} | {q.reference_from}{answer} |")
    return "\n".join(rows)
