"""Predict, then measure (``ddpkit.predictions``): questions, answers, Run All, the miss taken apart.

- A question is declared once, its setting typed: a misspelt or wrong setting is an error; its words
  name figures derived from the course's model; docs/predictions.md shows the table the list makes.
- "Which is faster" is an option and a ratio (never a percentage of an unnamed base).
- An ``Ask`` takes one answer (or a skip); run cell by cell it locks when the measurement starts;
  under Run All (a front end that renders widgets) every cell after an unanswered question holds its
  output back and its reveal waits, until the answer shows them, scored against this run.
- The sentence that takes a miss apart names the reading, the term or the factor it is.
- Unattended answers (``DDPKIT_ANSWERS``) and where answers are kept (``DDPKIT_LEDGER``).
- Every question's reference answer lands where its measurement does: exactly for bytes, memory
  and counts (a short run of its own setting), within the cost model's tolerance for time (slow).
The ledger and its tables: ``test_predictions_ledger.py``.
"""
from __future__ import annotations

import json
import math
import os
import re
import statistics
from types import SimpleNamespace

import pytest

import ddpkit
from ddpkit.predictions import QUESTIONS, Setting, ask, question, read, speedup, speedup_spread
from ddpkit.predictions import asking as ask_mod
from ddpkit.predictions import unattended
from ddpkit.predictions.course import markdown_table
from ddpkit.predictions.explain import explain
from ddpkit.predictions.holding import HeldCell, PendingReveal
from ddpkit.predictions.question import TIME_TOLERANCE
from ddpkit.predictions.reading import Measured, Term
from ddpkit.trace import Record, Trace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(ddpkit.__file__)))
MiB = 2**20
S = 4 * 2107914 / MiB    # the course's MLP: its fp32 gradients, MiB


def fake_trace(sizes=(4 * 65792,) * 32 + (4 * 2570,), op="all_reduce", world_size=2) -> Trace:
    """One recorded step of ``op`` over tensors of ``sizes`` bytes, on every rank."""
    records = []
    for rank in range(world_size):
        records.append(Record("span", "compute", "forward", rank, 0, 0, 10))
        records += [Record("span", "comm", op, rank, 0, 20 + i, 21 + i, nbytes=s) for i, s in enumerate(sizes)]
    return Trace(records, world_size)


ROUNDS = {"overlapped": [90.0, 91.0, 89.0], "bucketed": [100.0, 99.0, 101.0]}
PARTS = {"overlapped": dict(compute=60.0, exposed_comm=15.0, straggler_wait=2.0, host=13.0),
         "bucketed": dict(compute=55.0, exposed_comm=30.0, straggler_wait=2.0, host=12.0)}


@pytest.fixture(autouse=True)
def no_unattended(monkeypatch):
    """Each test sets the environment it means (conftest points DDPKIT_ANSWERS at notebooks/answers.json)."""
    monkeypatch.delenv(unattended.ANSWERS, raising=False)
    monkeypatch.delenv(unattended.LEDGER, raising=False)


# --------------------------------------------------------------------------- questions
def test_a_question_refuses_what_is_not_an_answer():
    q = question("02.naive_bytes")
    for bad in (float("nan"), float("inf"), True, "8", None, -1.0):
        with pytest.raises(ValueError, match="02.naive_bytes"):
            q.check(bad)
    faster = question("04.overlapped_vs_bucketed")
    with pytest.raises(ValueError, match="the options are 'overlapped' and 'bucketed'"):
        faster.faster_answer("fsdp", 1.5)
    with pytest.raises(ValueError, match="how many times .1 or more"):
        faster.faster_answer("overlapped", 0.5)
    with pytest.raises(KeyError, match=r"no question '02.naive_byte' \(did you mean '02.naive_bytes'\?\)"):
        question("02.naive_byte")


def test_a_setting_is_typed_and_checked():
    q = question("02.naive_bytes")
    with pytest.raises(ValueError, match="has no setting world; it has: world_size"):
        q.settings(world=2)
    with pytest.raises(ValueError, match="has no setting network"):     # a real field this question is not about
        q.settings(network="paper")
    for bad in ("x", 0, -2, 2.0, True):
        with pytest.raises(ValueError, match=f"world_size must be a whole number >= 1, got {re.escape(repr(bad))}"):
            ask("02.naive_bytes", world_size=bad, ledger=False, show=False)
    with pytest.raises(ValueError, match="4 ranks do not fill nodes of 3"):
        Setting(world_size=4, ranks_per_node=3)
    with pytest.raises(TypeError):
        Setting(world_size=2, netwrk="paper")                              # misspelt: no such field
    with pytest.raises(ValueError, match=r"12.fsdp_state' needs model="):
        question("12.fsdp_state").settings()
    assert q.settings(world_size=4).world_size == 4 and q.setting.world_size == 2


