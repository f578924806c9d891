"""Call a function at most once per interval, however often it is asked for.

The cluster tells the widget about every printed line, progress report and record batch; the
page needs far fewer updates than that. A request within ``interval_s`` of the last call is
coalesced into one call at the end of the interval, on a timer thread: nothing is lost (the
call reads the latest state), nothing floods the page.
"""
from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("ddpkit.widget")


class Throttle:
    """``request()`` calls ``fn`` now, or once at the end of the current interval.

    ``inline=False``: even the first call goes to the timer thread (for work too slow for the
    thread that asked, e.g. drawing). ``idle`` is set whenever no call is pending or running.
    """

    def __init__(self, fn, interval_s: float, inline: bool = True, name: str = "ddpkit-widget"):
        self.fn, self.interval_s, self.inline, self.name = fn, interval_s, inline, name
        self.calls = 0
        self.idle = threading.Event()
        self.idle.set()
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._last = 0.0
        self._closed = False

    def request(self) -> None:
        with self._lock:
            if self._closed or self._timer is not None:
                return  # a call is on its way and will see this change too
            self.idle.clear()
            wait = self._last + self.interval_s - time.monotonic()
            if wait > 0 or not self.inline:
                self._timer = threading.Timer(max(wait, 0.0), self._run)
                self._timer.daemon = True
                self._timer.name = self.name
                self._timer.start()
                return
            self._last = time.monotonic()
        self._call()

    def flush(self) -> None:
        """Call now (cancelling a pending call), e.g. at the end of a run."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self.idle.clear()
            self._last = time.monotonic()
        self._call()

    def _run(self) -> None:
        with self._lock:
            self._timer = None
            self._last = time.monotonic()
        self._call()

    def _call(self) -> None:
        try:
            self.calls += 1
            self.fn()
        except Exception:  # a drawing that fails must not kill the timer thread or a run
            log.exception("widget update failed")
        finally:
            with self._lock:
                if self._timer is None:
                    self.idle.set()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self.idle.set()
