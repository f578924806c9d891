"""What ``python -m ddpkit ledger`` prints and draws: one learner's ledger, or a class's.

    text, fig = report(["predictions.jsonl"])               # the learner's table, predicted vs measured
    text, fig = report(["ana.jsonl", "ben.jsonl", ...])      # one row per question, the class's misses
    fig.savefig(picture_path(paths))                         # beside the (first) ledger
"""
from __future__ import annotations

from pathlib import Path

from ddpkit.predictions.ledger import read, read_class
from ddpkit.predictions.tables import class_rows, class_table, learner_table, points
from ddpkit.predictions.unattended import DEFAULT_LEDGER


def default_ledger(here=None) -> Path:
    """``predictions.jsonl`` here or in ``notebooks/``; a FileNotFoundError saying where it looked."""
    here = Path.cwd() if here is None else Path(here)
    for path in (here / DEFAULT_LEDGER, here / "notebooks" / DEFAULT_LEDGER):
        if path.is_file():
            return path
    raise FileNotFoundError(f"no {DEFAULT_LEDGER} in {here} or {here / 'notebooks'}: name the ledger file(s), "
                            "e.g. python -m ddpkit ledger notebooks/predictions.jsonl")


def picture_path(paths) -> Path:
    """Beside the (first) ledger, named after it (``class_predictions.png`` for several)."""
    paths = [Path(p) for p in paths] or [default_ledger()]
    first = paths[0]
    return first.with_name("class_predictions.png" if len(paths) > 1 else f"{first.stem}.png")


def report(paths) -> tuple[str, object]:
    """(table, picture) for one learner's ledger or a class's (one file each); ValueError for a bad one."""
    from ddpkit.viz.predictions import plot_class, plot_ledger   # matplotlib: only to draw

    paths = [Path(p) for p in paths] or [default_ledger()]
    if len(paths) == 1:
        entries = read(paths[0])
        if not entries:
            raise ValueError(f"{paths[0]} holds no answers yet")
        return f"{paths[0]}:\n{learner_table(entries)}", plot_ledger(points(entries))
    ledgers = read_class(paths)
    rows = class_rows(ledgers)
    if not rows:
        raise ValueError(f"none of the {len(paths)} ledgers holds an answer")
    return f"{len(ledgers)} learners:\n{class_table(rows)}", plot_class(rows)