def test_a_question_names_its_arguments():
    """No reader or reference swallows what it is given: each takes the setting and named arguments."""
    import inspect

    from ddpkit.predictions.question import Question

    for q in QUESTIONS.values():
        for f in (q.read, q.reference):
            kinds = {p.kind for p in inspect.signature(f).parameters.values()}
            assert not kinds & {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}, (q.key, f)
    with pytest.raises(TypeError):
        Question("x.y", "?", "MiB", "bytes")                              # keyword-only: no positionals
    with pytest.raises(TypeError, match="unexpected keyword argument 'hnt'"):
        Question(key="x.y", text="?", unit="MiB", quantity="bytes", setting=Setting(world_size=2),
                 read=print, reference=print, reference_from="", hnt="misspelt")
    with pytest.raises(ValueError, match="unknown unit"):
        Question(key="x.y", text="?", unit="furlongs", quantity="bytes", setting=Setting(world_size=2),
                 read=print, reference=print, reference_from="")


def test_every_question_is_asked_in_words_with_derived_figures():
    assert len(QUESTIONS) == 15 and list(QUESTIONS) == sorted(QUESTIONS)
    assert sum(q.kind == "faster" for q in QUESTIONS.values()) == 5
    notebooks = {q.key.split(".")[0] for q in QUESTIONS.values()}
    assert notebooks == {f"{i:02d}" for i in range(1, 13)}, notebooks
    for q in QUESTIONS.values():
        words = q.words()
        assert "{" not in words and "?" in words and "%" not in words, q.key
        assert "8.04" not in q.text and "2.1 M" not in q.text, f"{q.key}: a figure typed into its text"
    # the figures in the words follow the model they are about
    small = question("02.naive_bytes").words()
    assert "8.04 MiB of fp32 gradients in 66 tensors" in small
    from ddpkit.predictions.counts import mlp_facts
    assert mlp_facts(Setting(world_size=2, model_kwargs={"width": 128, "depth": 16}))["gradients"] == "1.01 MiB"


def test_the_docs_table_is_the_one_the_list_makes():
    with open(os.path.join(REPO, "docs", "predictions.md")) as f:
        page = f.read()
    assert markdown_table() in page, ("docs/predictions.md's table is not the list's: paste the output of python "
                                      "-c 'from ddpkit.predictions.course import markdown_table as t; print(t())'")
    for q in QUESTIONS.values():
        assert f"`{q.key}`" in markdown_table()


def test_the_pictures_import_nothing_of_the_predictions():
    """One direction: ddpkit.predictions calls ddpkit.viz, which reads plain records (no cycle)."""
    import ast
    import pathlib

    for path in (pathlib.Path(REPO) / "ddpkit" / "viz").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n.startswith("ddpkit.predictions")], (path.name, names)


def test_which_is_faster_is_an_option_and_a_ratio():
    assert speedup(100, 150) == pytest.approx(1.5)                  # the first faster: the second takes 1.5x
    assert speedup_spread([90, 110], [100, 120]) == (pytest.approx(100 / 110), pytest.approx(120 / 90))
    q = question("04.overlapped_vs_bucketed")
    assert q.faster_answer("bucketed", 2) == 0.5 and q.faster_answer("overlapped", 2) == 2
    assert q.format(0.5) == "bucketed 2x faster" and q.format(17.04) == "overlapped 17x faster"
    assert q.format(1.001) == "no difference"
    with pytest.raises(ValueError, match="must be > 0"):
        speedup(0, 10)
    a = ask("04.overlapped_vs_bucketed", ledger=False, show=False)
    with pytest.raises(ValueError, match=r"say which one, and how many times faster: answer\('overlapped', 1.5\)"):
        a.answer(1.5)


def test_a_reveals_picture_draws_without_a_warning():
    """The longest reference line (04's) once collapsed the axes beside its legend: matplotlib's
    "constrained_layout not applied" warning showed in red under the learner's reveal."""
    import warnings

    a = ask("04.overlapped_vs_bucketed", ledger=False, show=False)
    a.answer("overlapped", 1.3)
    parts = {"compute": 254.0, "exposed_comm": 10.0, "straggler_wait": 24.1, "host": 7.3}
    r = a.reveal({"bucketed": [460.0, 450.0, 470.0], "overlapped": [295.0, 280.0, 390.0]},
                 {"overlapped": parts, "bucketed": {**parts, "exposed_comm": 158.1}},
                 {"bucketed": 426.1, "overlapped": 271.6})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "data:image/png;base64," in r._repr_html_()


