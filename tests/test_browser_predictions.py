"""Predict, then measure, in a real JupyterLab (headless Chromium): a learner who runs the notebook
with Run All, as most do, still predicts before seeing a number, and gets each reveal against that
run's measurement, without running a cell again.

    pytest -m browser tests/test_browser_predictions.py

A scratch notebook (a temporary folder, nothing written into the checkout): two questions, each
with its measuring cell (which prints its number, as the course's do) and its reveal, and a last
cell that shuts the cluster down. Run All runs every cell before anyone answers: the measuring
cells' output is held back, each reveal waits, and no form says a number. The learner then answers
in the forms (a number; which is faster, and how many times): the held output appears, and the
reveal, in the form and under its cell, scored against the number that cell printed. Both answers
reach the ledger beside the notebook. Screenshots go to the test's temporary folder (``--basetemp``
to keep them where you look).
"""
from __future__ import annotations

import json
import os
import re

import pytest

from browser import open_notebook, scratch_lab, wait_notebook_idle, wait_until

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(420)]

CELLS = [
    "import ddpkit\ncluster = ddpkit.Cluster(world_size=2)",
    'q = ddpkit.ask("02.naive_bytes")',
    '''from ddpkit.experiment import run_strategy
from ddpkit.trace import comm_bytes_per_step
with cluster.recording():
    cluster.run(run_strategy, "naive", steps=1, warmup=0, report_progress=False)
trace = cluster.last_trace
print(f"MEASURED {comm_bytes_per_step(trace)[trace.steps[-1]][0] / 2**20:.2f} MiB")''',
    "q.reveal(trace)",
    'q2 = ddpkit.ask("01.one_vs_many")',
    '''import statistics
from ddpkit import costmodel
sizes = [4 * 1024, 64 * 1024, 1024 * 1024, 4 * 1024 * 1024]
calls = [[] for _ in sizes]
for _ in range(3):
    timed = costmodel.slowest_rank(cluster.run(costmodel.measure_collectives, ("all_reduce",), sizes))["all_reduce"]
    for c, (_, t) in zip(calls, timed):
        c.append(t)
fit = costmodel.fit_link([(s, statistics.median(c)) for s, c in zip(sizes, calls)], 2)
print(f"TIMED 4 MiB {1e3 * statistics.median(calls[3]):.3f} ms, 64 KiB {1e3 * statistics.median(calls[1]):.3f} ms")''',
    "q2.reveal(sizes, calls, fit.alpha, fit.beta)",
    "cluster.shutdown()",
]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    # the learner types the answers: none taken from the environment, kept in the notebook's folder
    saved = {k: os.environ.pop(k, None) for k in ("DDPKIT_ANSWERS", "DDPKIT_LEDGER")}
    try:
        with scratch_lab(tmp_path_factory, "predict.ipynb", CELLS) as lab:
            yield lab
    finally:
        os.environ.update({k: v for k, v in saved.items() if v is not None})


def cell(page, i):
    return page.locator(".jp-Notebook .jp-CodeCell").nth(i)


def visible_text(page, i) -> str:
    """What the learner sees of cell ``i``'s output (hidden output is not in innerText)."""
    return cell(page, i).locator(".jp-Cell-outputArea").first.inner_text()


def test_run_all_then_answer_and_reveal_against_this_run(lab, tmp_path):
    server, browser, root = lab
    page = open_notebook(browser, server, "scratch/predict.ipynb", height=1600)
    try:
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        state = wait_notebook_idle(page, 300, "Run All", all_run=True)
        assert not state["errors"], state["errors"]

        # 1. everything ran, the cluster is shut down, and no number has been seen
        form = cell(page, 1).locator(".ddpkit-ask")
        form.wait_for(state="visible", timeout=30_000)
        assert "held back until you answer" in form.locator(".ddpkit-ask-status").inner_text()
        for i in (2, 3, 5, 6, 7):
            seen = visible_text(page, i)
            assert "waits for your answer to 02.naive_bytes" in seen, (i, seen)
            assert "MEASURED" not in seen and "TIMED" not in seen and "Reveal." not in seen, (i, seen)
        assert "MiB" not in form.inner_text().split("Submit")[-1]           # the status line: no measurement
        page.screenshot(path=str(tmp_path / "run-all-waiting.png"), full_page=True)

        # 2. the learner answers: the held output and the reveal appear, against the number printed
        form.locator(".ddpkit-ask-value input").fill("4.02")
        form.locator(".ddpkit-ask-submit").click()
        shown = form.locator(".ddpkit-ask-reveal .ddpkit-reveal")
        shown.wait_for(state="visible", timeout=60_000)
        printed = wait_until(lambda: re.search(r"MEASURED ([\d.]+) MiB", visible_text(page, 2)), 30,
                             "the measuring cell's held output to show")
        number = f"{float(printed.group(1)):.2f} MiB"
        text = shown.inner_text()
        assert "4.02 MiB" in text and number in text, text
        sentence = shown.locator(".ddpkit-reveal-sentence").inner_text()
        assert sentence.startswith("Your 4.02 MiB matches (N-1)/N x S: half a ring all-reduce"), sentence
        assert "66 all-reduces, together S = 8.04 MiB: 2(2-1)/2 x S" in sentence, sentence
        under = cell(page, 3).locator(".ddpkit-reveal")
        under.wait_for(state="visible", timeout=30_000)
        assert number in under.inner_text()
        assert form.locator(".ddpkit-ask-submit").is_disabled()
        assert "waits for your answer to 01.one_vs_many" in visible_text(page, 5)   # the next question still waits
        shown.screenshot(path=str(tmp_path / "reveal-in-the-form.png"))

        # 3. which is faster: pick one, type how many times; its reveal shows the rounds' spread
        form2 = cell(page, 4).locator(".ddpkit-ask")
        form2.locator(".ddpkit-ask-which button", has_text="64 of 64 KiB").click()
        form2.locator(".ddpkit-ask-by input").fill("1.5")
        form2.locator(".ddpkit-ask-submit").click()
        shown2 = form2.locator(".ddpkit-ask-reveal .ddpkit-reveal")
        shown2.wait_for(state="visible", timeout=60_000)
        text2 = shown2.inner_text()
        assert "64 of 64 KiB 1.5x faster" in text2 and "its rounds" in text2, text2
        assert "TIMED" in visible_text(page, 5) and "%" not in text2.split("Measured:")[0], text2
        sentence2 = shown2.locator(".ddpkit-reveal-sentence").inner_text()
        assert "you said 64 of 64 KiB 1.5x faster" in sentence2, sentence2
        assert "63 more all-reduces' latency" in sentence2, sentence2
        shown2.screenshot(path=str(tmp_path / "reveal-faster.png"))
        page.screenshot(path=str(tmp_path / "run-all-answered.png"), full_page=True)

        entries = [json.loads(line) for line in (root / "scratch" / "predictions.jsonl").read_text().splitlines()]
        assert [(e["question"], e["source"], e["options"]) for e in entries] == [
            ("02.naive_bytes", "typed", []), ("01.one_vs_many", "typed", ["one of 4 MiB", "64 of 64 KiB"])]
        assert entries[1]["prediction"] == pytest.approx(1 / 1.5)
    finally:
        page.close()
