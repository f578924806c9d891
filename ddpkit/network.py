"""What a link costs, and what the ranks are connected by: ``Link``, ``Network``, their presets,
and ``LinkClock``, when a collective completes on an emulated link.

A ``Link`` is alpha (seconds per message) and beta (seconds per byte). A ring collective on it
costs (docs/papers.md, "cost of collectives"; the kit's one statement of them):

    all-reduce of S bytes on N ranks       2(N-1) alpha + 2(N-1)/N S beta
    all-gather / reduce-scatter (full S)    (N-1) alpha +  (N-1)/N S beta
    broadcast                               (N-1) alpha +           S beta

``ring_terms`` gives the multiples of alpha and beta, ``ring_bytes`` the bytes one rank sends (what
the process group counts), ``collective_time`` the one formula every consumer calls (the process
group, the emulator, the cost model, its fit, the course's formulas).

A ``Network`` is one link between every pair of ranks, or two tiers (``gpus_per_node=k``: a fast
``intra`` link inside a node of k ranks, the slow ``inter`` link between nodes). ``Network.route``
is the timing policy in one place (which link, how long, whether the bytes move at the wait);
``LinkClock`` says when each collective completes. The emulator (``ddpkit.comm.emulator``) enacts
them in real time, the cost model (``ddpkit.costmodel``) simulates them, taking the longer of the
emulated link and the real transport underneath (the network's ``floor``, fitted on this machine).
A link matched to a measured backward is ``ddpkit.matched_link.match_backward`` (notebooks 04, 08).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ddpkit.topology import check_ranks_per_node

# Messages in a row of the ring algorithm on N ranks: the multiple of alpha a collective pays.
RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1,
              "reduce_scatter": lambda n: n - 1, "broadcast": lambda n: n - 1,
              "barrier": lambda n: 2 * (n - 1)}  # a barrier is an all-reduce of nothing


def ring_bytes(name: str, nbytes: int, world_size: int) -> float:
    """Bytes one rank sends for a ring collective of full size S, averaged over the ranks (a broadcast:
    (N-1)/N S, as an all-gather of S, though its time differs: ``link_bytes``)."""
    n = world_size
    if n <= 1:
        return 0.0
    if name == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if name in ("all_gather", "reduce_scatter", "broadcast"):
        return (n - 1) / n * nbytes
    if name == "barrier":
        return 0.0
    raise ValueError(f"unknown collective {name!r}; known: all_reduce, all_gather, reduce_scatter, "
                     "broadcast, barrier")


def ring_terms(name: str, nbytes: float, world_size: int) -> tuple[float, float]:
    """(messages in a row, bytes on the busiest link) of a ring collective of full size S."""
    if world_size <= 1:
        return 0.0, 0.0
    return float(RING_STEPS[name](world_size)), link_bytes(name, nbytes, world_size)


def link_bytes(name: str, nbytes: int, world_size: int) -> float:
    """Bytes the busiest link carries in a row: ``ring_bytes``, but a broadcast's whole S."""
    if name == "broadcast" and world_size > 1:
        return float(nbytes)
    return ring_bytes(name, nbytes, world_size)