def test_references_land_exactly_for_bytes_and_within_the_tolerance_for_time():
    b = question("02.naive_bytes")
    assert b.lands(S, S) and not b.lands(8.04, S)                   # 1 KiB off is not the byte count
    share = question("11.bytes_growth")
    assert share.lands(1.5, 1.5) and share.lands(1.5, 1.5004) and not share.lands(1.5, 1.502)
    t = question("04.overlapped_vs_bucketed")
    k = (1 + TIME_TOLERANCE) ** 2
    assert t.lands(1.2 * k * 0.99, 1.2) and not t.lands(1.2 * k * 1.01, 1.2)
    assert t.lands(2.0, 1.0, spread=(0.9, 1.3))                   # counted from the rounds' ends


# --------------------------------------------------------------------------- the sentence and the reveal
def test_the_sentence_names_what_the_miss_is():
    q = question("02.naive_bytes")
    measured = q.read(q.settings(world_size=4), fake_trace(world_size=4))   # 1.5 x 8.04 MiB at 4 ranks
    assert measured.value == pytest.approx(1.5 * S)
    s = explain(q, S, measured)                                     # S once: the ring's factor left out
    assert "the ring's factor left out" in s and "12.06 MiB" in s
    assert "33 all-reduces, together S = 8.04 MiB: 2(4-1)/4 x S" in s, s
    assert explain(q, 12.06, measured).startswith("Right: your 12.06 MiB")
    assert "4x the run's (N = 4" in explain(q, 4 * measured.value, measured)
    assert explain(q, None, measured).startswith("No prediction; the run measured 12.06 MiB")

    terms = Measured(10.0, [Term("parameters", 4.0), Term("gradients", 4.0), Term("optimizer state", 2.0)], "MiB")
    m = question("12.fsdp_state")
    assert "You are 2.00 MiB short, the size of optimizer state" in explain(m, 8.0, terms)
    assert "You are 4.00 MiB over, as if parameters counted twice" in explain(m, 14.0, terms)
    far = explain(m, 31.0, terms)
    assert "+21.00 MiB (+210.0% of the measured) off" in far and "40% of it parameters" in far


def test_a_reveal_never_prints_a_zero_miss_or_a_total_as_each():
    q = ask("02.naive_bytes", ledger=False, show=False).answer(S)
    lines = q.reveal(fake_trace()).text()
    assert "miss: none: exact" in lines and "-0" not in lines and "(-0" not in lines
    near = ask("02.naive_bytes", ledger=False, show=False).answer(S - 1 / 1024).reveal(fake_trace()).text()
    assert "miss: -1.00 KiB (under 0.05%)" in near, near
    assert "33 all-reduces, together S = 8.04 MiB" in lines and "of 8.04 MiB in all" not in lines


def test_the_faster_reveal_shows_the_rounds_and_whether_the_reference_lands():
    q = ask("04.overlapped_vs_bucketed", ledger=False, show=False).answer("bucketed", 1.1)
    r = q.reveal(ROUNDS, PARTS, {"overlapped": 85.0, "bucketed": 100.0})
    assert r.measured.value == pytest.approx(100 / 90)
    assert sum(t.value for t in r.measured.terms) == pytest.approx(10.0)      # the parts add up to the difference
    text = r.text()
    assert "measured: overlapped 1.11x faster" in text and "its rounds: overlapped 1.09x to 1.13x faster" in text
    assert "overlapped 1.18x faster: lands on this run" in text
    s = r.sentence
    assert s.startswith("Measured: overlapped 1.11x faster (90.0 ms for overlapped, 100.0 ms for bucketed)")
    assert "you said bucketed 1.1x faster: the other way round" in s
    assert "(bucketed's time minus overlapped's: +10.0 ms, 10% of the slower one's)" in s   # % names its base
    assert "exposed communication +15.0 ms" in s and "the largest part: exposed communication." in s
    far = ask("04.overlapped_vs_bucketed", ledger=False, show=False).answer("overlapped", 3)
    assert "outside this run's rounds" in far.reveal(ROUNDS, PARTS, {"overlapped": 30.0, "bucketed": 100.0}).text()
    assert r.figure() is not None


