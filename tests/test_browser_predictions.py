"""Predict, then measure, in a real JupyterLab (headless Chromium): what a learner does and reads.

    pytest -m browser tests/test_browser_predictions.py

In a scratch notebook (a temporary folder, nothing written into the checkout): the learner types a
prediction into the form and submits it, runs the measuring cell, then the reveal, and reads its
numbers and its sentence; for "which is faster" they pick an option and type a percentage. A
question left unanswered makes the measuring cell say so. Both typed answers reach the ledger
beside the notebook. Screenshots of the two reveals go to the test's temporary folder
(``--basetemp`` to keep them where you look).
"""
from __future__ import annotations

import json
import os

import pytest

from browser import add_and_run_cell, open_notebook, scratch_lab, wait_notebook_idle, wait_until

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]

SETUP = "import ddpkit\ncluster = ddpkit.Cluster(world_size=2)"

NAIVE = '''\
from ddpkit.experiment import run_strategy
with cluster.recording():
    cluster.run(run_strategy, "naive", steps=1, warmup=0, report_progress=False)
trace = cluster.last_trace'''

TIMINGS = '''\
from ddpkit import costmodel
sizes = [4 * 1024, 64 * 1024, 1024 * 1024, 4 * 1024 * 1024]
timed = costmodel.slowest_rank(cluster.run(costmodel.measure_collectives, ("all_reduce",), sizes))["all_reduce"]
measured = [t for _, t in timed]
fit = costmodel.fit_link(timed, 2)'''


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    # the learner types the answers: none taken from the environment, kept in the notebook's folder
    saved = {k: os.environ.pop(k, None) for k in ("DDPKIT_ANSWERS", "DDPKIT_LEDGER")}
    try:
        with scratch_lab(tmp_path_factory, "predict.ipynb", [SETUP]) as lab:
            yield lab
    finally:
        os.environ.update({k: v for k, v in saved.items() if v is not None})


def last_output(page) -> str:
    return page.locator(".jp-Notebook .jp-Cell").last.locator(".jp-OutputArea").inner_text()


def run(page, source: str, what: str, timeout: float = 120) -> None:
    add_and_run_cell(page, source)
    state = wait_notebook_idle(page, timeout, what, all_run=True)
    assert not state["errors"], state["errors"]


def test_a_prediction_typed_measured_and_revealed(lab, tmp_path):
    server, browser, root = lab
    page = open_notebook(browser, server, "scratch/predict.ipynb", height=1400)
    try:
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        wait_notebook_idle(page, 120, "starting the cluster", all_run=True)

        # 1. the question's form: type a number, submit; the status line says what was recorded
        run(page, 'q = ddpkit.ask("02.naive_bytes")', "asking")
        form = page.locator(".ddpkit-ask").last
        form.wait_for(state="visible", timeout=30_000)
        assert "How many bytes does each rank send per step with NaiveDDP on 2 ranks?" in form.inner_text()
        form.locator(".ddpkit-ask-value input").fill("4.02")
        form.locator(".ddpkit-ask-submit").click()
        wait_until(lambda: "your answer: 4.02 MiB" in form.locator(".ddpkit-ask-status").inner_text(), 20,
                   "the form to record the answer")

        # 2. the measuring cell locks it; the reveal reads the run
        run(page, NAIVE, "the measuring cell")
        wait_until(lambda: form.locator(".ddpkit-ask-submit").is_disabled(), 10, "the form to lock")
        run(page, "q.reveal(trace)", "the reveal")
        reveal = page.locator(".ddpkit-reveal").last
        reveal.wait_for(state="visible", timeout=30_000)
        text = reveal.inner_text()
        assert "4.02 MiB" in text and "8.04 MiB" in text and "-4.02 MiB" in text, text
        sentence = reveal.locator(".ddpkit-reveal-sentence").inner_text()
        assert sentence.startswith("Your 4.02 MiB matches (N-1)/N x S: half a ring all-reduce"), sentence
        assert "66 all-reduces of 8.04 MiB in all: 2(2-1)/2 x 8.04 MiB" in sentence, sentence
        assert reveal.locator("img").evaluate("img => img.naturalWidth") > 300
        reveal.screenshot(path=str(tmp_path / "reveal-bytes.png"))

        # 3. which is faster: pick one, type by how much; the reveal names the winner and the terms
        run(page, 'q2 = ddpkit.ask("01.one_vs_many")', "asking which is faster")
        form2 = page.locator(".ddpkit-ask").last
        form2.locator(".ddpkit-ask-which button", has_text="64 of 64 KiB").click()
        form2.locator(".ddpkit-ask-by input").fill("20")
        form2.locator(".ddpkit-ask-submit").click()
        wait_until(lambda: "64 of 64 KiB faster by 20%" in form2.locator(".ddpkit-ask-status").inner_text(), 20,
                   "the form to record the choice")
        run(page, TIMINGS, "timing all-reduces")
        run(page, "q2.reveal(sizes, measured, fit.alpha, fit.beta)", "the second reveal")
        reveal2 = page.locator(".ddpkit-reveal").last
        reveal2.wait_for(state="visible", timeout=30_000)
        sentence2 = reveal2.locator(".ddpkit-reveal-sentence").inner_text()
        assert "you said 64 of 64 KiB faster by 20%" in sentence2, sentence2
        assert "63 more latencies" in sentence2 and "the largest part: " in sentence2, sentence2
        reveal2.screenshot(path=str(tmp_path / "reveal-faster.png"))

        # 4. a question left unanswered: the measuring cell says so
        run(page, 'q3 = ddpkit.ask("03.bucketed_bytes")', "asking a third")
        run(page, "x = 1", "a cell run before the answer")
        assert "No prediction for the question above (03.bucketed_bytes)" in last_output(page)

        # the two typed answers are in the ledger beside the notebook
        entries = [json.loads(line) for line in (root / "scratch" / "predictions.jsonl").read_text().splitlines()]
        assert [(e["question"], e["prediction"], e["source"]) for e in entries] == [
            ("02.naive_bytes", 4.02, "typed"), ("01.one_vs_many", -20.0, "typed")]
        run(page, "cluster.shutdown()", "shutting down")
    finally:
        page.close()
