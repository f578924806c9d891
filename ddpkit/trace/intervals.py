"""Time as sets of intervals: ``[(start_ns, end_ns), ...]``, sorted and disjoint once ``union`` made them so.

What the overlap measures (``measures``) and the scaling gap's partition (``gap``) compute with:
how long a rank computed, communicated, or did both at once.
"""
from __future__ import annotations


def union(intervals) -> list[tuple[int, int]]:
    """The intervals merged: sorted, disjoint, overlapping or touching ones joined."""
    merged: list[list[int]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def length(intervals) -> int:
    """The time the intervals cover (disjoint ones: ``union`` first)."""
    return sum(b - a for a, b in intervals)


def intersect(xs, ys) -> list[tuple[int, int]]:
    """Intersection of two sorted, disjoint interval lists."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def minus(xs, ys) -> list[tuple[int, int]]:
    """``xs`` without ``ys`` (both sorted, disjoint interval lists)."""
    out, j = [], 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            if ys[k][0] > a:
                out.append((a, ys[k][0]))
            a = max(a, ys[k][1])
            k += 1
        if a < b:
            out.append((a, b))
    return out


def clip(intervals, a: int, b: int) -> list[tuple[int, int]]:
    """The parts of the intervals inside ``[a, b)``."""
    return [(max(x, a), min(y, b)) for x, y in intervals if min(y, b) > max(x, a)]


__all__ = ["clip", "intersect", "length", "minus", "union"]
