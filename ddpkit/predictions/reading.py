"""A measurement read for a question: its value, and the kit's own accounting of it, term by term.

Nothing here measures: readers lay what a measuring cell left (a Trace, run results, step parts)
out as terms that add up to it (ring terms, memory categories, step parts) for ``explain``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ddpkit.network import ring_bytes
from ddpkit.units import human_bytes


@dataclass(frozen=True)
class Term:
    """One part of a measurement: what it is (a line of the accounting) and how much."""

    label: str
    value: float


@dataclass
class Measured:
    """What the run gave: ``value`` (``faster``: the first option's speed-up), ``terms`` adding up to it
    in ``terms_unit``, ``readings`` (common lines of thought), ``times`` and ``spread`` (per option),
    ``reference`` where it needs this run."""

    value: float
    terms: list[Term]
    terms_unit: str
    readings: list[Term] = field(default_factory=list)
    times: dict[str, float] = field(default_factory=dict)
    spread: tuple[float, float] | None = None
    reference: float | None = None
    world_size: int | None = None
    network: str | None = None
    note: str = ""

    def __post_init__(self):
        if not self.terms:
            raise ValueError("a measurement needs at least one term of its accounting")


OP_WORDS = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
            "broadcast": "broadcast", "barrier": "barrier"}


def ring_factor(op: str, world_size: int) -> str:
    """The ring formula's factor as the course writes it: "2(N-1)/N" at N = 2 is "2(2-1)/2"."""
    n = world_size
    return {"all_reduce": f"2({n}-1)/{n}", "all_gather": f"({n}-1)/{n}", "reduce_scatter": f"({n}-1)/{n}",
            "broadcast": f"({n}-1)/{n}", "barrier": "0"}[op]


def ring_terms(sizes: dict[str, tuple[int, float]], world_size: int, scale: float) -> list[Term]:
    """A term per collective kind (``sizes``: op -> (count, full S)): ``ring_bytes`` of S, in ``scale``."""
    return [Term(f"{_size_words(count, op, s)}: {ring_factor(op, world_size)} x S",
                 ring_bytes(op, s, world_size) / scale) for op, (count, s) in sizes.items() if count]


def _size_words(count: int, op: str, s: float) -> str:
    """"66 all-reduces, together S = 8.04 MiB" (never "of 8.04 MiB", which reads as each)."""
    if count == 1:
        return f"1 {OP_WORDS[op]} of S = {human_bytes(s)}"
    return f"{count} {OP_WORDS[op]}s, together S = {human_bytes(s)}"


def trace_sizes(trace, rank: int = 0, step: int = -1) -> tuple[dict[str, tuple[int, float]], int, int]:
    """``({op: (count, full bytes S)}, step, world size)`` of one recorded step (-1: the last) on ``rank``."""
    from ddpkit.trace import as_trace

    trace = as_trace(trace)
    if not trace.steps:
        raise ValueError("the trace has no recorded training step: record the run (cluster.recording())")
    step = trace.resolve_step(step)
    sizes: dict[str, list] = {}
    groups = set()
    for r in trace.select(rank=rank, step=step, cat="comm"):
        count, total = sizes.setdefault(r.name, [0, 0])
        sizes[r.name] = [count + 1, total + r.nbytes]
        groups.add(r.args.get("group_size", trace.world_size))
    if len(groups) > 1:
        raise ValueError(f"step {step} mixes collectives over groups of {sorted(groups)} ranks; read it per group")
    n = groups.pop() if groups else trace.world_size
    return {op: (c, s) for op, (c, s) in sizes.items()}, step, n


def bytes_sent(trace, scale: float, rank: int = 0, step: int = -1) -> Measured:
    """One rank's bytes in one recorded step, in ring terms per kind; readings: each full size once, twice."""
    from ddpkit.trace import comm_bytes_per_step

    sizes, step, n = trace_sizes(trace, rank, step)
    sent = comm_bytes_per_step(trace)[step][rank]
    terms = ring_terms(sizes, n, scale)
    full = sum(s for _, s in sizes.values())
    readings = [Term("every collective's full size S once, the ring's factor left out", full / scale),
                Term("2S: each byte out and back, without the ring's (N-1)/N", 2 * full / scale),
                Term("(N-1)/N x S: half a ring all-reduce (its reduce-scatter, or its all-gather)",
                     (n - 1) / n * full / scale)]
    return Measured(sent / scale, terms, _unit_of(scale), readings, world_size=n,
                    note=f"rank {rank}, step {step}, from the records of ddpkit's process group")


def memory_terms(memory: dict, categories, scale: float) -> list[Term]:
    """``memory`` (one rank's bytes by category, ``ddpkit.memory``) as terms, in ``scale`` units."""
    return [Term(c.replace("_", " "), memory.get(c, 0) / scale) for c in categories]


def parts_terms(first: dict, second: dict, labels: dict) -> list[Term]:
    """The second option's step minus the first's, one term per ``step_breakdown`` part (ms)."""
    return [Term(labels.get(k, k), second[k] - first[k]) for k in first]


def remainder(total: float, terms: list[Term], label: str, tolerance: float = 1e-9) -> list[Term]:
    """``terms`` and, when they do not add up to ``total``, one more term for the rest."""
    rest = total - sum(t.value for t in terms)
    return terms + [Term(label, rest)] if abs(rest) > tolerance * max(1.0, abs(total)) else terms


def _unit_of(scale: float) -> str:
    return {1: "B", 2**10: "KiB", 2**20: "MiB", 2**30: "GiB"}.get(scale, "B")