@dataclass(frozen=True)
class Link:
    """One kind of connection: ``alpha`` s per message, ``beta`` s per byte; ``per_op``: some ops' own
    (``fit_link``'s); ``host``: its bytes move on the ranks' own cores (on the rank's timeline in the
    model); ``transport``: what it was fitted on; ``measured``: the timings fitted (``format_fit``)."""

    name: str
    alpha: float
    beta: float
    per_op: dict = field(default_factory=dict, compare=False)
    measured: dict = field(default_factory=dict, compare=False)
    measured_world_size: int = 0
    host: bool = field(default=False, compare=False)
    transport: str = field(default="", compare=False)

    def __post_init__(self):
        for a, b in [(self.alpha, self.beta), *self.per_op.values()]:
            if not (a >= 0 and b >= 0):
                raise ValueError(f"a link's alpha and beta must be >= 0, got {a}, {b}")
        unknown = (set(self.per_op) | set(self.measured)) - set(RING_STEPS)
        if unknown:
            raise ValueError(f"unknown collective(s) {sorted(unknown)}; valid: {', '.join(RING_STEPS)}")
        if self.measured and self.measured_world_size < 2:
            raise ValueError("measured timings need the world size they were taken on (>= 2)")

    def alpha_beta(self, op: str) -> tuple[float, float]:
        return self.per_op.get(op, (self.alpha, self.beta))

    @property
    def gbytes_per_s(self) -> float:
        return 1e-9 / self.beta if self.beta else math.inf

    def describe(self) -> str:
        return f"{self.name} (alpha {self.alpha * 1e6:.3g} us, {self.gbytes_per_s:.3g} GB/s)"


def collective_time(name: str, nbytes: float, world_size: int, link: Link) -> float:
    """Seconds for one ring collective of full size S on ``link`` (its op's own alpha, beta if it has them)."""
    alpha, beta = link.alpha_beta(name)
    messages, carried = ring_terms(name, nbytes, world_size)
    return messages * alpha + carried * beta


class LinkClock:
    """When collectives complete on one emulated link (the emulator's rule, the model's too): each
    occupies the link from its issue or when the link frees (``delivers``) and completes when the real
    transfer has too (``complete``); under ``at_wait`` at delivery (a future handed out: plus transfer)."""

    def __init__(self):
        self.free_s = 0.0  # when the link is done with every collective issued so far

    def delivers(self, issued_s: float, link_s: float) -> float:
        """When the link delivers a collective issued at ``issued_s`` taking ``link_s``."""
        return max(issued_s, self.free_s) + link_s

    def complete(self, link_end: float, real_end: float | None = None) -> float:
        """When the collective delivered at ``link_end`` completes (``real_end`` None: ``at_wait``)."""
        self.free_s = link_end if real_end is None else max(real_end, link_end)
        return self.free_s


# Real transports that, under an emulated link, move a collective's bytes when the rank waits for it
# (the emulated network card); gloo's sockets and NCCL move them on their own threads from the issue.
MOVES_AT_WAIT = frozenset({"shm"})


@dataclass(frozen=True)
class Route:
    """How one group's collectives run (``Network.route``): ``kind`` (one ``LinkClock`` each), ``link``
    (None: nothing emulated), ``time``, ``at_wait`` (bytes move at the wait: ``MOVES_AT_WAIT``)."""

    kind: str
    link: Link | None
    size: int
    at_wait: bool = False

    def time(self, op: str, nbytes: float) -> float:
        """Seconds the emulated link takes for one collective of full size ``nbytes`` (0: none)."""
        return 0.0 if self.link is None else collective_time(op, nbytes, self.size, self.link)


# Presets. "loopback": the line fitted on the 2-core development machine over shared memory (`python -m
# ddpkit predict --fit --fit-ranks 2` fits yours), the ranks' own CPU work; the others round figures.
LINKS = {
    "loopback": Link("loopback", alpha=70e-6, beta=1 / 4.5e9, host=True, transport="shm"),
    "nvlink": Link("nvlink", alpha=5e-6, beta=1 / 200e9),
    "100GbE": Link("100GbE", alpha=20e-6, beta=1 / 10e9),
    "10GbE": Link("10GbE", alpha=30e-6, beta=1 / 1.1e9),
    "1GbE": Link("1GbE", alpha=50e-6, beta=1 / 0.11e9),
    # The papers' regime on a laptop: the course MLP's all-reduce on 2 ranks outlasts its backward on a
    # small CPU machine (`benchmarks/bench_overlap.py --networks paper`): buckets and overlap decide.
    "paper": Link("paper", alpha=100e-6, beta=1 / 0.6e9),
}


