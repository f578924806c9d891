"""Why N ranks are slower than perfect scaling: the gap, taken apart into where the time went.

Pure functions of the same workload's traces recorded at 1 rank and at N ranks.

    one = step_breakdown(trace_at_1)              # every rank's step time in STEP_PARTS
    gap = decompose(trace_at_1, trace_at_4, "strong")
    gap.parts     # {"exposed_comm": ms, "straggler_wait": ms, "host_overhead": ms, "contention": ms}
    gap.residual_ms, gap.efficiency
    print(format_gaps([gap2, gap4]))             # ddpkit.viz.plot_scaling_gap draws them

The parts partition every rank's time between a step's end and the next's, so the residual is
zero up to rounding (a check on the bookkeeping); noise shows between runs.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ddpkit.trace.intervals import clip, intersect, length, minus, union
from ddpkit.trace.records import as_trace

STEP_PARTS = ("compute", "exposed_comm", "straggler_wait", "host")
GAP_PARTS = ("contention", "host_overhead", "exposed_comm", "straggler_wait")
PART_LABELS = {"contention": "compute slowed by contention", "host_overhead": "host overhead",
               "exposed_comm": "exposed communication", "straggler_wait": "waiting for the slowest rank",
               "compute": "compute", "host": "host", "residual": "residual"}


@dataclass
class StepBreakdown:
    """Where the steps of one recorded run went: means over ranks and steps, in ms."""

    world_size: int
    steps: list[int]
    step_ms: float                        # the mean time from one step's end to the next's (step_ends)
    parts: dict[str, float]               # STEP_PARTS, each the mean over ranks and steps
    per_rank: dict[int, dict[str, float]] = field(default_factory=dict)  # each rank's parts


def _compute_intervals(mine) -> list[tuple[int, int]]:
    """Compute spans of one rank's step, backward cut at its last gradient-ready event."""
    ready = [r.start_ns for r in mine if r.kind == "instant" and r.cat == "grad_ready"]
    out = []
    for r in mine:
        if r.kind != "span" or r.cat != "compute" or r.end_ns is None or r.name == "sync":
            continue
        end = r.end_ns
        if r.name == "backward":
            inside = [t for t in ready if r.start_ns <= t <= r.end_ns]
            end = max(inside) if inside else r.end_ns
        out.append((r.start_ns, end))
    return union(out)


def _issue_matching(trace) -> dict[tuple, int]:
    """``{(step, group, k): latest issue ns over the ranks}`` for each collective: the k-th one of
    its group in its step, on every rank that issued it."""
    latest: dict = {}
    per_rank: dict = defaultdict(list)
    for r in trace.records:
        if r.kind == "span" and r.cat == "comm":
            per_rank[(r.rank, r.step, _group(r))].append(r)
    for (_, step, group), rs in per_rank.items():
        for k, r in enumerate(sorted(rs, key=lambda r: r.start_ns)):
            key = (step, group, k)
            latest[key] = max(latest.get(key, r.start_ns), r.start_ns)
    return latest


def _group(r) -> tuple:
    group = r.args.get("group")
    return tuple(group) if group is not None else ()


def _rank_step(by_rank_step, comm_of, latest, rank: int, steps, a: int, b: int) -> dict[str, int]:
    """The partition of one rank's time in ``[a, b)`` (ns) into STEP_PARTS, from the compute
    spans of ``steps`` and every collective of the rank."""
    compute = clip(_compute_intervals([r for s in steps for r in by_rank_step[(rank, s)]]), a, b)
    comm, waiting = [], []
    for r, key in comm_of[rank]:
        end = r.end_ns if r.end_ns is not None else b
        if end <= a or r.start_ns >= b:
            continue
        comm.append((r.start_ns, end))
        last = latest.get(key, r.start_ns)
        if last > r.start_ns:  # another rank issued it later: rank r waits for it to arrive
            waiting.append((r.start_ns, min(last, end)))
    blocked = minus(clip(union(comm), a, b), compute)
    straggler = length(intersect(blocked, clip(union(waiting), a, b)))
    blocked_ns = length(blocked)
    compute_ns = length(compute)
    return dict(compute=compute_ns, straggler_wait=straggler, exposed_comm=blocked_ns - straggler,
                host=(b - a) - compute_ns - blocked_ns)


