"""Records and Traces: what each rank did, as plain data, and all ranks' records merged.

A ``Record`` is one span, instant or counter on one rank; a ``Trace`` holds the records of one or
more ranks and selects them by rank, step, category, kind or name. Everything here is picklable.

    trace = Trace.merge(cluster.run(job))      # all ranks' records in one Trace
    trace.select(rank=0, step=-1, cat="comm")  # the last step's collectives on rank 0
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields


@dataclass(slots=True)  # slots: a long recorded run keeps hundreds of thousands of these
class Record:
    """One thing that happened on one rank; times in ns on rank 0's clock (after alignment)."""

    kind: str                # "span" (has an end), "instant" (grad ready), "counter" (memory, loss)
    cat: str                 # "compute" | "comm" | "grad_ready" | "memory" | "loss" (or a caller's own)
    name: str                # "forward", "all_reduce", a parameter name, "memory", ...
    rank: int
    step: int | None         # recorder.next_step() count from 0; None = before the first step
    start_ns: int
    end_ns: int | None = None    # spans only; None if a collective never reported completion
    nbytes: int = 0              # collectives: the FULL size S (ring_bytes: what one rank sends)
    bucket: int | None = None    # DDP bucket index, for collectives and grad_ready
    unit: str | None = None      # FSDP unit name, for collectives
    args: dict = field(default_factory=dict)  # counters: bytes by category, or {"loss": value}; else extra fields
    clock: str = "host"          # "host": time.perf_counter_ns; "cuda": CUDA events (GPU time)

    @property
    def dur_ns(self) -> int:
        return 0 if self.end_ns is None else self.end_ns - self.start_ns

    def __reduce__(self):
        # Pickled as the class and its values in field order (not a slots dataclass's state
        # dict): half the time to pickle and unpickle, so a recorded run streams Records
        # themselves to the notebook, each made once on its rank (see live.py).
        return Record, _values(self)


_values = operator.attrgetter(*(f.name for f in fields(Record)))  # a Record's values, in field order


@dataclass
class Trace:
    """Records of one or more ranks, with the run's world size and backend."""

    records: list[Record]
    world_size: int = 1
    backend: str = "gloo"

    @classmethod
    def merge(cls, parts, world_size: int | None = None, backend: str | None = None) -> Trace:
        """One Trace from per-rank Traces or per-rank lists of Records (e.g. ``cluster.run``)."""
        if isinstance(parts, Trace):
            return parts
        records, sizes, backends = [], [], []
        for part in parts:
            if hasattr(part, "trace"):  # a Recorder (this module does not import the recorder)
                part = part.trace()
            if isinstance(part, Trace):
                records += part.records
                if part.world_size:  # a Recorder made without world_size leaves it None
                    sizes.append(part.world_size)
                backends.append(part.backend)
            else:
                records += list(part)
        ranks = {r.rank for r in records}
        ws = world_size or max(sizes + [max(ranks) + 1 if ranks else 1])
        return cls(records, ws, backend or (backends[0] if backends else "gloo"))

    @property
    def ranks(self) -> list[int]:
        return sorted({r.rank for r in self.records})

    @property
    def steps(self) -> list[int]:
        """Training step indices, in order: steps with a compute span (forward, backward, ...).

        A step of only collectives or memory samples (a state-dict gather) is not one; a trace
        without any compute span keeps every step."""
        stepped = {r.step for r in self.records if r.step is not None}
        trained = {r.step for r in self.records if r.step is not None and r.cat == "compute"}
        return sorted(trained or stepped)

    def select(self, rank=None, step=None, cat=None, kind=None, name=None) -> list[Record]:
        """Records matching every given field; ``step``: an index (-1 = the last) or ``"setup"``."""
        want = None if step is None else (None if step == "setup" else self.resolve_step(step))
        return [r for r in self.records
                if (rank is None or r.rank == rank) and (step is None or r.step == want)
                and (cat is None or r.cat == cat) and (kind is None or r.kind == kind)
                and (name is None or r.name == name)]

    def resolve_step(self, step: int) -> int:
        """Python-style step index: -1 is the last training step, -2 the one before, ..."""
        steps = self.steps
        if step < 0:
            if -step > len(steps):
                raise IndexError(f"step {step}: the trace has {len(steps)} step(s)")
            return steps[step]
        if step not in steps:
            raise IndexError(f"step {step} is not in the trace; steps: {steps}")
        return step


def as_trace(trace_or_records) -> Trace:
    """Accept a Trace, a Recorder, a list of Records, or a list of per-rank parts."""
    if isinstance(trace_or_records, Trace):
        return trace_or_records
    if hasattr(trace_or_records, "trace"):  # a Recorder
        return trace_or_records.trace()
    items = list(trace_or_records)
    if items and all(isinstance(x, Record) for x in items):
        return Trace.merge([items])
    return Trace.merge(items)
