"""The ledger (``ddpkit.predictions.ledger``, ``tables``): nothing a learner answered is lost, nothing
that is not an answer is read as one, and the tables and pictures say what they mean.

- A learner's table names the winner of each "which is faster"; a class's table over three learners.
- An append after a cut-off line starts a fresh one; appends from two processes keep every line.
- A line that is not an entry (a field of the wrong type, NaN, a binary file) is one error naming the
  file and line, on the command line too (no traceback).
- Two learners of one name in two folders stay two; one question asked two ways in two ledgers is
  an error whatever the files' order.
- ``python -m ddpkit ledger`` draws its picture beside the ledger; the picture draws a right answer
  as right, on an axis whose labels do not run together.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import ddpkit
from ddpkit.predictions import class_rows, class_table, learner_table, question, read, read_class
from ddpkit.predictions import ledger as ledger_mod
from ddpkit.predictions.tables import points

REPO = os.path.dirname(os.path.dirname(os.path.abspath(ddpkit.__file__)))
S = 4 * 2107914 / 2**20

LEARNERS = {  # three made-up learners: their answers to three questions, against the same runs
    "ana": {"02.naive_bytes": 8.0, "05.zero1_state_share": 0.5, "04.overlapped_vs_bucketed": 1.2},
    "ben": {"02.naive_bytes": 16.0, "05.zero1_state_share": 0.75, "04.overlapped_vs_bucketed": 0.9},
    "cai": {"02.naive_bytes": 4.02, "05.zero1_state_share": 0.25, "04.overlapped_vs_bucketed": 1.6},
}
MEASURED = {"02.naive_bytes": S, "05.zero1_state_share": 0.75, "04.overlapped_vs_bucketed": 1.12}


def entry(key, prediction, measured, **changes) -> ledger_mod.Entry:
    q = question(key)
    faster = q.kind == "faster"
    e = ledger_mod.Entry(key, q.words(), q.unit, q.kind, q.quantity, "answered", prediction, measured,
                         prediction / measured if faster else prediction - measured,
                         (prediction > 1) == (measured > 1) if faster else None, None, 2,
                         "paper" if faster else "loopback", "Linux x86_64, 2 cores", "typed", ledger_mod.now(),
                         q.options)
    return ledger_mod.Entry(**{**e.__dict__, **changes})


def write_ledgers(folder) -> list:
    paths = []
    for name, answers in LEARNERS.items():
        path = folder / f"{name}.jsonl"
        for key, prediction in answers.items():
            ledger_mod.append(path, entry(key, prediction, MEASURED[key]))
        paths.append(path)
    return paths


def line(**changes) -> str:
    d = json.loads(json.dumps(entry("02.naive_bytes", 8.0, S).__dict__))
    return json.dumps({**d, **changes})


# --------------------------------------------------------------------------- the tables
def test_a_learners_table_names_the_winner_and_a_right_answer_is_close(tmp_path):
    path = write_ledgers(tmp_path)[0]
    ledger_mod.append(path, entry("11.bytes_growth", 1.5, 1.5))
    table = learner_table(read(path))
    assert "overlapped 1.2x faster" in table and "overlapped 1.12x faster" in table
    faster = next(r for r in table.splitlines() if r.startswith("04."))
    assert "%" not in faster and "x1.07" in faster            # a ratio, never a percentage of an unnamed base
    row = next(r for r in table.splitlines() if r.startswith("11.bytes_growth"))
    assert row.split()[1:4] == ["1.5x", "1.5x", "0"] and " yes " in row


def test_a_class_table_over_three_learners(tmp_path):
    rows = {r.question: r for r in class_rows(read_class(write_ledgers(tmp_path)))}
    naive = rows["02.naive_bytes"]
    assert naive.answered == naive.learners == 3 and naive.close == 1
    assert naive.median_miss == pytest.approx(8.0 / S - 1)
    faster = rows["04.overlapped_vs_bucketed"]
    assert faster.direction_right == 2 and faster.close == 1          # ana: 1.2 against 1.12
    assert faster.median_miss == pytest.approx(1.2 / 1.12)                # the middle factor
    table = class_table(list(rows.values()))
    assert "04.overlapped_vs_bucketed" in table and "2/3" in table and "x1.07" in table


# --------------------------------------------------------------------------- nothing lost
def test_an_answer_after_a_cut_off_line_starts_a_fresh_one(tmp_path):
    path = write_ledgers(tmp_path)[0]
    with open(path, "a") as f:
        f.write('{"question": "02.naive_bytes", "te')              # a write that died midway
    ledger_mod.append(path, entry("10.parted_bytes", 4000.0, 4000.0))
    lines = path.read_text().splitlines()
    assert lines[-2].endswith('"te') and json.loads(lines[-1])["question"] == "10.parted_bytes"
    with pytest.raises(ValueError, match=r"ana.jsonl, line 4: not a ledger entry"):
        read(path)                                                  # the cut-off line is named ...
    lines.pop(-2)
    path.write_text("\n".join(lines) + "\n")
    assert read(path)[-1].question == "10.parted_bytes"             # ... and the answer after it kept whole


APPENDER = """
import sys
from ddpkit.predictions import ledger
from tests.test_predictions_ledger import entry
path, who = sys.argv[1], float(sys.argv[2])
for i in range(3000):
    ledger.append(path, entry("10.parted_bytes", who, 4000.0 + i))
