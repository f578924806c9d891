"""Where a simulated rank's collectives land on its timeline: the emulated links' clocks, the real
transport underneath, and the waits.

A step (``ddpkit.costmodel.simulate``) issues collectives here as the wrapper would, and waits for
them where it would; this works out when each completes, by the rule the emulator keeps
(``ddpkit.network.LinkClock``, one clock per link as the emulator has one thread per link), with
the link's time and whether the bytes move at the wait from the group's ``Network.route`` (as the
process group asks it) and the transport's time from ``Network.transport_time``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ddpkit.network import LinkClock, Network, ring_bytes


@dataclass
class Pending:
    """One collective issued: when the link (or the transport) is done with it, and, under
    ``at_wait``, the transport's seconds still to be spent by the rank that waits for it."""

    end: float
    transport_s: float = 0.0
    waiting: bool = False           # at_wait: its bytes have not moved yet
    group: tuple = ()               # the ranks it runs among: each group's transport moves its own queue
    wake: float = 0.0               # at_wait: Network.emulation_s, added to the wait that moves its bytes


class Stream:
    """One rank's collectives: on each link one at a time, in the order issued.

    On an emulated network a collective runs on the real transport and on the emulated link side
    by side, both starting when it is issued (or when each frees up); it completes when both are
    done (``LinkClock``). A transport that moves the bytes with the ranks' own cores (``Link.host``:
    gloo, shared memory) does it on the issuing rank's timeline: the step adds ``host_s`` there,
    where it issued, and the transfer ends with that work. Any other (a GPU's) runs beside the
    compute, one collective at a time.

    Under ``at_wait`` (``Route.at_wait``: the shared-memory transport on an emulated network) the
    issue costs the rank nothing: the link's time runs from the issue, and the rank moves the bytes
    when it waits (``wait``), those of every earlier collective of the same group not yet moved
    first (a group's transport completes them in order); a wait ends when both that and the link
    are done. With ``on_futures`` (torch's DDP chains its work on futures) the link's thread moves
    them when the link delivers, keeping the link busy meanwhile, on the rank's core: the rank is
    charged for them at the issue, as without ``at_wait`` (where they land in its timeline depends
    on when the link delivers; at the issue is the model's choice).
    """

    def __init__(self, world_size: int, network: Network, on_futures: bool = False, copy_s_per_byte: float = 0.0):
        self.n, self.net = world_size, network
        self.copy_s_per_byte = copy_s_per_byte  # a pass over memory: a group of one rank's collective
        floor = network.floor
        self.on_host = floor is not None and floor.host
        self.transport = floor.transport if floor is not None else ""  # what the floor was fitted on
        self.on_futures = on_futures
        self.clocks: dict[str, LinkClock] = {}  # per link ("intra-node", "inter-node"), as the emulator's
        self.pending: list[Pending] = []  # at_wait: issued, bytes not moved yet, in issue order
        self.transport_free = 0.0
        self.busy = 0.0
        self.bytes = 0.0
        self.count = 0

    def issue(self, name: str, nbytes: float, at: float, ranks=None) -> Pending:
        """Launch at time ``at`` (or when its link frees up) among ``ranks`` (default: all of
        them; hybrid sharding's collectives run in a node's group or across nodes)."""
        ranks = range(self.n) if ranks is None else ranks
        if len(ranks) == 1:
            return Pending(at)
        route = self.net.route(ranks, self.transport)
        real = self.net.transport_time(name, nbytes, len(ranks))
        link = route.time(name, nbytes)
        self.busy += max(real, link)
        self.bytes += ring_bytes(name, nbytes, len(ranks))
        self.count += 1
        # the emulator hands the result over a little after the link frees (its thread wakes,
        # then the waiter): on this machine's timeline, not on the link's
        wake = self.net.emulation_s if link > 0 else 0.0
        clock = self.clocks.setdefault(route.kind, LinkClock())
        link_end = clock.delivers(at, link)
        if route.at_wait:
            if self.on_futures:  # the link's thread moves the bytes as it delivers, busy meanwhile
                return Pending(clock.complete(link_end, link_end + real) + wake)
            pending = Pending(clock.complete(link_end), real, waiting=True, group=tuple(ranks), wake=wake)
            self.pending.append(pending)
            return pending
        if self.on_host:  # the issuer's own work (host_s), done when it is
            real_end = at + real
        else:
            self.transport_free = max(at, self.transport_free) + real
            real_end = self.transport_free
        return Pending(clock.complete(link_end, real_end) + wake)

    def host_s(self, name: str, nbytes: float, ranks=None) -> float:
        """The seconds the issuing rank's cores spend on a collective as it issues it: the
        transport's time where it runs on them (``Link.host``) from the issue, else nothing. In a
        group of one rank there is nothing to move, but an all-gather or a reduce-scatter still
        copies its input to its output (every transport's, this kit's included): one pass over S."""
        ranks = range(self.n) if ranks is None else ranks
        if len(ranks) == 1:
            return nbytes * self.copy_s_per_byte if name in ("all_gather", "reduce_scatter") else 0.0
        if not self.on_host:
            return 0.0
        if self.net.route(ranks, self.transport).at_wait and not self.on_futures:  # moved at the wait
            return 0.0
        return self.net.transport_time(name, nbytes, len(ranks))

    def launch(self, name: str, nbytes: float, at: float, ranks=None) -> tuple[float, Pending]:
        """``issue`` from the rank's timeline at ``at``: (when the rank goes on, the collective)."""
        return at + self.host_s(name, nbytes, ranks), self.issue(name, nbytes, at, ranks)

    def wait(self, t: float, done: Pending) -> float:
        """The rank, at ``t``, waits for ``done``: when it goes on. Under ``at_wait`` it moves the
        bytes now, its group's earlier ones first, and is done when both that and the link are, plus
        ``wake``: measured beyond the slower of the two (``measure.emulation_overhead``), added so."""
        if done.waiting:
            for p in [p for p in self.pending if p.group == done.group]:
                self.pending.remove(p)
                t += p.transport_s
                p.waiting = False
                if p is done:
                    break
            return max(t, done.end) + done.wake
        return max(t, done.end + done.wake)

    def finish(self, t: float) -> float:
        """The rank, at ``t``, waits for every collective issued."""
        last = {p.group: p for p in self.pending}  # each group's last, groups in the order they issued
        for p in last.values():
            t = self.wait(t, p)
        return max([t, *(clock.free_s for clock in self.clocks.values())])
