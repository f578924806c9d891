"""What a view of the live plots is, and the frame every view draws from.

A ``View`` is one figure of the widget: its name, its tab (or a place beside the tabs), how it
draws a ``Frame``, the words it shows while it has nothing to draw, and whether a run opens on
its tab. ``live.VIEWS`` lists them; ``LivePlots`` builds a pane per view and redraws them all
from one frame, so nothing else in the widget names a particular view.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ddpkit.trace.records import Trace

NO_STEPS_YET = "No steps recorded yet."
NO_STEPS = "This run recorded no training steps (records made before the first step only)."


@dataclass(frozen=True)
class Frame:
    """One moment of a recorded run: live (the last whole steps as they stream in) or replayed
    (the step the slider picks)."""

    live: bool
    records: Trace        # live: the window of the last few steps; replayed: the step's records only
    rank: int             # the rank the dropdown picks
    step: int | None      # the step drawn in full: ``rank``'s newest whole one live, or the replayed one
    steps: list[int]      # the steps drawn side by side (live: the last whole ones)
    ranks: list[int]      # the ranks drawn side by side
    memory: dict          # {rank: ddpkit.trace.memory_series points}
    t0: int               # ns: when the run's first record started
    peak: tuple | None    # ddpkit.trace.peak_of(memory)
    losses: dict          # {step: mean loss over the ranks}
    marker: int | None    # the replayed step, marked on the whole-run views; None while live


@dataclass(frozen=True)
class View:
    """One figure of the widget, drawn in its own pane (CSS class ``ddpkit-<name>-view``)."""

    name: str
    title: str | None     # its tab's title; None: drawn beside the tabs
    figure: Callable[[Frame, str], str]  # HTML of the frame; the str is the words to show if it is empty
    pending: str          # those words while a run streams in (what is coming, not "not recorded")
    missing: str          # ... and after it (what the run did not record)
    opens: Callable[[list], bool] = lambda records: False  # open this tab for a run with these records?

    def draw(self, frame: Frame) -> str:
        return self.figure(frame, self.pending if frame.live else self.missing)