def step_ends(trace) -> dict[int, int]:
    """``{step: ns}``: when each step ended for the whole run -- the latest completion, over the
    ranks, of its last collective (or of its last compute span where it has none)."""
    trace = as_trace(trace)
    ends: dict = {}
    for r in trace.records:
        if r.kind != "span" or r.step is None or r.cat not in ("comm", "compute"):
            continue
        if r.cat == "compute" and r.name in ("step",):
            continue  # the optimizer step follows the step's communication: not its end
        end = r.end_ns if r.end_ns is not None else r.start_ns
        ends.setdefault(r.step, {}).setdefault(r.cat, []).append(end)
    return {s: max(v.get("comm") or v["compute"]) for s, v in ends.items() if v.get("comm") or v.get("compute")}


def step_breakdown(trace, steps=None, skip: int = 1) -> StepBreakdown:
    """Partition every rank's steps into STEP_PARTS and average them.

    Step s lasts from the end of step s-1 to its own end (``step_ends``). Each instant of it is the
    first that holds: *compute* (inside a compute span, ``backward`` up to its last gradient-ready
    event; not ``sync``), *straggler wait* (a collective in flight that another rank has not issued
    yet), *exposed communication* (one every rank has issued), *host overhead* (the rest).
    ``steps``: default every step after the first ``skip`` warm-up steps and the next one."""
    trace = as_trace(trace)
    trained = trace.steps
    ends = step_ends(trace)
    prev = dict(zip(trained[1:], trained[:-1], strict=True))
    if steps is None:
        steps = trained[skip + 1:]
    steps = [s for s in steps if s in prev and s in ends and prev[s] in ends]
    if not steps:
        raise ValueError(f"need a recorded step after another (steps recorded: {trained}; "
                         f"skipping the first {skip} and the one after)")
    by_rank_step: dict = defaultdict(list)
    for r in trace.records:
        by_rank_step[(r.rank, r.step)].append(r)
    latest = _issue_matching(trace)
    comm_of: dict = defaultdict(list)
    counters: dict = defaultdict(int)
    for r in sorted((r for r in trace.records if r.kind == "span" and r.cat == "comm"), key=lambda r: r.start_ns):
        key = (r.rank, r.step, _group(r))
        comm_of[r.rank].append((r, (r.step, _group(r), counters[key])))
        counters[key] += 1

    totals = dict.fromkeys(STEP_PARTS, 0)
    per_rank: dict = defaultdict(lambda: dict.fromkeys(STEP_PARTS, 0))
    for s in steps:
        a, b = ends[prev[s]], ends[s]
        for rank in trace.ranks:
            # the previous step's records too: its optimizer step runs after its end
            parts = _rank_step(by_rank_step, comm_of, latest, rank, (prev[s], s), a, b)
            for k, v in parts.items():
                totals[k] += v
                per_rank[rank][k] += v
    n = len(steps) * len(trace.ranks)
    step_ms = sum(ends[s] - ends[prev[s]] for s in steps) / len(steps) / 1e6
    return StepBreakdown(trace.world_size, steps, step_ms,
                         {k: v / n / 1e6 for k, v in totals.items()},
                         {rank: {k: v / len(steps) / 1e6 for k, v in p.items()} for rank, p in per_rank.items()})


