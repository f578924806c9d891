"""The question as a form in JupyterLab (ipywidgets): a box to type the answer in, Submit, Skip, and
a status line that follows the ``Ask`` (answered, locked when the measuring cell runs, revealed).

The form only calls ``Ask.answer`` and ``Ask.skip`` and redraws from the ``Ask``'s state; CSS classes
(``ddpkit-ask``, ``-value``, ``-by``, ``-submit``, ``-skip``, ``-status``) let a browser test find it.
"""
from __future__ import annotations

import html

MUTED = "color:#555"


def form(asked):
    """An ipywidgets box for ``asked`` (a ``ddpkit.predictions.asking.Ask``)."""
    import ipywidgets as w

    q = asked.question
    title = w.HTML(f"<b>Predict first.</b> {html.escape(q.words(asked.setting))} "
                   f"<i>({'which, and by how many %' if q.kind == 'faster' else q.unit})</i>")
    why = w.HTML(f"<span style='{MUTED}'>{html.escape(q.hint + ' ' if q.hint else '')}"
                 "Write down why before you run the next cell.</span>")
    value = w.Text(placeholder=f"your answer, {q.unit}" if q.kind == "number" else "by how many %",
                   layout=w.Layout(width="14em"))
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

    def say(text, error=False):
        colour = "#c44e52" if error else "#2c7a2c" if asked.state == "answered" else "#555"
        status.value = f"<span style='color:{colour}'>{html.escape(text)}</span>"

    def on_submit(_):
        try:
            text = value.value.strip().rstrip("%").strip()
            if not text:
                raise ValueError("type a number first")
            number = float(text.replace(",", ""))
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

    def follow(a):
        for widget in (value, submit, skip, which):
            if widget is not None:
                widget.disabled = a.locked
        say(a.status())

    submit.on_click(on_submit)
    skip.on_click(on_skip)
    asked.on_change(follow)
    follow(asked)
    row = [which] if which is not None else []
    box = w.VBox([title, why, w.HBox(row + [value, submit, skip]), status])
    box.add_class("ddpkit-ask")
    return box
