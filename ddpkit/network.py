"""What a link costs, and what the ranks are connected by: ``Link``, ``Network``, their presets,
and ``LinkClock``, when a collective completes on an emulated link.

A ``Link`` is the alpha-beta description of one kind of connection, with alpha the latency of
one message (seconds) and beta the time per byte (seconds per byte, 1 / bandwidth). A ring
collective on it costs (docs/papers.md, "cost of collectives"; the kit's one statement of them):

    all-reduce of S bytes on N ranks       2(N-1) alpha + 2(N-1)/N S beta
    all-gather / reduce-scatter (full S)    (N-1) alpha +  (N-1)/N S beta
    broadcast                               (N-1) alpha +           S beta

The multiples of alpha and beta are ``ring_terms``: the messages in a row, and what the busiest
link carries one after another (``link_bytes``). The bytes one rank sends (``ring_bytes``, what the
process group counts) are the same for the symmetric collectives; a broadcast's root sends more than
the rest, and it counts the average. ``collective_time`` is the one formula of a collective's time:
the process group, the emulator, the cost model, its fit and the course's formulas all call it.

A ``Network`` is what a cluster's ranks are connected by: one link between every pair of ranks,
or two tiers (``gpus_per_node=k``: ranks r // k share a node, joined by a fast ``intra`` link;
nodes are joined by the slow ``inter`` link). A collective whose group spans nodes runs at the
pace of the inter-node link, one inside a node at the intra-node link's. ``Network.route`` says, for
one group's collectives, which link carries them, how long each takes on it and whether its bytes
move at the wait (the timing policy, in one place); ``LinkClock`` says when each completes. Two
consumers ask them:

- the emulator (``ddpkit.comm.emulator``), which makes a collective on this laptop last as long as it
  would on that network; ``"loopback"`` adds no delay;
- the cost model (``ddpkit.costmodel``), which predicts a step. On an emulated network a
  collective moves on the real transport underneath (shared memory here) and on the
  emulated link side by side, and takes the longer of the two: that transport is the network's
  ``floor``, a Link fitted on this machine (``Network.transport_time`` and ``Network.emulated_time``).

A link made for this machine rather than a real one, on which a step's all-reduces take as long as
a measured backward, is ``ddpkit.matched_link.match_backward`` (notebooks 04 and 08).
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
    """Bytes one rank sends for a collective of full size S = ``nbytes`` (the ring algorithms of
    the module docstring), as an average over the group's ranks: what all of them send together,
    divided by N; every rank sends as much as the next for the symmetric collectives (an all-reduce
    is a reduce-scatter then an all-gather). A broadcast is not symmetric: in a ring
    pipeline the root sends all S, every other rank but the last forwards it, the last sends
    nothing: (N-1) S in all, (N-1)/N * S per rank, as an all-gather of S. So N broadcasts of S/N,
    each from the rank that owns it (torch's ZeroRedundancyOptimizer), count as one all-gather of
    S: the same bytes. Their time differs (``link_bytes``): N(N-1) alpha + S beta for the
    broadcasts, (N-1) alpha + (N-1)/N S beta for the all-gather.
    """
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
    """(messages, bytes) of a ring collective of full size S: its time on a link is messages x
    alpha + bytes x beta (``collective_time``), its messages in a row (``RING_STEPS``) and the bytes
    its busiest link carries (``link_bytes``). A fit of alpha and beta to timings regresses on them
    (``costmodel.fit_link``); a link made to a given time solves them (``matched_link``)."""
    if world_size <= 1:
        return 0.0, 0.0
    return float(RING_STEPS[name](world_size)), link_bytes(name, nbytes, world_size)


def link_bytes(name: str, nbytes: int, world_size: int) -> float:
    """Bytes the busiest link of a collective of full size S carries one after another: the
    multiple of beta in its time. ``ring_bytes`` for the symmetric collectives, where every
    link carries what its rank sends; a broadcast's S, since every link of the pipeline but the
    last carries all of it (a ring's links run at once: its time is one link's)."""
    if name == "broadcast" and world_size > 1:
        return float(nbytes)
    return ring_bytes(name, nbytes, world_size)


@dataclass(frozen=True)
class Link:
    """One kind of connection for the alpha-beta model: ``alpha`` s per message, ``beta`` s per byte.

    ``per_op`` optionally gives some collectives their own ``(alpha, beta)``: ``costmodel.fit_link``
    fills it when it has timings of several collectives (a small reduce-scatter may cost more
    than a small all-gather, not the ring formulas' same alpha).

    ``host``: this link is a transport that moves the bytes with the ranks' own CPU cores (gloo's
    threads, the shared-memory transport's copies and sums), so its time is taken from their
    compute: the cost model puts it on the rank's timeline, not beside it (as a GPU's NCCL or a
    network card would be). ``transport``: the real transport this line was fitted to (a Cluster's
    ``transport``: "shm", "gloo", ...; "" for a network's link): under an emulated link the
    shared-memory transport moves a collective's bytes when the rank waits (``Network.route``).

    ``measured`` optionally holds the timings a line was fitted to, ``{op: ((bytes, seconds), ...)}``
    on ``measured_world_size`` ranks (``costmodel.format_fit`` prints them beside the line).
    """

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
    """Seconds for one ring collective of full size S on ``link``: messages x alpha + bytes on its
    busiest link x beta (``ring_terms``; each collective's own alpha and beta where the link has them)."""
    alpha, beta = link.alpha_beta(name)
    messages, carried = ring_terms(name, nbytes, world_size)
    return messages * alpha + carried * beta


class LinkClock:
    """When collectives complete on one emulated link: the one rule the emulator keeps in real time
    (``ddpkit.comm.emulator``, one clock per link of a rank) and the cost model simulates
    (``ddpkit.costmodel.simulate``), in seconds on one timeline.

    A collective occupies the link from its issue, or from when the link frees up if it is still
    busy with an earlier one (collectives on one link run one after another, in issue order), for
    the link's time (``Network.emulated_time``: the ring formulas above): ``delivers``. The real
    transfer underneath runs side by side, and the collective completes when both are done; the
    link is busy until then: ``complete``. Under ``at_wait`` (``Route.at_wait``: the shared-memory
    transport on an emulated network, the emulated network card) the real transfer is not the
    link's: the collective's bytes move when the rank waits for it, and the link is done with it
    when it delivers (``complete`` without ``real_end``), unless a future of it was handed out
    (``on_futures``: torch's DDP, a comm hook), when the link's thread moves them on delivery:
    ``real_end`` then is the delivery plus the transfer.
    """

    def __init__(self):
        self.free_s = 0.0  # when the link is done with every collective issued so far

    def delivers(self, issued_s: float, link_s: float) -> float:
        """When the link delivers a collective issued at ``issued_s`` that takes ``link_s`` on it."""
        return max(issued_s, self.free_s) + link_s

    def complete(self, link_end: float, real_end: float | None = None) -> float:
        """The collective the link delivered at ``link_end`` completes, its real transfer having
        ended at ``real_end`` (None: not on the link, ``at_wait``); returns when, and the link is
        busy until then."""
        self.free_s = link_end if real_end is None else max(real_end, link_end)
        return self.free_s


# Real transports that, under an emulated link, move a collective's bytes when the rank waits for it,
# not from its issue: the emulated network card (``ddpkit.comm.emulator``). gloo's sockets and NCCL
# move bytes on threads or a GPU of their own, from the issue.
MOVES_AT_WAIT = frozenset({"shm"})


@dataclass(frozen=True)
class Route:
    """How one group's collectives run on a network (``Network.route``), the one timing policy the
    process group, the emulator and the cost model ask: ``kind`` names the link ("intra-node" or
    "inter-node"), ``link`` is the emulated one (None: nothing emulated), ``time`` a collective's
    time on it, ``at_wait`` whether its bytes move at the wait (an emulated link over a transport in
    ``MOVES_AT_WAIT``). When it completes is ``LinkClock``'s rule, one clock per ``kind``."""

    kind: str
    link: Link | None
    size: int
    at_wait: bool = False

    def time(self, op: str, nbytes: float) -> float:
        """Seconds the emulated link takes for one collective of full size ``nbytes`` (0: none)."""
        return 0.0 if self.link is None else collective_time(op, nbytes, self.size, self.link)


# Presets. "loopback" is the all-reduce line fitted on the development machine (2 CPU cores,
# the shared-memory transport, collectives timed back to back) by `python -m ddpkit predict --fit
# --fit-ranks 2`, a round figure inside what three runs printed (`--transport gloo` fits gloo's
# sockets instead). Its time is the ranks' own CPU work (host=True). Fit your own machine the same
# way: the fit prints its alpha and beta, and how they move from run to run. The others are
# round figures for the order of magnitude, not measurements: Ethernet moves at most its line
# rate (1 GbE 0.125 GB/s, 10 GbE 1.25 GB/s, 100 GbE 12.5 GB/s), 85-90% of it in practice, with
# tens of microseconds per message over TCP; NVLink (A100/H100 class) moves a few hundred GB/s
# per GPU, a few microseconds per hop.
LINKS = {
    "loopback": Link("loopback", alpha=70e-6, beta=1 / 4.5e9, host=True, transport="shm"),
    "nvlink": Link("nvlink", alpha=5e-6, beta=1 / 200e9),
    "100GbE": Link("100GbE", alpha=20e-6, beta=1 / 10e9),
    "10GbE": Link("10GbE", alpha=30e-6, beta=1 / 1.1e9),
    "1GbE": Link("1GbE", alpha=50e-6, beta=1 / 0.11e9),
    # The papers' regime on a laptop: communication dominates the step, as the DDP paper found
    # on its clusters as models grow (docs/papers.md). With the course's default MLP (8.04 MiB of
    # gradients) on 2 ranks, one all-reduce of every gradient takes S beta + 2 alpha on this link
    # (``Network("paper").emulated_time("all_reduce", S, range(2))``), chosen longer than that
    # model's backward pass on a small CPU machine (the backward alone: `python
    # benchmarks/bench_overlap.py --networks paper`), so bucket sizes
    # and overlap decide the step time, as on the papers' clusters.
    "paper": Link("paper", alpha=100e-6, beta=1 / 0.6e9),
}


@dataclass(frozen=True)
class Network:
    """What the ranks are connected by: one link, or two tiers (see the module docstring).

        Network("10GbE")                       # a preset: the same link between every pair
        Network.of(alpha_us=20, gbytes_per_s=5)  # explicit latency and bandwidth
        Network("10GbE", gpus_per_node=2)      # two tiers: nvlink inside a node, 10GbE between
        Network("loopback")                    # no emulated link: what this machine does
        Network("loopback", gpus_per_node=2)   # nodes of 2 (hybrid sharding's), no emulated link

    ``inter`` is the link between nodes (every pair of ranks when ``gpus_per_node`` is None),
    ``intra`` the one inside a node, ``floor`` the real transport an emulated collective can never
    beat (the cost model's business; None where it predicts a real cluster), ``emulation_s`` what
    an emulated collective that is waited for costs beyond the slower of the two on this machine
    (the emulator's own wake-ups: measured by ``costmodel.validate``).
    """

    name: str = "loopback"
    gpus_per_node: int | None = None
    intra_name: str = "nvlink"
    inter: Link | None = field(default=None, compare=False)
    intra: Link | None = field(default=None, compare=False)
    floor: Link | None = field(default=None, compare=False)
    emulation_s: float = field(default=0.0, compare=False)

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
        """A Network from what a user may pass: a Network, a preset name, ``"ALPHA_US,GBYTES_PER_S"``
        (e.g. ``"20,10"``), or ``alpha_us=`` and ``gbytes_per_s=``; ``None`` is loopback."""
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
        """The node a (global) rank sits on: each rank its own node unless ``gpus_per_node``
        (numbered node by node, as in ``ddpkit.Topology``)."""
        return rank // (self.gpus_per_node or 1)

    def crosses_nodes(self, ranks) -> bool:
        return len({self.node_of(r) for r in ranks}) > 1

    def link_for(self, ranks) -> tuple[str, Link | None]:
        """(``"inter-node"`` or ``"intra-node"``, the emulated link) for a group of global ranks."""
        if self.crosses_nodes(ranks):
            return "inter-node", self.inter
        return "intra-node", self.intra if self.gpus_per_node is not None else self.inter

    def route(self, ranks, transport: str = "") -> Route:
        """How the collectives of a group of global ``ranks`` run here over the real ``transport``
        (a Cluster's: "shm", "gloo", "cuda-ipc", "nccl"): see ``Route``."""
        kind, link = self.link_for(ranks)
        return Route(kind, link, len(ranks), at_wait=link is not None and transport in MOVES_AT_WAIT)

    def emulated_time(self, op: str, nbytes: float, ranks) -> float:
        """Seconds the emulated link takes for this collective (0 on loopback): the emulator's."""
        return self.route(ranks).time(op, nbytes)

    def transport_time(self, op: str, nbytes: float, world_size: int) -> float:
        """Seconds the real transport under an emulated network takes (0 without a ``floor``)."""
        return collective_time(op, nbytes, world_size, self.floor) if self.floor is not None else 0.0

    def collective_time(self, op: str, nbytes: float, world_size: int) -> float:
        """Seconds for one collective over all ``world_size`` ranks on its own: the slower of the
        real transport and the emulated link (the emulator runs them side by side, from issue)."""
        return max(self.transport_time(op, nbytes, world_size), self.emulated_time(op, nbytes, range(world_size)))

    def with_floor(self, floor: Link | None, emulation_s: float | None = None) -> Network:
        """The same network over another real transport (e.g. one fitted on this machine), and
        with ``emulation_s`` (see the class) if given."""
        return replace(self, floor=floor, emulation_s=self.emulation_s if emulation_s is None else emulation_s)

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
    """Anything a caller may give for a network: a Network, a Link (every pair of ranks joined by
    it, inside a node of ``gpus_per_node`` and between nodes, nothing underneath: the cost model
    then prices collectives on that link alone), a preset name, ``"ALPHA_US,GBYTES_PER_S"``, or
    None (loopback)."""
    if isinstance(spec, Link):
        return Network(spec.name, gpus_per_node, inter=spec, intra=spec if gpus_per_node is not None else None)
    return Network.of(spec, gpus_per_node=gpus_per_node)
