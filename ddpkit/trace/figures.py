"""Figures derived from records, each computed once for every view that draws it: the bucket
fill order, the timeline, memory over time and its peak, the loss.

Pure functions of the records; ``ddpkit.viz`` and ``ddpkit.widget`` both draw what they return:

    bucket_fill(trace, rank, step)     # the bucket fill figure: ready order by layer, collectives
    timeline(trace, steps, ranks)      # per rank: compute, backward computing / waiting, comm rows
    memory_series(records, rank)       # memory over time (memory_peak / peak_of: its peak)
    loss_per_step(records)             # the loss curve

The numbers beside them (bytes, counts, overlap) are in ``measures.py``.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ddpkit.trace.measures import backward_phases, overlap_fraction, overlap_intervals
from ddpkit.trace.records import Record, as_trace


def bucket_fill_order(trace, rank: int = 0, step: int = -1) -> list[tuple[str, int | None, int]]:
    """``[(parameter name, bucket, time ns)]`` in the order the gradients became ready (a bucket
    unknown to the hook, as torch DDP's, from the collective whose ``params`` name it)."""
    trace = as_trace(trace)
    ready = trace.select(rank=rank, step=step, kind="instant", cat="grad_ready")
    bucket_of = {name: r.bucket for r in trace.select(rank=rank, step=step, kind="span", cat="comm")
                 for name in r.args.get("params", ())}
    return [(r.name, r.bucket if r.bucket is not None else bucket_of.get(r.name), r.start_ns)
            for r in sorted(ready, key=lambda r: r.start_ns)]


def launch_order(trace, rank: int = 0, step: int = -1, name: str | None = None) -> list[Record]:
    """This rank's collectives in one step, in launch order."""
    trace = as_trace(trace)
    comm = trace.select(rank=rank, step=step, kind="span", cat="comm", name=name)
    return sorted(comm, key=lambda r: r.start_ns)


def layer_of(param_name: str) -> str:
    """The module a parameter belongs to: "layers.3.0.weight" -> "layers.3.0", "head.bias" -> "head"."""
    return param_name.rsplit(".", 1)[0] if "." in param_name else param_name


def fill_rows(ready: list[tuple[str, int | None, int]], max_rows: int = 40) -> list[tuple[str, list]]:
    """``bucket_fill_order``'s gradients grouped by layer, in ready order: ``[(label, [(name, bucket,
    ns), ...])]``; past ``max_rows``, neighbours merge ("layers.31.0 .. layers.28.0")."""
    rows: dict[str, list] = {}
    for item in ready:
        rows.setdefault(layer_of(item[0]), []).append(item)
    items = list(rows.items())
    per = -(-len(items) // max_rows) if items else 1
    if per == 1:
        return items
    out = []
    for i in range(0, len(items), per):
        chunk = items[i:i + per]
        label = chunk[0][0] if len(chunk) == 1 else f"{chunk[0][0]} .. {chunk[-1][0]}"
        out.append((label, [g for _, group in chunk for g in group]))
    return out


FILL_ROWS = 36        # bucket fill: more layers than this are merged, neighbours together
FILL_COMM_ROWS = 16   # bucket fill: more buckets' (units') collectives than this share packed rows
TIMELINE_BUCKET_ROWS = 8  # timeline: a row per bucket up to this many, else packed rows ...
TIMELINE_PACKED_ROWS = 4  # ... at most this many


@dataclass
class BucketFill:
    """One rank's step as the bucket fill figure shows it (``bucket_fill``); every view draws this."""

    rank: int
    step: int
    ready: list       # bucket_fill_order: [(parameter, bucket, ns)] in the order they became ready
    rows: list        # those by layer (fill_rows): [(label, [(parameter, bucket, ns), ...])]
    comm: list        # the step's collectives, in launch order (launch_order)
    comm_rows: list   # [(label, [Record])]: a row per bucket's (or unit's) collective, or packed rows
    computing: list   # backward computing [(start, end)] ns, then waiting for communication
    waiting: list     # after its last gradient was ready (backward_phases)

    @property
    def buckets(self) -> list[int]:
        """The buckets the gradients and collectives name."""
        named = {b for _, b, _ in self.ready} | {r.bucket for r in self.comm}
        return sorted(b for b in named if b is not None)

    @property
    def t0(self) -> int | None:
        """Where the figure's time axis starts: backward, the first gradient or collective."""
        return min([a for a, _ in self.computing] + [t for _, _, t in self.ready] + [r.start_ns for r in self.comm],
                   default=None)

    @property
    def t1(self) -> int | None:
        return max([t for _, _, t in self.ready] + [r.end_ns or r.start_ns for r in self.comm]
                   + [b for _, b in self.computing + self.waiting], default=None)

    @property
    def origin(self) -> str:
        """What the time axis counts from, in words: "backward started", or, where a collective
        came first (FSDP's all-gathers in forward), "the step's first collective launched"."""
        t0 = self.t0
        if self.computing and self.computing[0][0] == t0:
            return "backward started"
        if self.comm and self.comm[0].start_ns == t0:
            return "the step's first collective launched"
        return "the first gradient was ready"

    @property
    def packed(self) -> bool:
        """Are the collectives in packed rows (``PACKED_NOTE``), not a row per bucket's or unit's?"""
        return any(label == packed_label(0) for label, _ in self.comm_rows)


def bucket_fill(trace, rank: int = 0, step: int = -1, max_rows: int = FILL_ROWS) -> BucketFill:
    """The bucket fill figure of one rank's step (-1: the last): gradients ready by layer, coloured
    by bucket, each collective from launch to completion, backward computing then waiting."""
    trace = as_trace(trace)
    s = trace.resolve_step(step)
    comm = launch_order(trace, rank, s)
    mine = [r for r in trace.records if r.rank == rank and r.step == s]
    ready = bucket_fill_order(trace, rank, s)
    computing, waiting = backward_phases(mine, rank, s)
    return BucketFill(rank, s, ready, fill_rows(ready, max_rows), comm, comm_rows(comm, by_op=True), computing, waiting)


def comm_rows(comm, by_op: bool = False) -> list[tuple[str, list]]:
    """One rank's collectives in rows, ``[(label, [Record])]``, for both figures: while few, a row
    per bucket ("bucket 2") or, ``by_op``, per bucket's or unit's collective ("layers.0 all_gather");
    else packed rows (``pack_rows``)."""
    comm = sorted(comm, key=lambda r: r.start_ns)
    if by_op:
        key = lambda r: (r.bucket if r.bucket is not None else r.unit, r.name)  # noqa: E731
        keys = list(dict.fromkeys(map(key, comm)))  # in launch order
        fits = len(keys) <= FILL_COMM_ROWS
    else:
        key = lambda r: r.bucket  # noqa: E731
        keys = list(dict.fromkeys(map(key, comm)))
        fits = bool(comm) and None not in keys and len(keys) <= TIMELINE_BUCKET_ROWS
        keys = sorted(keys) if fits else keys
    if fits:
        return [(_row_label(k, by_op), [r for r in comm if key(r) == k]) for k in keys]
    if by_op:  # the title counts them all; a row's label says what the row is, not its own count
        return [(packed_label(i), row) for i, row in enumerate(pack_rows(comm))]
    rows = pack_rows(comm, TIMELINE_PACKED_ROWS)
    return [(packed_label(i, last=i == TIMELINE_PACKED_ROWS - 1), row) for i, row in enumerate(rows)]


PACKED_NOTE = "a row below holds the collectives launched while the rows above were still in flight"


def packed_label(i: int, last: bool = False) -> str:
    """A packed timeline row's label: "collectives", then "2nd in flight", ...; ``last``: the rest."""
    if i == 0:
        return "collectives"
    nth = {1: "2nd", 2: "3rd"}.get(i, f"{i + 1}th")
    return f"{nth}{'+' if last else ''} in flight"


def _row_label(key, by_op: bool) -> str:
    """"bucket 2" (a bucket's row); by op: "bucket 2 all_reduce", "layers.0 all_gather", "all_reduce"."""
    if not by_op:
        return f"bucket {key}"
    which, name = key
    if which is None:
        return name
    return f"bucket {which} {name}" if isinstance(which, int) else f"{which} {name}"


def pack_rows(comm, max_rows: int | None = None) -> list[list]:
    """Collectives (sorted by launch) packed greedily into rows: each into the first row that is
    free when it launches; past ``max_rows`` rows the last row takes the rest."""
    rows: list[list] = []
    for r in comm:
        for row in rows:
            if (row[-1].end_ns or row[-1].start_ns) <= r.start_ns:
                row.append(r)
                break
        else:
            if max_rows is None or len(rows) < max_rows:
                rows.append([r])
            else:
                rows[-1].append(r)
    return rows


@dataclass
class RankLanes:
    """One rank in the timeline figure: its compute row and its collectives' rows."""

    rank: int
    spans: list       # finished spans other than backward and collectives: forward, sync, step, ...
    computing: list   # backward computing [(start, end, step)] ns (backward_phases) ...
    waiting: list     # ... then waiting for communication
    hidden: list      # communication hidden under backward computing [(start, end, step)]
    comm_rows: list   # comm_rows of its collectives: [(label, [Record])]


@dataclass
class Timeline:
    """Steps of every rank as the timeline figure shows them (``timeline``); every view draws this."""

    steps: list[int]
    lanes: list[RankLanes]
    overlap: float                # overlap_fraction over exactly these steps and ranks
    step_starts: dict[int, int]   # where each step's first span starts, on any rank
    t0: int | None                # the first span's start, the last one's end
    t1: int | None

    @property
    def packed(self) -> bool:
        """Are some rank's collectives in packed rows (``PACKED_NOTE``), not a row per bucket?"""
        return any(label == packed_label(0) for lane in self.lanes for label, _ in lane.comm_rows)


def timeline(trace, steps=None, ranks=None) -> Timeline:
    """The timeline of ``steps`` (None: all; -1 the last; a list) on ``ranks`` (None: all): compute,
    backward split where its computing ended, hidden communication, collectives in rows."""
    trace = as_trace(trace)
    ranks = trace.ranks if ranks is None else list(ranks)
    if steps is None:
        steps = trace.steps
    elif isinstance(steps, int):
        steps = [trace.resolve_step(steps)]
    else:  # a window of steps (the live widget's) may hold one no span of which has arrived yet
        steps = [trace.resolve_step(s) if s < 0 else s for s in steps]
    wanted = set(steps)
    records = [r for r in trace.records if r.step in wanted and r.rank in ranks]
    spans = [r for r in records if r.kind == "span"]
    lanes = []
    for rank in ranks:
        mine = [r for r in records if r.rank == rank]
        computing, waiting, hidden = [], [], []
        for s in steps:
            busy, wait = backward_phases(mine, rank, s)
            computing += [(a, b, s) for a, b in busy]
            waiting += [(a, b, s) for a, b in wait]
            hidden += [(a, b, s) for a, b in overlap_intervals(mine, rank, s)[2]]
        others = [r for r in mine if r.kind == "span" and r.cat != "comm" and r.name != "backward"
                  and r.end_ns is not None]
        lanes.append(RankLanes(rank, others, computing, waiting, hidden,
                               comm_rows([r for r in mine if r.kind == "span" and r.cat == "comm"])))
    starts: dict = {}
    for r in spans:
        starts[r.step] = min(starts.get(r.step, r.start_ns), r.start_ns)
    trained = set(trace.steps)
    overlap = overlap_fraction(trace, steps=[s for s in steps if s in trained], ranks=ranks)
    return Timeline(steps, lanes, overlap, {s: starts[s] for s in steps if s in starts},
                    min((r.start_ns for r in spans), default=None),
                    max((r.end_ns or r.start_ns for r in spans), default=None))


def memory_series(records, rank: int, held: dict | None = None) -> list[tuple[int, int | None, dict]]:
    """One rank's memory over time: ``[(ns, step, {category: bytes})]`` in time order.

    A sample sets the categories it names and keeps the others (so each point is everything the
    rank holds then); ``cuda_*`` figures are left out. ``held``: the last point of an earlier batch."""
    state: dict = dict(held or {})
    out = []
    for r in sorted((r for r in records if r.rank == rank and r.kind == "counter" and r.cat == "memory"),
                    key=lambda r: r.start_ns):
        state.update({k: v for k, v in r.args.items() if not k.startswith("cuda_")})
        out.append((r.start_ns, r.step, dict(state)))
    return out


def memory_peak(records, ranks=None) -> tuple[int, int, int | None, dict] | None:
    """The largest point of ``memory_series`` over ``ranks``: ``(rank, ns, step, {category: bytes})``."""
    ranks = sorted({r.rank for r in records}) if ranks is None else ranks
    return peak_of({rank: memory_series(records, rank) for rank in ranks})


def peak_of(series: dict[int, list]) -> tuple[int, int, int | None, dict] | None:
    """``memory_peak`` of ``{rank: memory_series(...)}``: the point holding the most bytes."""
    best = None
    for rank, points in series.items():
        for t, step, sample in points:
            if best is None or sum(sample.values()) > sum(best[3].values()):
                best = (rank, t, step, sample)
    return best


def loss_per_step(records) -> dict[int, float]:
    """``{step: loss}``, the mean over the ranks (with equal slices, the global batch's loss)."""
    sums: dict = defaultdict(lambda: [0.0, 0])
    for r in records:
        if r.kind == "counter" and r.cat == "loss" and r.step is not None:
            acc = sums[r.step]
            acc[0] += r.args["loss"]
            acc[1] += 1
    return {s: total / n for s, (total, n) in sorted(sums.items())}
