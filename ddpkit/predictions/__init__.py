"""Predict, then measure: the learner commits a number before an experiment; the kit measures it on
the learner's own run and takes the miss apart with its own accounting.

    q = ddpkit.ask("05.zero1_state_share")       # a form (text elsewhere); the cells below wait for it
    ...the measuring cell...
    q.reveal(runs["zero1"], runs["overlapped"])  # prediction, measurement, miss, the sentence, a picture

The name is ``ask`` (and ``Ask``, ``Reveal``), not "predict": ``python -m ddpkit predict`` and
``ddpkit.costmodel.predict`` are the cost model's, whose predictions these are held against.

- ``question.py``   what a question is: its setting, words, unit, kind (a number, or which is faster)
- ``times.py``      the "which is faster" questions, each with its reader and reference
- ``counts.py``     the bytes, memory and count questions, each with its reader and reference
- ``course.py``     the list of them (``QUESTIONS``), and the table docs/predictions.md shows
- ``formulas.py``   the reference answers: the ring and ZeRO formulas over the kit's own layouts
- ``reading.py``    a measurement as terms of the kit's accounting (``Measured``)
- ``explain.py``    the miss, taken apart, in one sentence
- ``asking.py``     asking in a notebook: answer, skip, lock, reveal
- ``holding.py``    while a question waits: the cells after it hold their output back (Run All)
- ``form.py``       the ipywidgets form
- ``reveal.py``     the reveal: its lines, its HTML, its ledger entry
- ``ledger.py``     the JSONL ledger: append, read, check; ``tables.py`` a learner's and a class's table
- ``unattended.py`` answers for headless runs (``DDPKIT_ANSWERS``, ``DDPKIT_LEDGER``)
- ``report.py``     ``python -m ddpkit ledger [FILE ...]``: the table and a picture

The pictures are ``ddpkit.viz.plot_reveal``, ``plot_ledger``, ``plot_class``: they read plain
records and import nothing from here (this package calls them).
"""
from ddpkit.predictions.asking import Ask, ask
from ddpkit.predictions.course import QUESTIONS, question
from ddpkit.predictions.ledger import Entry, read, read_class
from ddpkit.predictions.question import TIME_TOLERANCE, Question, Setting, speedup, speedup_spread
from ddpkit.predictions.reading import Measured, Term
from ddpkit.predictions.reveal import Reveal
from ddpkit.predictions.tables import class_rows, class_table, learner_table

__all__ = ["ask", "Ask", "Reveal", "Question", "Setting", "QUESTIONS", "question", "Measured", "Term", "speedup",
           "speedup_spread", "TIME_TOLERANCE", "Entry", "read", "read_class", "learner_table", "class_rows",
           "class_table"]
