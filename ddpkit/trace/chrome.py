"""Chrome trace JSON of a Trace, for Perfetto (ui.perfetto.dev) and chrome://tracing.

    to_chrome_trace(trace, "trace.json")

One process per rank, one thread per lane (``LANES``); flow events (arrows) link the same
collective across ranks, from the rank that launched it last to each of the others.
"""
from __future__ import annotations

import json
from collections import defaultdict

from ddpkit.trace.figures import packed_label
from ddpkit.trace.records import Record, as_trace

# Lanes become Chrome "threads" (tid) inside each rank's "process" (pid = rank).
LANES = {"compute": 0, "comm": 1, "buckets": 2}
_COMM_EXTRA_TID = 10  # overlapping collectives go to extra comm lanes 10, 11, ...


def to_chrome_trace(trace, path=None) -> dict:
    """Chrome trace JSON (``traceEvents``) for Perfetto / chrome://tracing; written if ``path``.

    pid = rank; tid = lane: compute, comm (collectives in flight at once on extra lanes, as
    Chrome's "X" events must nest), buckets (gradient-ready instants). Memory samples are "C"
    counters; times in microseconds since the first record."""
    trace = as_trace(trace)
    t_zero = min((r.start_ns for r in trace.records), default=0)
    us = lambda ns: (ns - t_zero) / 1e3  # noqa: E731
    events: list[dict] = []
    placed: dict = {}  # id(collective record) -> its tid, for the flow events
    for rank in trace.ranks:
        events.append(dict(ph="M", name="process_name", pid=rank, tid=0, args={"name": f"rank {rank}"}))
        events.append(dict(ph="M", name="process_sort_index", pid=rank, tid=0, args={"sort_index": rank}))
        for lane, tid in LANES.items():
            name = packed_label(0) if lane == "comm" else lane  # "collectives", as on the widget
            events.append(dict(ph="M", name="thread_name", pid=rank, tid=tid, args={"name": name}))
            # the buckets lane goes last, so extra comm lanes ("2nd in flight", ...) sit under the first
            order = 100 if lane == "buckets" else tid
            events.append(dict(ph="M", name="thread_sort_index", pid=rank, tid=tid, args={"sort_index": order}))
        comm_lane_ends: list[int] = []  # end time of the last collective on each comm lane
        for r in sorted(trace.select(rank=rank), key=lambda r: r.start_ns):
            args = {"step": r.step, **_json_safe(r.args)}
            if r.kind == "span":
                if r.cat == "comm":
                    args.update(bytes=r.nbytes, bucket=r.bucket, unit=r.unit,
                                completed=r.end_ns is not None)
                    tid = _comm_tid(comm_lane_ends, r, events, rank)
                    placed[id(r)] = tid
                else:
                    tid = LANES.get(r.cat, LANES["compute"])
                end = r.end_ns if r.end_ns is not None else r.start_ns
                events.append(dict(ph="X", name=r.name, cat=r.cat, pid=rank, tid=tid,
                                   ts=us(r.start_ns), dur=(end - r.start_ns) / 1e3, args=args))
            elif r.kind == "instant":
                args.update(bucket=r.bucket)
                events.append(dict(ph="i", s="t", name=r.name, cat=r.cat, pid=rank,
                                   tid=LANES["buckets"], ts=us(r.start_ns), args=args))
            else:
                events.append(dict(ph="C", name=r.name, cat=r.cat, pid=rank, tid=0, ts=us(r.start_ns),
                                   args={k: v for k, v in r.args.items() if isinstance(v, (int, float))}))
    events += _flows(trace, placed, us)
    ranks = trace.ranks
    out = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        # as torch.profiler writes it (one rank per file there; a merged trace lists them all)
        "distributedInfo": {"backend": trace.backend, "rank": ranks[0] if ranks else 0,
                            "world_size": trace.world_size, "ranks": ranks},
    }
    if path is not None:
        with open(path, "w") as f:
            json.dump(out, f)
    return out


def same_collectives(trace) -> list[list[Record]]:
    """The collectives of a trace grouped across ranks, one group per collective: the k-th named N in
    step S (on group G) is the same on every rank. Groups of a single rank are left out."""
    keyed = defaultdict(list)
    for rank in trace.ranks:
        seen: dict = defaultdict(int)
        for r in sorted(trace.select(rank=rank, kind="span", cat="comm"), key=lambda r: r.start_ns):
            where = (r.step, r.name, str(r.args.get("group", "")))
            keyed[where + (seen[where],)].append(r)
            seen[where] += 1
    return [group for group in keyed.values() if len(group) > 1]


def _flows(trace, placed: dict, us) -> list[dict]:
    """Arrows from the last rank to launch each collective to every rank that waited for it."""
    out = []
    for i, group in enumerate(same_collectives(trace)):
        last = max(group, key=lambda r: r.start_ns)
        name = f"{last.name}: rank {last.rank} launched last"
        for r in group:
            if r is last:
                continue
            end = r.end_ns if r.end_ns is not None else r.start_ns
            at = min(max(last.start_ns, r.start_ns), end)  # inside r's slice: the arrow binds to it
            waited = max(0, last.start_ns - r.start_ns)
            out.append(dict(ph="s", id=i, name=name, cat="collective", pid=last.rank, tid=placed[id(last)],
                            ts=us(last.start_ns)))
            out.append(dict(ph="f", bp="e", id=i, name=name, cat="collective", pid=r.rank, tid=placed[id(r)],
                            ts=us(at), args={"waited_us": waited / 1e3}))
    return out


def _comm_tid(lane_ends: list, r: Record, events: list, rank: int) -> int:
    """The first comm lane free at r's launch (greedy interval colouring)."""
    end = r.end_ns if r.end_ns is not None else r.start_ns
    for i, last in enumerate(lane_ends):
        if last <= r.start_ns:
            lane_ends[i] = end
            return LANES["comm"] if i == 0 else _COMM_EXTRA_TID + i
    lane_ends.append(end)
    i = len(lane_ends) - 1
    if i == 0:
        return LANES["comm"]
    tid = _COMM_EXTRA_TID + i
    events.append(dict(ph="M", name="thread_name", pid=rank, tid=tid, args={"name": packed_label(i)}))
    events.append(dict(ph="M", name="thread_sort_index", pid=rank, tid=tid, args={"sort_index": 1 + i}))
    return tid


def _json_safe(d: dict) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v)) for k, v in d.items()}