@dataclass(frozen=True)
class Network:
    """What the ranks are connected by: one link, or two tiers (see the module docstring).

        Network("10GbE")                       # a preset: the same link between every pair
        Network.of(alpha_us=20, gbytes_per_s=5)  # explicit latency and bandwidth
        Network("10GbE", gpus_per_node=2)      # two tiers: nvlink inside a node, 10GbE between
        Network("loopback", gpus_per_node=2)   # nodes of 2 (hybrid sharding's), no emulated link

    ``inter``/``intra``: the links between and inside nodes; ``floor``: the real transport underneath
    (None for a real cluster); ``emulation_s``: the emulator's wake-ups per waited collective, the ranks
    arriving apart (after compute); ``emulation_step_s``: the same for a collective issued right after
    the last one was waited for, the ranks in step (``costmodel.measure.emulation_overhead``)."""

    name: str = "loopback"
    gpus_per_node: int | None = None
    intra_name: str = "nvlink"
    inter: Link | None = field(default=None, compare=False)
    intra: Link | None = field(default=None, compare=False)
    floor: Link | None = field(default=None, compare=False)
    emulation_s: float = field(default=0.0, compare=False)
    emulation_step_s: float = field(default=0.0, compare=False)

    def __post_init__(self):
        if self.inter is None and self.name != "loopback":
            object.__setattr__(self, "inter", _link(self.name, "network"))
        if self.gpus_per_node is not None:
            check_ranks_per_node(self.gpus_per_node)
            if self.intra is None and self.inter is not None:  # loopback's nodes: no link emulated
                object.__setattr__(self, "intra", _link(self.intra_name, "intra-node link"))
        if self.name == "loopback" and self.floor is None:
            object.__setattr__(self, "floor", LINKS["loopback"])

    @classmethod
    def of(cls, spec: Network | str | None = None, *, alpha_us: float | None = None,
           gbytes_per_s: float | None = None, gpus_per_node: int | None = None,
           intra: str = "nvlink") -> Network:
        """A Network from a Network, a preset name, ``"ALPHA_US,GBYTES_PER_S"``, or ``alpha_us=`` and
        ``gbytes_per_s=``; ``None`` is loopback."""
        if isinstance(spec, Network):
            if gpus_per_node is not None and gpus_per_node != spec.gpus_per_node:
                return replace(spec, gpus_per_node=gpus_per_node, intra=None)
            return spec
        if alpha_us is not None or gbytes_per_s is not None:
            if spec is not None:
                raise ValueError("give a preset name or alpha_us= and gbytes_per_s=, not both")
            spec = f"{alpha_us},{gbytes_per_s}"
        spec = "loopback" if spec is None else spec
        if not isinstance(spec, str):
            raise TypeError(f"a network is a ddpkit.Network, a preset name or 'ALPHA_US,GBYTES_PER_S', "
                            f"got a {type(spec).__name__}")
        link = _link(spec, "network") if spec != "loopback" else None
        return cls(spec if link is None else link.name, gpus_per_node, intra, inter=link)

    # --- which link a collective runs on --------------------------------------------------
    def node_of(self, rank: int) -> int:
        """The node a (global) rank sits on (each its own unless ``gpus_per_node``), as ``Topology``."""
        return rank // (self.gpus_per_node or 1)

    def link_for(self, ranks) -> tuple[str, Link | None]:
        """(``"inter-node"`` or ``"intra-node"``, the emulated link) for a group of global ranks."""
        if len({self.node_of(r) for r in ranks}) > 1:
            return "inter-node", self.inter
        return "intra-node", self.intra if self.gpus_per_node is not None else self.inter

    def route(self, ranks, transport: str = "") -> Route:
        """How the collectives of a group of global ``ranks`` run here over the real ``transport``."""
        kind, link = self.link_for(ranks)
        return Route(kind, link, len(ranks), at_wait=link is not None and transport in MOVES_AT_WAIT)

    def emulated_time(self, op: str, nbytes: float, ranks) -> float:
        """Seconds the emulated link takes for this collective (0 on loopback): the emulator's."""
        return self.route(ranks).time(op, nbytes)

    def transport_time(self, op: str, nbytes: float, world_size: int) -> float:
        """Seconds the real transport under an emulated network takes (0 without a ``floor``)."""
        return collective_time(op, nbytes, world_size, self.floor) if self.floor is not None else 0.0

    def collective_time(self, op: str, nbytes: float, world_size: int) -> float:
        """Seconds for one collective over all ranks alone: the slower of the real transport and the
        emulated link (run side by side from the issue)."""
        return max(self.transport_time(op, nbytes, world_size), self.emulated_time(op, nbytes, range(world_size)))

    def with_floor(self, floor: Link | None, emulation_s: float | None = None,
                   emulation_step_s: float | None = None) -> Network:
        """The same network over another real transport, with ``emulation_s``, ``emulation_step_s`` if given."""
        return replace(self, floor=floor, emulation_s=self.emulation_s if emulation_s is None else emulation_s,
                       emulation_step_s=self.emulation_step_s if emulation_step_s is None else emulation_step_s)

    @property
    def emulated(self) -> bool:
        return self.inter is not None or self.intra is not None

    def describe(self) -> str:
        if not self.emulated:
            nodes = f", {self.gpus_per_node} ranks per node" if self.gpus_per_node is not None else ""
            return f"loopback (no emulated link){nodes}"
        if self.gpus_per_node is None:
            return self.inter.describe()
        return (f"{self.gpus_per_node} ranks per node: {self.intra.describe()} inside a node, "
                f"{self.inter.describe()} between nodes")

    # --- crossing a process boundary (a rank's configuration is JSON) ---------------------
    def to_dict(self) -> dict:
        return dict(name=self.name, gpus_per_node=self.gpus_per_node, intra_name=self.intra_name,
                    inter=_link_dict(self.inter), intra=_link_dict(self.intra))

    @classmethod
    def from_dict(cls, d: dict) -> Network:
        return cls(d["name"], d["gpus_per_node"], d["intra_name"], inter=_from_link_dict(d["inter"]),
                   intra=_from_link_dict(d["intra"]))


