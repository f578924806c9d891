"""Figures derived from records: bytes on the wire, collective counts, overlap, fill and launch order.

Pure functions of the records (a Trace, a Recorder or a list of Records): nothing here times,
draws or communicates. Bytes on the wire follow the ring algorithms (``ring_bytes``, from
``ddpkit.network``, where what a link costs lives).
"""
from __future__ import annotations

from collections import Counter, defaultdict

from ddpkit.network import ring_bytes
from ddpkit.trace.records import Record, as_trace


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


def _union(intervals) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals) -> int:
    return sum(b - a for a, b in intervals)


def _intersect(xs, ys) -> list[tuple[int, int]]:
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


def overlap_intervals(records, rank: int, step: int, compute: str = "backward"):
    """(comm union, ``compute`` union, their intersection) for one rank and step, in ns.

    A backward span ends when ``loss.backward()`` returns, which for OverlappedDDP includes
    waiting for the last buckets (the wait runs in an end-of-backward callback). Waiting is
    not compute, so a backward span is cut at the last gradient that became ready inside it
    (the last ``grad_ready`` instant) when there are any: that is where autograd's work ended.
    """
    mine = [r for r in records if r.rank == rank and r.step == step]
    comm = _union((r.start_ns, r.end_ns) for r in mine
                  if r.kind == "span" and r.cat == "comm" and r.end_ns is not None)
    ready = [r.start_ns for r in mine if r.kind == "instant" and r.cat == "grad_ready"]
    busy = []
    for r in mine:
        if r.kind == "span" and r.cat == "compute" and r.name == compute and r.end_ns is not None:
            inside = [t for t in ready if r.start_ns <= t <= r.end_ns]
            busy.append((r.start_ns, max(inside) if inside and compute == "backward" else r.end_ns))
    busy = _union(busy)
    return comm, busy, _intersect(comm, busy)


def comm_after_backward_ms(trace, rank: int = 0, step: int = -1) -> float:
    """Milliseconds of communication still going when backward's compute has ended: what the step
    waits for after its last gradient is ready (0: every collective finished under backward). The
    overlap a strategy achieved, read off the trace rather than from step times."""
    trace = as_trace(trace)
    s = trace.resolve_step(step)
    comm, busy, _ = overlap_intervals(trace.records, rank, s)
    if not comm or not busy:
        return 0.0
    return max(0.0, comm[-1][1] - busy[-1][1]) / 1e6


def backward_phases(records, rank: int, step: int) -> tuple[list, list]:
    """(computing, waiting) intervals of one rank's backward in one step, in ns.

    Backward computes until its last gradient is ready (the last ``grad_ready`` inside the
    span); what remains of the span is waiting for communication (OverlappedDDP waits for its
    last buckets in an end-of-backward callback). Without ``grad_ready`` records it is all
    computing. ``overlap_intervals`` counts hidden communication against the same cut.
    """
    _, busy, _ = overlap_intervals(records, rank, step)
    spans = _union((r.start_ns, r.end_ns) for r in records
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

    Communication time is the union of every collective's launch -> completion interval
    (several may be in flight at once); hidden time is the part of it inside backward's
    compute (see ``overlap_intervals``). Over all ranks and training steps unless given
    (``rank``/``step`` one of each, ``ranks``/``steps`` several): a plot and a printout that
    pass the same steps get the same number.
    """
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
            total += _length(comm)
            hidden += _length(both)
    return hidden / total if total else 0.0


def bucket_fill_order(trace, rank: int = 0, step: int = -1) -> list[tuple[str, int | None, int]]:
    """``[(parameter name, bucket, time ns)]`` in the order the gradients became ready.

    A gradient whose hook did not know its bucket (torch DDP's: the reducer decides, and rebuilds
    its buckets after the first step) takes it from the step's collective whose ``params`` name
    it (``TorchDDP`` labels each bucket's all-reduce so while recording)."""
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
    """``bucket_fill_order``'s gradients grouped by layer, in the order the layers' first
    gradients became ready: ``[(label, [(name, bucket, ns), ...]), ...]``. More than ``max_rows``
    layers are merged, neighbours together ("layers.31.0 .. layers.28.0"), so 66 gradients
    (or 660) stay readable on one screen."""
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


def memory_series(records, rank: int) -> list[tuple[int, int | None, dict]]:
    """One rank's memory over time: ``[(ns, step, {category: bytes})]`` in time order.

    A sample sets the categories it names and leaves the others as the last sample set them
    (a strategy may report one category, e.g. FSDP its unsharded parameters), so each point is
    everything the rank holds then. The allocator's own ``cuda_*`` figures are left out.
    """
    state: dict = {}
    out = []
    for r in sorted((r for r in records if r.rank == rank and r.kind == "counter" and r.cat == "memory"),
                    key=lambda r: r.start_ns):
        state.update({k: v for k, v in r.args.items() if not k.startswith("cuda_")})
        out.append((r.start_ns, r.step, dict(state)))
    return out


def memory_peak(records, ranks=None) -> tuple[int, int, int | None, dict] | None:
    """The largest point of ``memory_series`` over ``ranks`` (default all): ``(rank, ns, step,
    {category: bytes})``, i.e. the peak and what was live at it; None without memory samples."""
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
    """``{step: loss}``, the mean over the ranks that reported one (each rank's loss is the mean
    over its slice of the global batch, so with equal slices this is the global batch's loss)."""
    sums: dict = defaultdict(lambda: [0.0, 0])
    for r in records:
        if r.kind == "counter" and r.cat == "loss" and r.step is not None:
            acc = sums[r.step]
            acc[0] += r.args["loss"]
            acc[1] += 1
    return {s: total / n for s, (total, n) in sorted(sums.items())}
