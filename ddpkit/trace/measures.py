"""Numbers measured from records: bytes on the wire, collectives per step, and how much of the
communication backward hid (overlap).

Pure functions of the records (a Trace, a Recorder or a list of Records): nothing here times,
draws or communicates. Bytes on the wire follow the ring algorithms (``ring_bytes``, from
``ddpkit.network``, where what a link costs lives). The figures the plots draw are built from
these in ``figures.py``.
"""
from __future__ import annotations

from collections import Counter, defaultdict

from ddpkit.network import ring_bytes
from ddpkit.trace.intervals import intersect, length, union
from ddpkit.trace.records import as_trace


def _by_step(d: dict):
    """Items of a {step: ...} dict, setup (None) first, then steps in order."""
    return sorted(d.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0))


def comm_bytes_per_step(trace, link: str | None = None) -> dict[int, dict[int, float]]:
    """``{step: {rank: bytes sent by that rank}}`` by the ring formulas (``ring_bytes``; None = setup).

    A collective over a subgroup (hybrid sharding) counts at its group's size, where ddpkit's
    process group recorded it; ``link`` ("inter-node", "intra-node") keeps only that link's."""
    trace = as_trace(trace)
    out: dict = defaultdict(lambda: defaultdict(float))
    for r in trace.records:
        if r.cat == "comm" and r.kind == "span" and (link is None or r.args.get("link") == link):
            out[r.step][r.rank] += ring_bytes(r.name, r.nbytes, r.args.get("group_size", trace.world_size))
    return {s: dict(v) for s, v in _by_step(out)}


def collective_counts(trace) -> dict[int, dict[int, dict[str, int]]]:
    """``{step: {rank: {collective name: count}}}``."""
    trace = as_trace(trace)
    out: dict = defaultdict(lambda: defaultdict(Counter))
    for r in trace.records:
        if r.cat == "comm" and r.kind == "span":
            out[r.step][r.rank][r.name] += 1
    return {s: {rank: dict(c) for rank, c in v.items()} for s, v in _by_step(out)}


def collective_bytes(trace) -> dict[int, dict[int, int]]:
    """``{step: {rank: sum of full sizes S}}`` (what the strategy handed to collectives)."""
    trace = as_trace(trace)
    out: dict = defaultdict(lambda: defaultdict(int))
    for r in trace.records:
        if r.cat == "comm" and r.kind == "span":
            out[r.step][r.rank] += r.nbytes
    return {s: dict(v) for s, v in _by_step(out)}


def overlap_intervals(records, rank: int, step: int, compute: str = "backward"):
    """(comm union, ``compute`` union, their intersection) for one rank and step, in ns.

    A backward span is cut at its last ``grad_ready`` (``backward_phases``): after it, it waits."""
    mine = [r for r in records if r.rank == rank and r.step == step]
    comm = union((r.start_ns, r.end_ns) for r in mine
                  if r.kind == "span" and r.cat == "comm" and r.end_ns is not None)
    ready = [r.start_ns for r in mine if r.kind == "instant" and r.cat == "grad_ready"]
    busy = []
    for r in mine:
        if r.kind == "span" and r.cat == "compute" and r.name == compute and r.end_ns is not None:
            inside = [t for t in ready if r.start_ns <= t <= r.end_ns]
            busy.append((r.start_ns, max(inside) if inside and compute == "backward" else r.end_ns))
    busy = union(busy)
    return comm, busy, intersect(comm, busy)


def comm_after_backward_ms(trace, rank: int = 0, step: int = -1) -> float:
    """Milliseconds of communication still going after backward's last gradient is ready (0: every
    collective finished under backward)."""
    trace = as_trace(trace)
    s = trace.resolve_step(step)
    comm, busy, _ = overlap_intervals(trace.records, rank, s)
    if not comm or not busy:
        return 0.0
    return max(0.0, comm[-1][1] - busy[-1][1]) / 1e6


def backward_phases(records, rank: int, step: int) -> tuple[list, list]:
    """(computing, waiting) intervals of one rank's backward in one step, in ns.

    Backward computes until its last ``grad_ready`` inside the span; the rest is waiting for
    communication (all computing without ``grad_ready`` records)."""
    _, busy, _ = overlap_intervals(records, rank, step)
    spans = union((r.start_ns, r.end_ns) for r in records
                   if r.rank == rank and r.step == step and r.kind == "span" and r.cat == "compute"
                   and r.name == "backward" and r.end_ns is not None)
    waiting = []
    for a, b in spans:
        inside = [e for s, e in busy if a <= s <= b]
        cut = max(inside) if inside else b
        if cut < b:
            waiting.append((cut, b))
    return busy, waiting


def overlap_fraction(trace, rank: int | None = None, step: int | None = None,
                     compute: str = "backward", steps=None, ranks=None) -> float:
    """Share of communication time hidden under backward compute (0 = none, 1 = all).

    Communication time is the union of the collectives' launch -> completion intervals; hidden
    is its part inside backward's compute (``overlap_intervals``). Over all ranks and steps unless
    given (``rank``/``step``, ``ranks``/``steps``)."""
    trace = as_trace(trace)
    ranks = list(ranks) if ranks is not None else (trace.ranks if rank is None else [rank])
    if steps is not None:
        steps = [trace.resolve_step(s) for s in steps]
    else:
        steps = trace.steps if step is None else [trace.resolve_step(step)]
    total = hidden = 0
    for rk in ranks:
        for s in steps:
            comm, _, both = overlap_intervals(trace.records, rk, s, compute)
            total += length(comm)
            hidden += length(both)
    return hidden / total if total else 0.0
