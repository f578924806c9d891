"""The question as a form in JupyterLab (ipywidgets): an answer box, Submit, Skip, a status line
that follows the ``Ask``, and under Run All the reveal below it. The form only calls ``Ask.answer``
and ``Ask.skip``; its CSS classes (``ddpkit-ask``, ``-value``, ...) let a browser test find it.
"""
from __future__ import annotations

import html

MUTED = "color:#555"


def view_bundle(widget, text: str) -> dict:
    """What ``display(bundle, raw=True)`` shows for ``widget``: its view where widgets render, ``text``
    elsewhere. Built from the public ``model_id``, as ipywidgets 7 (no ``_repr_mimebundle_``: Colab's
    7.7.1) and 8 both build it themselves."""
    return {"text/plain": text, "application/vnd.jupyter.widget-view+json":
            {"version_major": 2, "version_minor": 0, "model_id": widget.model_id}}


def parse_number(text: str) -> float:
    """A typed answer: "8", "8.04", "1,024", "1.5x", "1.5 x"; a ValueError for anything else."""
    text = text.strip().rstrip("x×").strip().replace(",", "")
    if not text:
        raise ValueError("type a number first")
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"not a number: {text!r}") from None


def form(asked):
    """An ipywidgets box for ``asked`` (a ``ddpkit.predictions.asking.Ask``)."""
    import ipywidgets as w

    q = asked.question
    title = w.HTML(f"<b>Predict first.</b> {html.escape(q.words(asked.setting))} "
                   f"<i>({'which one, and how many times faster' if q.kind == 'faster' else q.unit})</i>")
    why = w.HTML(f"<span style='{MUTED}'>{html.escape(q.hint + ' ' if q.hint else '')}Write down why, then "
                 "answer: until you do, the cells below keep their output back, and your answer is kept in "
                 "predictions.jsonl beside the notebook.</span>")
    value = w.Text(placeholder=f"your answer, {q.unit}" if q.kind == "number" and q.unit != "x" else
                   "times, e.g. 1.5", layout=w.Layout(width="14em"))
    value.add_class("ddpkit-ask-by" if q.kind == "faster" else "ddpkit-ask-value")
    which = None
    if q.kind == "faster":
        which = w.ToggleButtons(options=list(q.options), value=None, description="faster:",
                                style={"button_width": "auto"})
        which.add_class("ddpkit-ask-which")
    submit = w.Button(description="Submit", button_style="primary")
    submit.add_class("ddpkit-ask-submit")
    skip = w.Button(description="Skip")
    skip.add_class("ddpkit-ask-skip")
    status = w.HTML()
    status.add_class("ddpkit-ask-status")
    shown = w.HTML()
    shown.add_class("ddpkit-ask-reveal")

    def say(text, error=False):
        colour = "#c44e52" if error else "#2c7a2c" if asked.state == "answered" else "#555"
        status.value = f"<span style='color:{colour}'>{html.escape(text)}</span>"

    def on_submit(_):
        try:
            number = parse_number(value.value)
            if q.kind == "faster":
                if which.value is None:
                    raise ValueError("pick which one is faster first")
                asked.answer(which.value, number, source="typed")
            else:
                asked.answer(number, source="typed")
        except (ValueError, RuntimeError) as exc:
            say(str(exc), error=True)

    def on_skip(_):
        try:
            asked.skip(source="typed")
        except RuntimeError as exc:
            say(str(exc), error=True)

    class Follow:
        def update(self, a):
            for widget in (value, submit, skip, which):
                if widget is not None:
                    widget.disabled = a.locked
            say(a.status(), error=a.keep_error is not None)
            if a.revealed is not None and a.revealed_on_answer and not shown.value:
                shown.value = a.reveal_html()

    submit.on_click(on_submit)
    skip.on_click(on_skip)
    follow = Follow()
    asked.follow(follow)
    follow.update(asked)
    rows = ([which] if which is not None else []) + [w.HBox([value, submit, skip])]
    box = w.VBox([title, why, *rows, status, shown])
    box.add_class("ddpkit-ask")
    return box