def test_a_reveal_of_the_wrong_thing_says_what_it_reads():
    q = ask("05.zero1_state_share", ledger=False, show=False).answer(0.5)
    with pytest.raises(ValueError, match=r"05.zero1_state_share: cannot read the measurement from int, int .*"
                                         r"it reads ``run_strategy\(..., optimizer=\"adamw\""):
        q.reveal(42, 43)
    with pytest.raises(ValueError, match="cannot read the measurement from Trace"):
        ask("04.overlapped_vs_bucketed", ledger=False, show=False).reveal(fake_trace())


# --------------------------------------------------------------------------- asking, cell by cell
def test_an_answer_is_taken_before_the_measurement_and_kept_once(tmp_path):
    path = tmp_path / "ledger.jsonl"
    q = ask("02.naive_bytes", ledger=path, show=False)
    assert q.state == "waiting"
    with pytest.raises(ValueError, match="asks for a number in MiB, not an option"):
        q.answer("overlapped", 10)
    q.answer(4.0)
    q.answer(8.0)                                     # changed before the measurement: the last counts
    assert q.measurement_started() is None and q.locked
    with pytest.raises(RuntimeError, match="locked"):
        q.answer(9.0)
    first = q.reveal(fake_trace())
    q.reveal(fake_trace())                            # shown again: kept once
    entries = read(path)
    assert len(entries) == 1 and entries[0].prediction == 8.0 and entries[0].source == "code"
    assert entries[0].measurement == pytest.approx(S) and entries[0].world_size == 2
    assert entries[0].miss == pytest.approx(first.miss) and entries[0].state == "answered"
    assert str(path) in q.status() and "8.04" not in q.status()   # the status line never shows the measurement


