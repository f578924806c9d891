"""Sizes in binary units (KiB, MiB, GiB) and counts with their noun: the one convention of the
notebooks, the CLI, the plots and the widget."""

from __future__ import annotations


def human_bytes(n: float, digits: int = 2) -> str:
    """``8.04 MiB``, ``1.00 KiB``, ``512 B``: the largest binary unit the size reaches."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{n:.0f} B"


def plural(n: int, word: str) -> str:
    """"1 bucket", "8 buckets": a count with its noun, never "1 buckets"."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
