"""Is a process still there? For cleaning up what a process that died without cleaning left behind."""
from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """Is process ``pid`` still running (not gone, not a zombie waiting to be reaped)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return True  # no /proc (macOS): kill(pid, 0) is all we know