@dataclass
class Gap:
    """The gap between a run at N ranks and perfect scaling from 1 rank, and its parts (ms per step)."""

    world_size: int
    mode: str                   # "strong" (same global batch) or "weak" (same batch per rank)
    one_rank_ms: float          # T(1): the measured step time at 1 rank
    step_ms: float              # T(N): the measured step time at N ranks (between the shared step ends)
    ideal_ms: float             # perfect scaling: T(1)/N (strong) or T(1) (weak)
    parts: dict[str, float]     # GAP_PARTS (see ``decompose``); negative = better than ideal
    at_one: StepBreakdown
    at_n: StepBreakdown

    @property
    def gap_ms(self) -> float:
        return self.step_ms - self.ideal_ms

    @property
    def residual_ms(self) -> float:
        """What the parts do not explain of the measured gap."""
        return self.gap_ms - sum(self.parts.values())

    @property
    def residual_fraction(self) -> float:
        """The residual as a fraction of the gap (0 where there is no gap)."""
        return self.residual_ms / abs(self.gap_ms) if self.gap_ms else 0.0

    @property
    def efficiency(self) -> float:
        """Scaling efficiency: perfect time over measured time (1 = perfect)."""
        return self.ideal_ms / self.step_ms if self.step_ms else 0.0

    @property
    def speedup(self) -> float:
        """Samples per second at N ranks over those at 1 rank."""
        return self.efficiency * self.world_size


def decompose(one_rank, n_ranks, mode: str = "strong", skip: int = 1) -> Gap:
    """The gap of ``n_ranks`` (a trace at N ranks) to perfect scaling from ``one_rank`` (the same
    workload recorded at 1 rank), in parts. ``mode``: "strong" (the same global batch at both) or
    "weak" (the same batch per rank). Either may be a ``StepBreakdown``.

    With f = 1/N (strong) or 1 (weak): gap = T(N) - f T(1) = contention + host_overhead +
    exposed_comm + straggler_wait + residual, each part at N minus f times it at 1; efficiency
    is f T(1) / T(N)."""
    if mode not in ("strong", "weak"):
        raise ValueError(f"mode must be 'strong' or 'weak', got {mode!r}")
    one = one_rank if isinstance(one_rank, StepBreakdown) else step_breakdown(one_rank, skip=skip)
    at_n = n_ranks if isinstance(n_ranks, StepBreakdown) else step_breakdown(n_ranks, skip=skip)
    if one.world_size != 1:
        raise ValueError(f"the baseline must be a run at 1 rank, got {one.world_size} ranks")
    n = at_n.world_size
    f = 1.0 / n if mode == "strong" else 1.0
    p1, pn = one.parts, at_n.parts
    parts = dict(contention=pn["compute"] - f * p1["compute"], host_overhead=pn["host"] - f * p1["host"],
                 exposed_comm=pn["exposed_comm"] - f * p1["exposed_comm"],
                 straggler_wait=pn["straggler_wait"] - f * p1["straggler_wait"])
    return Gap(n, mode, one.step_ms, at_n.step_ms, f * one.step_ms, parts, one, at_n)


def format_gaps(gaps) -> str:
    """A text table of ``decompose`` results, one line per run (ms per step)."""
    heads = ["mode", "ranks", "1 rank", "ideal", "measured", "gap", "contention", "host", "exposed comm",
             "straggler", "residual", "efficiency"]
    rows = []
    for g in gaps:
        rows.append([g.mode, str(g.world_size), f"{g.one_rank_ms:.1f}", f"{g.ideal_ms:.1f}", f"{g.step_ms:.1f}",
                     f"{g.gap_ms:+.1f}"] + [f"{g.parts[p]:+.1f}" for p in GAP_PARTS]
                    + [f"{g.residual_ms:+.2f} ({g.residual_fraction:+.1%})" if abs(g.residual_ms) >= 0.005
                       else "0.00", f"{g.efficiency:.0%}"])   # never "-0.00 (-0.0%)"
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(heads)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.append("")
    lines.append("ms per step. ideal: 1 rank's time / N (strong) or 1 rank's time (weak).")
    lines.append("gap = measured - ideal = contention + host + exposed comm + straggler + residual "
                 "(residual: its share of the gap).")
    return "\n".join(lines)
