"""Predict, then measure: the learner commits a number before an experiment; the kit measures it on
the learner's own run and takes the miss apart with its own accounting.

    q = ddpkit.ask("05.zero1_state_share")       # a form (text elsewhere); the cells below wait for it
    ...the measuring cell...
    q.reveal(runs["zero1"], runs["overlapped"])  # prediction, measurement, miss, the sentence, a picture

The name is ``ask`` (and ``Ask``, ``Reveal``), not "predict": ``python -m ddpkit predict`` and
``ddpkit.costmodel.predict`` are the cost model's, whose predictions these are held against.

Questions: ``question.py`` (what one is), ``times.py`` and ``counts.py`` (each declared with its
reader and reference), ``course.py`` (the list), ``formulas.py`` (references); answers:
``asking.py``, ``holding.py``, ``form.py``, ``reveal.py`` (with ``reading.py``, ``explain.py``),
``ledger.py``, ``tables.py``, ``unattended.py``, ``report.py``. The pictures are ``ddpkit.viz``'s,
which import nothing from here.
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
