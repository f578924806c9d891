"""What one strategy run measured on one rank (``RunResult``, ``experiment.run_strategy``'s) and the
per-step averages read back from its records (``RecordSummary``); None where not measured.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RecordSummary:
    """Per-step averages over the timed steps of one rank's records (``ddpkit.trace``'s definitions)."""

    comm_bytes_per_step: float        # sent by this rank (ring cost), over each collective's own group
    inter_node_bytes_per_step: float  # ... of which across nodes (the network's two tiers)
    collectives_per_step: dict        # {collective: count a step}
    comm_ms_per_step: float           # time in collectives
    overlap_fraction: float           # ... the share of it hidden under backward
    peak_memory_sample: int           # the largest memory sample a strategy reported (bytes)


@dataclass
class RunResult:
    """One rank's run of ``experiment.run_strategy``: ``warmup`` steps, then ``steps`` timed ones."""

    strategy: str
    rank: int
    world_size: int
    model: str                        # the workload's name
    steps: int                        # timed steps (after the warmup)
    step_ms: list[float]              # each timed step (perf_counter on CPU, CUDA events on GPU)
    ms_per_step: float                # their median (run_strategy times at least one step)
    losses: list[float]               # every step's loss, the warmup's included
    # on an emulated network, over the timed steps (ddpkit.comm.emulator)
    emulated_collectives: int = 0     # collectives an emulated link carried
    outran_link: int = 0              # ... of which this machine's transport took longer than the link
    transport_ms_per_step: float = 0.0  # ms a step this rank spent moving at_wait collectives' bytes
    # with reference=: equality with one process
    max_param_diff: float | None = None
    dropout: list[str] = field(default_factory=list)  # where the model drops out: differs by design
    # with record=True: read back from the records (summarize_records), over the timed steps
    comm_bytes_per_step: float | None = None
    inter_node_bytes_per_step: float | None = None
    collectives_per_step: dict = field(default_factory=dict)
    comm_ms_per_step: float | None = None
    overlap_fraction: float | None = None
    # with record=True: one more measured step (ddpkit.memory)
    memory: dict | None = None        # {category: bytes} in that step
    model_state_bytes: int | None = None  # parameters + gradients + optimizer state
    peak_bytes: int | None = None     # the most held at once (GPU: the allocator's peak over the timed steps)
    records: list | None = None       # with return_records=True: the recorder's records
