"""A question that waits for its answer holds the notebook's numbers back, however it is run.

Under Run All the measuring cell runs long before anyone reads the question. So in a kernel every
cell run while a question waits sends its output into a hidden ``Output`` (``HeldCell``) and the
reveal is a placeholder (``PendingReveal``); the answer (or a skip) shows them, the reveal against
this run's measurement. A failing cell shows its output at once. One ``Watch`` per IPython shell.
"""
from __future__ import annotations

import html

from ddpkit.predictions.form import view_bundle

NOTE = "color:#555;font-style:italic"


def watch(shell, asked) -> None:
    """Follow ``asked`` in ``shell``: later cells held (or it locked) until answered; a newer ask takes over."""
    w = shell.__dict__.get("_ddpkit_watch")
    if w is None:
        w = shell.__dict__["_ddpkit_watch"] = Watch(shell)
    w.add(asked)


class Watch:
    def __init__(self, shell):
        self.shell = shell
        self.widgets = getattr(shell, "kernel", None) is not None
        self.asked: dict = {}           # the latest of each question, by key
        self.held: HeldCell | None = None
        shell.events.register("pre_run_cell", self.pre_run_cell)
        shell.events.register("post_run_cell", self.post_run_cell)

    def add(self, asked) -> None:
        asked.can_wait = self.widgets
        earlier = self.asked.get(asked.question.key)
        self.asked[asked.question.key] = asked
        if earlier is not None:
            earlier.hand_over(asked)

    def pre_run_cell(self, info=None) -> None:
        source = getattr(info, "raw_cell", "") or ""
        waiting = []
        for a in self.asked.values():
            if a.state == "waiting" and not a.locked:
                if not _asks_again(source, a):
                    waiting.append(a)
            else:
                a.measurement_started()      # an answer given: locked as the measurement begins
        if not waiting:
            return
        if not self.widgets:
            for a in waiting:
                message = a.measurement_started()
                if message:
                    print(message)
            return
        self.held = HeldCell(waiting)
        self.held.start()

    def post_run_cell(self, result=None) -> None:
        held, self.held = self.held, None
        if held is None:
            return
        held.stop()
        if result is not None and (result.error_in_exec is not None or result.error_before_exec is not None):
            held.release(failed=True)


def _asks_again(source: str, asked) -> bool:
    """The question's own cell, run again: it asks again (a newer question takes this one's place)."""
    return "ask(" in source and asked.question.key in source


class HeldCell:
    """One cell's output, kept in a hidden Output until every question it waits for is answered."""

    def __init__(self, waiting):
        import ipywidgets as w
        from IPython.display import display

        self.waiting = list(waiting)
        self.note = w.HTML()
        self.out = w.Output(layout=w.Layout(display="none"))
        self.box = w.VBox([self.note, self.out])
        self.box.add_class("ddpkit-held")
        self._say()
        display(view_bundle(self.box, f"[ddpkit] {self._words()} (where widgets render, it is held back until "
                                      "then)"), raw=True)
        for a in self.waiting:
            a.follow(self)

    def _words(self) -> str:
        keys = " and ".join(a.question.key for a in self.waiting if a.state == "waiting")
        return f"This cell's output waits for your answer to {keys} above (or a skip): it may show the measurement."

    def _say(self) -> None:
        self.note.value = f"<span style='{NOTE}'>{html.escape(self._words())}</span>"

    def start(self) -> None:
        self.out.__enter__()              # the front end routes this cell's output into self.out

    def stop(self) -> None:
        self.out.__exit__(None, None, None)

    def update(self, asked) -> None:
        if all(a.state != "waiting" for a in self.waiting):
            self.release()
        else:
            self._say()

    def switch(self, earlier, newer) -> None:
        self.waiting = [newer if a is earlier else a for a in self.waiting]
        newer.follow(self)

    def release(self, failed: bool = False) -> None:
        self.out.layout.display = None
        if failed:
            self.note.value = f"<span style='{NOTE}'>This cell failed: its output is shown at once.</span>"
        else:
            self.note.layout.display = "none"


class PendingReveal:
    """A question's reveal, run before its answer: a placeholder until then, the reveal after."""

    def __init__(self, asked):
        import ipywidgets as w

        self.html = w.HTML()
        self.html.add_class("ddpkit-pending")
        self.asked = asked
        self.update(asked)
        asked.follow(self)

    def update(self, asked) -> None:
        if asked is not self.asked:
            return
        if asked.revealed is not None:
            self.html.value = asked.reveal_html() + (
                f"<p style='color:#c44e52'>{html.escape(asked.keep_error)}</p>" if asked.keep_error else "")
        else:
            self.html.value = (f"<div class='ddpkit-reveal-waiting' style='{NOTE}'>The reveal of "
                               f"{html.escape(asked.question.key)} appears here, and in its form above, once you "
                               "answer it (or skip it): scored against the measurement this run made.</div>")

    def switch(self, earlier, newer) -> None:
        self.asked = newer
        newer.follow(self)
        self.update(newer)

    def text(self) -> str:
        key = self.asked.question.key
        if self.asked.revealed is not None:
            return self.asked.revealed.text()
        return (f"[ddpkit] The reveal of {key} waits for your answer: <this question>.answer(...) or .skip() in a "
                "cell prints it, scored against this run's measurement.")

    def _repr_mimebundle_(self, **kwargs):
        return view_bundle(self.html, self.text())
