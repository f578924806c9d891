"""What a link costs: the alpha-beta description of a network and the time of one ring collective.

Each collective costs what the ring algorithms cost (PAPERS.md), with alpha the latency of one
message (seconds) and beta the time per byte (seconds per byte, 1 / bandwidth):

    all-reduce of S bytes on N ranks       2(N-1) alpha + 2(N-1)/N S beta
    all-gather / reduce-scatter (full S)    (N-1) alpha +  (N-1)/N S beta

``Network`` holds alpha and beta (and, once fitted, each collective's own line and the timings
it was fitted to); ``NETWORKS`` are named presets; ``collective_time`` prices one collective.
The cost model (``ddpkit.costmodel``) and the traces' byte counts (``ddpkit.trace``) read these.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from itertools import pairwise

# Messages in a row of the ring algorithm on N ranks: the multiple of alpha a collective pays.
RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1,
              "reduce_scatter": lambda n: n - 1, "broadcast": lambda n: n - 1}


def ring_bytes(name: str, nbytes: int, world_size: int) -> float:
    """Bytes one rank sends for a collective of full size S = ``nbytes`` (ring algorithms).

    all-reduce 2(N-1)/N * S (a reduce-scatter then an all-gather); all-gather and
    reduce-scatter (N-1)/N * S; broadcast S (the root sends everything once, pipelined).
    """
    n = world_size
    if n <= 1:
        return 0.0
    if name == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if name in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * nbytes
    if name == "broadcast":
        return float(nbytes)
    raise ValueError(f"unknown collective {name!r}; known: all_reduce, all_gather, reduce_scatter, broadcast")


@dataclass(frozen=True)
class Network:
    """A fabric for the alpha-beta model: ``alpha`` seconds per message, ``beta`` seconds per byte.

    ``per_op`` optionally gives some collectives their own ``(alpha, beta)``: ``costmodel.fit_network``
    fills it when it has timings of several collectives (on gloo over loopback a small
    reduce-scatter costs more than a small all-gather, not the ring formulas' same alpha).

    ``measured`` optionally holds the timings themselves, ``{op: ((bytes, seconds), ...)}`` on
    ``measured_world_size`` ranks: at that size ``collective_time`` interpolates between them
    instead of using the straight line. A machine's curve is not quite a line (on the
    development machine the all-reduce line could miss 16 MiB by 20-35%), but one timing is
    noisier than a line through six: ``predict --validate`` shows both. Every other world size
    uses the lines. ``line()`` is the same network without the timings.
    """

    name: str
    alpha: float
    beta: float
    per_op: dict = field(default_factory=dict, compare=False)
    measured: dict = field(default_factory=dict, compare=False)
    measured_world_size: int = 0

    def __post_init__(self):
        for a, b in [(self.alpha, self.beta), *self.per_op.values()]:
            if not (a >= 0 and b >= 0):
                raise ValueError(f"alpha and beta must be >= 0, got {a}, {b}")
        unknown = (set(self.per_op) | set(self.measured)) - set(RING_STEPS)
        if unknown:
            raise ValueError(f"unknown collective(s) {sorted(unknown)}; valid: {', '.join(RING_STEPS)}")
        if self.measured and self.measured_world_size < 2:
            raise ValueError("measured timings need the world size they were taken on (>= 2)")

    def alpha_beta(self, op: str) -> tuple[float, float]:
        return self.per_op.get(op, (self.alpha, self.beta))

    def line(self) -> Network:
        """This network's straight lines only, without the measured timings."""
        return replace(self, measured={}, measured_world_size=0)

    @property
    def gbytes_per_s(self) -> float:
        return 1e-9 / self.beta if self.beta else math.inf


# Presets. "loopback" is the all-reduce line fitted on the development machine (2 CPU cores,
# gloo over loopback, collectives timed back to back) by `python -m ddpkit predict --fit
# --fit-ranks 2`: alpha 280-710 us and 1.7-2.3 GB/s over several runs (a small collective's
# latency there drifts from second to second). Fit your own machine the same way. The others are
# round figures for the order of magnitude, not measurements: 100 GbE moves at most 12.5 GB/s,
# ~10 GB/s in practice, with tens of microseconds per message over TCP; NVLink (A100/H100 class)
# moves a few hundred GB/s per GPU, a few microseconds per hop.
NETWORKS = {
    "loopback": Network("loopback", alpha=500e-6, beta=1 / 2e9),
    "100GbE": Network("100GbE", alpha=20e-6, beta=1 / 10e9),
    "nvlink": Network("nvlink", alpha=5e-6, beta=1 / 200e9),
}


def collective_time(name: str, nbytes: float, world_size: int, network: Network) -> float:
    """Seconds for one ring collective of full size S: steps x alpha + bytes sent x beta, or,
    where ``network`` holds timings of this collective at this world size, interpolated."""
    n = world_size
    if n == 1:
        return 0.0
    steps = RING_STEPS[name](n)
    alpha, beta = network.alpha_beta(name)
    table = network.measured.get(name) if n == network.measured_world_size else None
    if table:
        return _interpolate(table, nbytes, ring_bytes(name, 1.0, n) * beta)
    return steps * alpha + ring_bytes(name, nbytes, n) * beta


def _interpolate(table, nbytes: float, slope: float) -> float:
    """Straight between the two measured sizes around ``nbytes``; below the smallest, its time
    (latency dominates there); above the largest, on from it with the fitted ``slope``."""
    (s0, t0), (s_last, t_last) = table[0], table[-1]
    if nbytes <= s0:
        return t0
    if nbytes >= s_last:
        return t_last + (nbytes - s_last) * slope
    for (a, ta), (b, tb) in pairwise(table):
        if a <= nbytes <= b:
            return ta if b == a else ta + (tb - ta) * (nbytes - a) / (b - a)
    raise AssertionError("unreachable: table sizes are sorted")