def test_a_faster_answer_keeps_its_options_in_the_ledger(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ask("04.overlapped_vs_bucketed", ledger=path, show=False).answer("bucketed", 2).reveal(ROUNDS, PARTS)
    [e] = read(path)
    assert e.options == ("overlapped", "bucketed") and e.prediction == 0.5 and e.unit == "x"
    assert e.miss == pytest.approx(0.5 / (100 / 90)) and e.direction_right is False


def test_a_reveal_into_a_folder_raises_and_keeps_the_answer_once_it_can(tmp_path):
    """59.5: the failed append must not mark the answer kept (it was: revealed first, then appended)."""
    path = tmp_path / "ledger.jsonl"
    path.mkdir()
    q = ask("02.naive_bytes", ledger=path, show=False).answer(8.0)
    with pytest.raises(OSError, match=f"cannot keep the answer in {re.escape(str(path))}"):
        q.reveal(fake_trace())
    assert q.kept_in is None
    path.rmdir()                                      # fixed: the next reveal keeps it
    q.reveal(fake_trace())
    assert [e.prediction for e in read(path)] == [8.0] and q.kept_in == path


def test_a_measurement_shown_before_an_answer_is_late_where_nothing_can_wait(tmp_path):
    path = tmp_path / "ledger.jsonl"
    q = ask("03.bucketed_bytes", ledger=path, show=False)     # a script: no front end to hold it back
    message = q.measurement_started()
    assert "No prediction for 03.bucketed_bytes above" in message and q.state == "late"
    with pytest.raises(RuntimeError, match="locked"):
        q.skip()
    r = q.reveal(fake_trace())
    assert r.prediction is None and "none: the measurement was shown before an answer" in r.text()
    assert not path.exists()
    skipped = ask("03.bucketed_bytes", ledger=path, show=False).skip()
    skipped.reveal(fake_trace())
    assert [e.state for e in read(path)] == ["skipped"]


@pytest.fixture
def shell(monkeypatch):
    """An IPython shell ``ask`` uses, without a kernel (IPython in a terminal: widgets do not render)."""
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell()
    monkeypatch.setattr(ask_mod, "_shell", lambda: sh)
    sh.user_ns.update(ask=ask, fake_trace=fake_trace)
    yield sh
    sh.__dict__.pop("_ddpkit_watch", None)


def test_in_a_terminal_the_next_cell_locks_the_question(shell, capsys):
    shell.run_cell('q = ask("02.naive_bytes", ledger=False)')
    assert "Predict first (02.naive_bytes)" in capsys.readouterr().out   # no widgets here: the text
    shell.run_cell('again = ask("02.naive_bytes", ledger=False)')         # asked again: replaces q
    shell.run_cell("x = 1")                                               # the measuring cell
    out = capsys.readouterr().out
    assert out.count("No prediction for 02.naive_bytes above") == 1
    assert shell.user_ns["again"].state == "late" and shell.user_ns["q"].state == "waiting"
    shell.run_cell('answered = ask("02.naive_bytes", ledger=False).answer(8.0)')
    shell.run_cell("y = 2")
    assert "No prediction" not in capsys.readouterr().out and shell.user_ns["answered"].locked


# --------------------------------------------------------------------------- Run All
def test_run_all_holds_every_cell_after_an_unanswered_question_until_its_answer(shell, tmp_path):
    """The kernel a widget front end talks to: the cells run after an unanswered question hold their
    output, its reveal waits; the answer shows them and reveals against this run's measurement."""
    shell.kernel = SimpleNamespace()                 # a front end that renders widgets
    path = tmp_path / "predictions.jsonl"
    shell.user_ns["LEDGER"] = path
    cells = ['q = ask("02.naive_bytes", ledger=LEDGER)', "trace = fake_trace()", "r = q.reveal(trace)",
             'q2 = ask("03.bucketed_bytes", ledger=LEDGER)', "r2 = q2.reveal(fake_trace())",
             "cluster_shut_down = True"]
    for cell in cells:                               # Run All: nobody answers in between
        assert shell.run_cell(cell).success, cell
    q, q2 = shell.user_ns["q"], shell.user_ns["q2"]
    assert (q.state, q.locked, q2.state) == ("waiting", False, "waiting")
    assert isinstance(shell.user_ns["r"], PendingReveal) and "appears here" in shell.user_ns["r"].html.value
    held = [f for f in q._followers if isinstance(f, HeldCell)]
    assert len(held) == 5 and all(h.out.layout.display == "none" for h in held)
    assert "8.04" not in q.status() and "held back" in q.status()

    q.answer(8.0, source="typed")                    # the form's Submit, after Run All
    assert q.revealed.prediction == 8.0 and q.revealed.measured.value == pytest.approx(S) and q.locked
    assert "ddpkit-reveal" in shell.user_ns["r"].html.value
    assert [h.out.layout.display for h in held] == [None, None, None, "none", "none"]   # two wait for q2 too
    q2.skip()
    assert all(h.out.layout.display is None for h in held)
    assert [(e.question, e.state) for e in read(path)] == [("02.naive_bytes", "answered"),
                                                            ("03.bucketed_bytes", "skipped")]


def test_a_failed_cell_shows_its_output_and_a_question_asked_again_takes_over(shell):
    shell.kernel = SimpleNamespace()
    shell.run_cell('q = ask("02.naive_bytes", ledger=False)')
    shell.run_cell("1 / 0")
    q = shell.user_ns["q"]
    [failed] = [f for f in q._followers if isinstance(f, HeldCell)]
    assert failed.out.layout.display is None and "failed" in failed.note.value
    shell.run_cell("r = q.reveal(fake_trace())")
    shell.run_cell('q = ask("02.naive_bytes", ledger=False)')      # the question's cell, run again
    newer = shell.user_ns["q"]
    assert newer is not q and newer.pending is not None
    newer.answer(4.02)
    assert shell.user_ns["r"].asked is newer and "ddpkit-reveal" in shell.user_ns["r"].html.value
    assert newer.revealed.measured.value == pytest.approx(S)


def test_the_form_answers_shows_the_reveal_and_never_the_measurement():
    from ddpkit.predictions.form import form, parse_number

    q = ask("04.overlapped_vs_bucketed", ledger=False, show=False)
    q.can_wait = True
    box = form(q)
    which, (value, submit, _skip) = box.children[2], box.children[3].children
    status, shown = box.children[4], box.children[5]
    value.value = "1.5"
    submit.click()
    assert "pick which one is faster first" in status.value and q.state == "waiting"
    q.reveal(ROUNDS, PARTS)                         # Run All measured it already
    assert "1.11" not in status.value and "held back" in status.value
    which.value = "bucketed"
    value.value = "1.5x"
    submit.click()
    assert q.prediction == pytest.approx(1 / 1.5) and q.source == "typed"
    assert "bucketed 1.5x faster" in status.value and "revealed below" in status.value
    assert "ddpkit-reveal" in shown.value and submit.disabled and value.disabled
    assert parse_number(" 1,024 ") == 1024 and parse_number("2×") == 2
    with pytest.raises(ValueError, match="not a number"):
        parse_number("lots")


# --------------------------------------------------------------------------- unattended runs
def test_unattended_answers_from_the_environment(tmp_path):
    q = question("04.overlapped_vs_bucketed")
    b = question("02.naive_bytes")
    assert unattended.answer_for(b, b.setting, {}) is None
    assert unattended.answer_for(b, b.setting, {"DDPKIT_ANSWERS": "skip"}) == ("skip", None)
    assert unattended.answer_for(b, b.setting, {"DDPKIT_ANSWERS": "reference"}) == ("answer", S)
    assert unattended.answer_for(q, q.setting, {"DDPKIT_ANSWERS": "reference"}) == ("skip", None)  # needs the run
    table = {"04.overlapped_vs_bucketed": ["bucketed", 2], "02.naive_bytes": 4}
    path = tmp_path / "answers.json"
    path.write_text(json.dumps(table))
    for spec in (str(path), json.dumps(table)):
        env = {"DDPKIT_ANSWERS": spec}
        assert unattended.answer_for(q, q.setting, env) == ("answer", 0.5)
        assert unattended.answer_for(b, b.setting, env) == ("answer", 4.0)
        assert unattended.answer_for(question("10.parted_bytes"), b.setting, env) is None
    for bad, why in (({"02.naive_bytes": "lots"}, "an answer is a finite number"),
                     ({"04.overlapped_vs_bucketed": 15}, r"takes \[option, how many times faster\]"),
                     ({"02.naive_byte": 8}, r"no question '02.naive_byte' \(did you mean '02.naive_bytes'\?\)")):
        with pytest.raises(ValueError, match=why):
            unattended.answer_for(b if "faster" not in why else q, b.setting, {"DDPKIT_ANSWERS": json.dumps(bad)})
    with pytest.raises(ValueError, match="not 'skip', 'reference', a JSON object, nor a file"):
        unattended.answers_given({"DDPKIT_ANSWERS": str(tmp_path / "nope.json")})
    with pytest.raises(ValueError, match="not valid JSON"):
        unattended.answers_given({"DDPKIT_ANSWERS": "{oops"})
    binary = tmp_path / "answers.bin"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(ValueError, match=r"answers.bin'?: not a JSON text file \(not UTF-8"):
        unattended.answers_given({"DDPKIT_ANSWERS": str(binary)})


def test_unattended_answers_are_kept_only_where_told(tmp_path, monkeypatch):
    monkeypatch.setenv(unattended.ANSWERS, json.dumps({"02.naive_bytes": 8}))
    monkeypatch.chdir(tmp_path)
    q = ask("02.naive_bytes", show=False)
    assert q.state == "answered" and q.source == "unattended"
    q.reveal(fake_trace())
    assert not (tmp_path / unattended.DEFAULT_LEDGER).exists()          # a CI run writes nothing
    monkeypatch.setenv(unattended.LEDGER, str(tmp_path / "ci.jsonl"))
    ask("02.naive_bytes", show=False).reveal(fake_trace())
    assert [e.source for e in read(tmp_path / "ci.jsonl")] == ["unattended"]
    monkeypatch.delenv(unattended.ANSWERS)
    monkeypatch.delenv(unattended.LEDGER)
    ask("02.naive_bytes", show=False).answer(8.0).reveal(fake_trace())   # a learner's: beside the notebook
    assert len(read(tmp_path / unattended.DEFAULT_LEDGER)) == 1


def test_the_committed_answers_answer_every_question():
    with open(os.path.join(REPO, "notebooks", "answers.json")) as f:
        table = json.load(f)
    answers = {k: v for k, v in table.items() if not k.startswith("_")}
    assert set(answers) == set(QUESTIONS)
    for key, value in answers.items():
        q = question(key)
        assert unattended.answer_for(q, q.setting, {"DDPKIT_ANSWERS": json.dumps({key: value})})[0] == "answer"


# --------------------------------------------------------------------------- references against runs
def recorded(cluster, *args, **kwargs):
    """The trace of one run of ``run_strategy`` recorded by the cluster."""
    from ddpkit.experiment import run_strategy

    with cluster.recording():
        cluster.run(run_strategy, *args, report_progress=False, **kwargs)
    return cluster.last_trace


def lands(key, *measured_by, **setting):
    q = question(key)
    s = q.settings(**setting)
    m = q.read(s, *measured_by)
    ref = q.reference(s)
    assert q.lands(ref, m.value), (key, ref, m.value)
    return m


@pytest.mark.slow
def test_byte_references_land_exactly(cluster_of):
    from ddpkit.trace import comm_bytes_per_step

    c2, c4 = cluster_of(2), cluster_of(4)
    m = lands("02.naive_bytes", recorded(c2, "naive", steps=1, warmup=0))
    assert m.value == S
    lands("03.bucketed_bytes", recorded(c2, "bucketed", steps=1, warmup=0, bucket_cap_mb=1.0))
    overlapped = recorded(c2, "overlapped", steps=1, warmup=0)
    ddp_sent = comm_bytes_per_step(overlapped)[overlapped.steps[-1]][0]
    kept = recorded(c2, "fsdp", steps=1, warmup=0, options={"reshard_after_forward": False})
    lands("05.no_reshard_bytes", kept, ddp_sent)
    at2 = recorded(c2, "overlapped", steps=1, warmup=0, bucket_cap_mb=1.0, global_batch_size=16)
    m = lands("11.bytes_growth", recorded(c4, "overlapped", steps=1, warmup=0, bucket_cap_mb=1.0,
                                          global_batch_size=16), at2)
    assert m.value == pytest.approx(1.5)
    m = lands("04.torch_buckets", recorded(c2, "torch_ddp", steps=2, warmup=1))
    assert m.value == 2 and m.terms[0].label.startswith("bucket 0: 1.0")


@pytest.mark.slow
def test_zero_and_hybrid_references_land_exactly(cluster_of):
    from ddpkit.compare import compare
    from ddpkit.experiment import run_strategy

    c2, c4 = cluster_of(2), cluster_of(4)
    zero1, ddp = (c2.run(run_strategy, s, steps=1, optimizer="adamw", record=True, report_progress=False)
                  for s in ("zero1", "overlapped"))
    m = lands("05.zero1_state_share", zero1, ddp)
    assert m.value == pytest.approx(0.75)
    q6 = question("06.torch_zero_bytes")
    records = compare(c2, ["overlapped", "torch_zero"], model_kwargs=q6.setting.model_kwargs, steps=1, rounds=1,
                      record_steps=1, optimizer="adamw", bucket_cap_mb=0.25)
    m = lands("06.torch_zero_bytes", records)          # and torch DDP's broadcast of its rebuilt bucket order
    assert m.value == pytest.approx(1.5, rel=1e-3) and "rebuilt bucket order" in m.terms[-1].label
    q9 = question("09.hsdp_cross_node_share")
    c4.network = ddpkit.Network("loopback", gpus_per_node=2)
    try:
        runs = {s: max(c4.run(run_strategy, s, steps=1, record=True, report_progress=False,
                              model_kwargs=q9.setting.model_kwargs), key=lambda r: r.inter_node_bytes_per_step)
                for s in ("hsdp", "fsdp")}
    finally:
        c4.network = None
    lands("09.hsdp_cross_node_share", runs["hsdp"], runs["fsdp"])


@pytest.mark.slow
def test_memory_of_your_own_model_and_a_parted_collective_land_exactly(cluster_of):
    from ddpkit.experiment import run_strategy
    from tests.hf_models import gpt2_tiny

    c2 = cluster_of(2)
    wl = gpt2_tiny()
    results = c2.run(run_strategy, "fsdp", workload=wl, steps=1, global_batch_size=8, record=True,
                     report_progress=False)
    m = lands("12.fsdp_state", [{"strategy": "fsdp", "memory": [r.memory for r in results]}], model=wl.build())
    assert any("tied head counted twice" in r.label for r in m.readings)

    def log_on_rank_0():
        import torch
        import torch.distributed as dist

        grads = torch.ones(1000)
        loss = torch.tensor([1.0])
        if ddpkit.rank() == 0:
            dist.all_reduce(loss)
        dist.all_reduce(grads)

    with pytest.raises(ddpkit.DesyncError) as err:
        c2.run(log_on_rank_0)
    lands("10.parted_bytes", err.value)


@pytest.mark.slow
def test_a_collective_time_lands_within_the_tolerance(cluster_of):
    """01: one all-reduce of 4 MiB against 64 of 64 KiB; the reference: the alpha-beta line fitted to the
    medians of the same calls (as the notebook fits it), held to the calls' middle half."""
    from ddpkit import costmodel

    c2 = cluster_of(2)
    sizes = (4 * 1024, 64 * 1024, 1 * MiB, 4 * MiB)
    calls = [[] for _ in sizes]
    for _ in range(5):
        timings = costmodel.slowest_rank(c2.run(costmodel.measure_collectives, ("all_reduce",), sizes))["all_reduce"]
        for i, (_, t) in enumerate(timings):
            calls[i].append(t)
    fit = costmodel.fit_link([(s, statistics.median(c)) for s, c in zip(sizes, calls, strict=True)], 2)
    q = question("01.one_vs_many")
    m = q.read(q.setting, list(sizes), calls, fit.alpha, fit.beta)
    assert q.lands(m.reference, m.value, m.spread), ("01.one_vs_many", m.reference, m.value, m.spread)
    assert m.value > 1, "one big all-reduce beats 64 small ones"
    assert m.terms[1].value == pytest.approx(0.0, abs=1e-9), "the same bytes either way"


def accumulate(every, iterations=8):
    """ms per iteration of OverlappedDDP (1 MiB buckets, the course's MLP) synchronising every
    ``every`` iterations, as notebook 08 times it."""
    import contextlib
    import time

    import torch

    from ddpkit.experiment import local_batch
    from ddpkit.models import build_model, loss_fn

    module = build_model("mlp", seed=0)
    model = ddpkit.OverlappedDDP(module, bucket_cap_mb=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for i in range(iterations + 1):
        x, y = local_batch(module, 32, i, ddpkit.rank(), ddpkit.world_size())
        sync = (i + 1) % every == 0
        t0 = time.perf_counter()
        with contextlib.nullcontext() if sync else model.no_sync():
            loss_fn(model(x), y).backward()
        if sync:
            opt.step()
            opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return 1e3 * sum(times[1:]) / iterations


def validated(cluster, runs, bucket_cap_mb, rounds=3):
    from ddpkit.costmodel.validate import validate

    records, _, profile = validate(cluster, runs, steps=3, rounds=rounds, bucket_cap_mb=bucket_cap_mb)
    assert not [r for r in records if "error" in r], records
    return {r["strategy"]: r for r in records}, profile


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_step_times_land_within_the_cost_models_tolerance(cluster_of):
    """03, 04, 08 on the "paper" network, 07 on 1 GbE at 4 ranks: each question's reference (the
    alpha-beta formulas from a measured time; the cost model, ``validate``: calibrated, profiled on
    the ranks) against the same rounds' measurements, known to within their rounds' spread."""
    c2 = cluster_of(2)
    c2.network = "paper"
    try:
        at1, _ = validated(c2, {"bucketed": ("bucketed", {}), "overlapped": ("overlapped", {})}, 1.0)
        at0, _ = validated(c2, {"bucketed": ("bucketed", {})}, 0)
        per_iteration = {every: [max(c2.run(accumulate, every)) for _ in range(3)] for every in (1, 8)}
    finally:
        c2.network = None
    seen = {}

    def check(key, *measured_by):
        q = question(key)
        m = q.read(q.setting, *measured_by)
        seen[key] = (m.reference, m.value, m.spread)
        return q.lands(m.reference, m.value, m.spread)

    sweep = {("bucketed", 1): at1["bucketed"]["measured_ms_rounds"],
             ("bucketed", 0): at0["bucketed"]["measured_ms_rounds"]}
    assert check("03.cap1_vs_cap0", sweep), seen
    assert seen["03.cap1_vs_cap0"][0] > 1, "the formulas: 66 messages cost more than 8"
    rounds = {s: at1[s]["measured_ms_rounds"] for s in ("overlapped", "bucketed")}
    parts = {s: dict(compute=0.0, exposed_comm=0.0, straggler_wait=0.0, host=0.0) for s in rounds}
    assert check("04.overlapped_vs_bucketed", rounds, parts, {s: at1[s]["predicted_ms"] for s in rounds}), seen
    assert check("08.every8_vs_every1", per_iteration), seen
    assert seen["08.every8_vs_every1"][0] > 1, "the formulas: skipping 7 in 8 synchronisations is faster"

    c4 = cluster_of(4)
    c4.network = "1GbE"
    try:
        at4, _ = validated(c4, ["overlapped", "fsdp"], 1.0, rounds=2)
    finally:
        c4.network = None
    assert check("07.overlapped_vs_fsdp", list(at4.values())), seen
    m = question("07.overlapped_vs_fsdp").read(question("07.overlapped_vs_fsdp").setting, list(at4.values()))
    assert m.reference > 1 and math.isclose(sum(t.value for t in m.terms), m.times["fsdp"] - m.times["overlapped"],
                                             abs_tol=1e-6)
    print(seen)