def _link(spec: str, what: str) -> Link:
    """A preset name or ``"ALPHA_US,GBYTES_PER_S"`` as a Link; a ValueError naming the valid ones."""
    if spec in LINKS:
        return LINKS[spec]
    try:
        alpha_us, gbps = (float(t) for t in spec.split(","))
    except ValueError:
        raise ValueError(f"unknown {what} {spec!r}; valid presets: {', '.join(LINKS)}, or "
                         "'ALPHA_US,GBYTES_PER_S' with both > 0 (e.g. '20,10')") from None
    if not (alpha_us >= 0 and gbps > 0 and math.isfinite(gbps)):
        raise ValueError(f"{what} {spec!r}: latency must be >= 0 us and bandwidth > 0 GB/s "
                         f"(or use one of the valid presets: {', '.join(LINKS)})")
    return Link(f"alpha {alpha_us:g} us, {gbps:g} GB/s", alpha_us * 1e-6, 1 / (gbps * 1e9))


def _link_dict(link: Link | None):
    return None if link is None else dict(name=link.name, alpha=link.alpha, beta=link.beta)


def _from_link_dict(d):
    return None if d is None else Link(d["name"], d["alpha"], d["beta"])


NETWORKS = {name: Network.of(name) for name in LINKS}


def as_network(spec, gpus_per_node: int | None = None) -> Network:
    """A Network from a Network, a Link (every pair, nothing underneath), a preset, or None."""
    if isinstance(spec, Link):
        return Network(spec.name, gpus_per_node, inter=spec, intra=spec if gpus_per_node is not None else None)
    return Network.of(spec, gpus_per_node=gpus_per_node)
