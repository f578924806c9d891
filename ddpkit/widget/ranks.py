"""One row per rank: its status, pid and device (and, after a desync, "desync at collective #k"),
then the tail of what it printed and, after a failure, its traceback in red.

Log lines arrive one observer call each (a chatty rank prints thousands); re-sending a rank's
whole log for every line would flood the page, so changed logs are sent at most every
``LOG_INTERVAL_S`` (``Throttle``).
"""
from __future__ import annotations

import html
import os
import threading

import ipywidgets as widgets
import torch

from ddpkit.widget.throttle import Throttle

LOG_INTERVAL_S = 0.1  # at most ~10 log updates per second per widget

# One colour per RankState.status, so a glance finds the rank that failed.
STATUS_COLOURS = {
    "starting": "#b8860b", "idle": "#2e7d32", "running": "#1565c0",
    "error": "#c62828", "dead": "#6a1b9a", "stopped": "#616161",
}

# Keeps the log box scrolled to its newest line without any JavaScript: a flex column in
# reverse order starts at the bottom (the inner div keeps the lines in reading order).
_LOG_STYLE = ("display:flex;flex-direction:column-reverse;max-height:12em;overflow:auto;"
              "margin:0;padding:2px 6px;background:#f7f7f7;border:1px solid #ddd;"
              "font-family:monospace;font-size:11px;line-height:1.3;white-space:pre-wrap")
_FAILED_ROW = "border-left:4px solid #c62828;background:#fdecea;padding-left:4px"


def _snapshot(lines) -> list[str]:
    """A copy of a deque another thread may append to (retried if it changed under us)."""
    for _ in range(10):
        try:
            return list(lines)
        except RuntimeError:  # "deque mutated during iteration"
            continue
    return []


_LIBRARIES = [os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__)]  # ddpkit's, torch's folders


def user_frames(tb: str) -> str:
    """A traceback without the frames inside ddpkit's and torch's own files (the cluster's runner,
    the process group, ...): the learner's code and the error, where a diagnosis says the rest."""
    kept, frame, dropped = [], None, 0
    for line in tb.splitlines():
        if line.startswith('  File "'):
            frame = any(f'"{d}{os.sep}' in line for d in _LIBRARIES)
            dropped += frame
            if frame:
                continue
        elif frame and line.startswith("    "):  # the frame's code line, its ^^^ markers
            continue
        else:
            frame = None
        kept.append(line)
    if dropped:
        kept.insert(1 if kept and kept[0].startswith("Traceback") else 0,
                    f"  ({dropped} frame{'s' if dropped != 1 else ''} inside ddpkit and torch left out)")
    return "\n".join(kept)


class RankRows(widgets.VBox):
    """The ranks' rows; ``refresh()`` redraws them from the cluster's ``RankState``s."""

    def __init__(self, cluster, log_lines: int = 200):
        super().__init__()
        self.cluster, self.log_lines = cluster, log_lines
        self.status: list[widgets.HTML] = []
        self.logs: list[widgets.HTML] = []
        self.errors: dict[int, str] = {}  # rank -> traceback, when the cluster sends one
        self.notes: dict[int, str] = {}   # rank -> a word on its failure, e.g. "desync at collective #7"
        self._dirty: set[int] = set()
        self._lock = threading.Lock()
        self._throttle = Throttle(self._flush, LOG_INTERVAL_S, name="ddpkit-widget-logs")

    def refresh(self) -> None:
        ranks = list(self.cluster.ranks)
        if len(self.status) != len(ranks):
            self.status = [widgets.HTML() for _ in ranks]
            self.logs = [widgets.HTML() for _ in ranks]
            for s in self.status:
                s.add_class("ddpkit-rank-status")
            for lg in self.logs:
                lg.add_class("ddpkit-rank-log")
            self.children = [w for pair in zip(self.status, self.logs, strict=True) for w in pair]
        for r in ranks:
            colour = STATUS_COLOURS.get(r.status, "black")
            where = f" &middot; pid {r.pid}" if r.pid and r.status != "stopped" else ""
            where += f" &middot; {html.escape(r.device)}" if r.device else ""
            note = self.notes.get(r.rank)
            failed = r.status in ("error", "dead") or r.rank in self.errors or note is not None
            note = (f" &middot; <span class='ddpkit-rank-note' style='color:{STATUS_COLOURS['error']};"
                    f"font-weight:bold'>{html.escape(note)}</span>" if note else "")
            self.status[r.rank].value = (
                f"<div class='ddpkit-rank-row{' ddpkit-failed' if failed else ''}' "
                f"style='{_FAILED_ROW if failed else ''}'><b>rank {r.rank}</b> <span class='ddpkit-status' "
                f"style='color:{colour};font-weight:bold'>{r.status}</span>{note}{where}</div>")
        self.flush_all()

    def changed(self, rank: int) -> None:
        """A rank printed a line: its log goes out with the next update."""
        with self._lock:
            self._dirty.add(rank)
        self._throttle.request()

    def flush_all(self) -> None:
        with self._lock:
            self._dirty = set(range(len(self.logs)))
        self._throttle.flush()

    def _flush(self) -> None:
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        ranks = self.cluster.ranks
        for rank in sorted(dirty):
            if rank >= len(self.logs) or rank >= len(ranks):
                continue
            lines = _snapshot(ranks[rank].log)[-self.log_lines:]
            text = html.escape("\n".join(lines))
            error = self.errors.get(rank)  # .get: the main thread may clear it meanwhile
            if error:
                tb = html.escape(user_frames(error.rstrip()))
                text += f"\n<span class='ddpkit-traceback' style='color:{STATUS_COLOURS['error']}'>{tb}</span>"
            self.logs[rank].value = f"<div style='{_LOG_STYLE}'><div>{text}</div></div>" if text else ""

    def close(self) -> None:
        self._throttle.close()
        super().close()
