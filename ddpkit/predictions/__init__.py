"""Predict, then measure: the learner commits a number before an experiment; the kit measures it on
the learner's own run and takes the miss apart with its own accounting.

    q = ddpkit.ask("05.zero1_optimizer_state")   # before the measuring cell: a form (text elsewhere)
    ...the measuring cell...                     # locks the answer (or says none was given)
    q.reveal(runs["zero1"])                      # prediction, measurement, miss, the sentence, a picture

The name is ``ask`` (and ``Ask``, ``Reveal``), not "predict": ``python -m ddpkit predict`` and
``ddpkit.costmodel.predict`` are the cost model's, whose predictions these are held against.

- ``question.py``   what a question is: words, unit, kind (a number, or which of two is faster)
- ``course.py``     the course's questions (``QUESTIONS``), their references and readers
- ``formulas.py``   the reference answers: the ring and ZeRO formulas over the kit's own layouts
- ``reading.py``    a measurement as terms of the kit's accounting (``Measured``)
- ``explain.py``    the miss, taken apart, in one sentence
- ``asking.py``     asking in a notebook: answer, skip, lock, reveal
- ``form.py``       the ipywidgets form
- ``reveal.py``     the reveal: its lines, its HTML, its ledger entry
- ``ledger.py``     the JSONL ledger, a learner's table, a class's table
- ``unattended.py`` answers for headless runs (``DDPKIT_ANSWERS``, ``DDPKIT_LEDGER``)

Pictures: ``ddpkit.viz.plot_reveal``, ``plot_ledger``, ``plot_class``; the command line:
``python -m ddpkit ledger [FILE ...]``.
"""
from ddpkit.predictions.asking import Ask, ask
from ddpkit.predictions.course import QUESTIONS, question
from ddpkit.predictions.ledger import Entry, class_rows, class_table, learner_table, read, read_class
from ddpkit.predictions.question import TIME_TOLERANCE, Question, faster_by, faster_spread
from ddpkit.predictions.reading import Measured, Term
from ddpkit.predictions.reveal import Reveal

__all__ = ["ask", "Ask", "Reveal", "Question", "QUESTIONS", "question", "Measured", "Term", "faster_by",
           "faster_spread", "TIME_TOLERANCE", "Entry", "read", "read_class", "learner_table", "class_rows",
           "class_table"]