"""


@pytest.mark.timeout(300)
def test_two_processes_appending_at_once_keep_every_line(tmp_path):
    path = tmp_path / "shared.jsonl"
    env = dict(os.environ, PYTHONPATH=REPO)
    procs = [subprocess.Popen([sys.executable, "-c", APPENDER, str(path), str(who)], cwd=REPO, env=env)
             for who in (1.0, 2.0)]
    assert [p.wait(timeout=280) for p in procs] == [0, 0]
    entries = read(path)
    assert len(entries) == 6000
    for who in (1.0, 2.0):
        assert sorted(e.measurement for e in entries if e.prediction == who) == [4000.0 + i for i in range(3000)]


# --------------------------------------------------------------------------- nothing misread
BAD_LINES = {
    "NaN": (line().replace('"measurement": ' + json.dumps(S), '"measurement": NaN'), "NaN is not a number"),
    "world_size two": (line(world_size="two"), "world_size must be a whole number or null, got 'two'"),
    "measurement abc": (line(measurement="abc"), "measurement must be a finite number, got 'abc'"),
    "prediction list": (line(prediction=[1, 2]), r"prediction must be a finite number or null, got \[1, 2\]"),
    "unknown kind": (line(kind="guess"), "kind must be number or faster, got 'guess'"),
    "an earlier ddpkit's": (line(unit="%"), "a percentage for which is faster: a ledger of an earlier ddpkit"),
    "a list": ("[1, 2]", "a JSON object of 17 fields, got list"),
}


@pytest.mark.parametrize("name", BAD_LINES)
def test_a_line_that_is_not_an_entry_is_named(tmp_path, name):
    text, why = BAD_LINES[name]
    path = tmp_path / "ana.jsonl"
    path.write_text(line() + "\n" + text + "\n")
    with pytest.raises(ValueError, match=rf"ana.jsonl, line 2: not a ledger entry \({why}"):
        read(path)


def test_a_binary_file_is_named(tmp_path):
    path = tmp_path / "ana.jsonl"
    path.write_bytes(line().encode() + b"\n" + bytes(range(128, 256)) + b"\n")
    with pytest.raises(ValueError, match=r"ana.jsonl, line 2: not a ledger entry \(not UTF-8 text"):
        read(path)


def test_two_learners_of_one_name_stay_two(tmp_path):
    a, b = tmp_path / "a" / "class" / "ana.jsonl", tmp_path / "b" / "class" / "ana.jsonl"
    ledger_mod.append(a, entry("02.naive_bytes", 8.0, S))
    ledger_mod.append(b, entry("02.naive_bytes", 16.0, S))
    ledgers = read_class([a, b])
    assert sorted(ledgers) == ["a/class/ana", "b/class/ana"]
    assert class_rows(ledgers)[0].learners == 2
    with pytest.raises(ValueError, match="is named twice"):
        read_class([a, tmp_path / "a" / "class" / ".." / "class" / "ana.jsonl"])


def test_one_question_asked_two_ways_is_an_error_in_any_order(tmp_path):
    new, old = tmp_path / "new.jsonl", tmp_path / "old.jsonl"
    ledger_mod.append(new, entry("02.naive_bytes", 8.0, S))
    ledger_mod.append(old, entry("02.naive_bytes", 8.0 * 2**20, S * 2**20, unit="B"))
    for order in ([new, old], [old, new]):
        with pytest.raises(ValueError, match=r"02.naive_bytes is asked two ways in these ledgers "
                                             r"\(new: number in MiB; old: number in B\)"):
            class_rows(read_class(order))


# --------------------------------------------------------------------------- the command and the picture
def run(tmp_path, *args):
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "ddpkit", "ledger", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_ledger_command(tmp_path):
    folder = tmp_path / "class"
    folder.mkdir()
    paths = write_ledgers(folder)
    one = run(tmp_path, str(paths[0]))
    assert one.returncode == 0, one.stderr
    assert "02.naive_bytes" in one.stdout and "3 of 3 questions answered" in one.stdout
    assert (folder / "ana.png").stat().st_size > 1000 and not list(tmp_path.glob("*.png"))   # beside the ledger
    everyone = run(tmp_path, *map(str, paths), "--plot", str(tmp_path / "class.png"))
    assert everyone.returncode == 0, everyone.stderr
    assert "3 learners:" in everyone.stdout and "right winner" in everyone.stdout
    assert (tmp_path / "class.png").stat().st_size > 1000
    missing = run(tmp_path, "nobody.jsonl")
    assert missing.returncode == 2 and "no ledger at nobody.jsonl" in missing.stderr
    none_here = run(tmp_path)
    assert none_here.returncode == 2 and "no predictions.jsonl in" in none_here.stderr
    assert run(tmp_path, "--plot", "/nonexistent-dir/x.png", str(paths[0])).returncode == 2


def test_a_bad_ledger_on_the_command_line_is_one_line(tmp_path):
    path = tmp_path / "ana.jsonl"
    for text in (BAD_LINES["world_size two"][0], bytes(range(128, 256)).decode("latin-1")):
        path.write_bytes(text.encode("latin-1" if text[0] != "{" else "utf-8") + b"\n")
        res = run(tmp_path, str(path))
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert "ana.jsonl, line 1: not a ledger entry" in res.stderr.splitlines()[-1], res.stderr


def test_the_picture_draws_a_right_answer_as_right_on_readable_ticks(tmp_path):
    from matplotlib.colors import to_hex

    from ddpkit.viz import plot_ledger
    from ddpkit.viz.predictions import RIGHT, WRONG

    path = write_ledgers(tmp_path)[0]
    ledger_mod.append(path, entry("10.parted_bytes", 4000.0, 4000.0))     # exact
    ledger_mod.append(path, entry("11.bytes_growth", 0.0, 1.5))           # nothing: at the axis's edge
    drawn = points(read(path))
    fig = plot_ledger(drawn)
    ax = fig.axes[0]
    colours = [to_hex(c.get_facecolor()[0]) for c in ax.collections]
    by = dict(zip((p.label.split(":")[0] for p in drawn), colours, strict=True))
    assert by["10.parted_bytes"] == RIGHT and by["05.zero1_state_share"] == WRONG
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert "1x" in labels and all(t.endswith("x") for t in labels)
    assert not ax.xaxis.get_minor_ticks() or not any(t.label1.get_text() for t in ax.xaxis.get_minor_ticks())
    fig.savefig(tmp_path / "ledger.png")
