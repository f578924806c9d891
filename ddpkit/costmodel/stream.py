"""Where a simulated rank's collectives land on its timeline: the emulated links' clocks, the real
transport underneath, and the waits.

A simulated step issues and waits here as the wrapper would; each completes by the emulator's rule
(``LinkClock``, one per link), with the link's time and ``at_wait`` from ``Network.route`` and the
transport's time from ``Network.transport_time``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ddpkit.network import LinkClock, Network, ring_bytes


@dataclass
class Pending:
    """One collective issued: when the link is done, and under ``at_wait`` the transport's seconds left."""

    end: float
    transport_s: float = 0.0
    waiting: bool = False           # at_wait: its bytes have not moved yet
    group: tuple = ()               # the ranks it runs among: each group's transport moves its own queue
    wake: float = 0.0               # at_wait: Network.emulation_s, added to the wait that moves its bytes


class Stream:
    """One rank's collectives, on each link one at a time in issue order, beside the real transport
    (``LinkClock``): a host transport on the rank's timeline (``host_s``); ``at_wait``: moved at the
    wait; ``on_futures``: moved at delivery, charged at the issue."""

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

    def issue(self, name: str, nbytes: float, at: float, ranks=None, in_step: bool = False) -> Pending:
        """Launch at ``at`` (or when its link frees up) among ``ranks`` (default all); ``in_step``: right
        after the last collective was waited for, no compute between (the ranks meet in step)."""
        ranks = range(self.n) if ranks is None else ranks
        if len(ranks) == 1:
            return Pending(at)
        route = self.net.route(ranks, self.transport)
        real = self.net.transport_time(name, nbytes, len(ranks))
        link = route.time(name, nbytes)
        self.busy += max(real, link)
        self.bytes += ring_bytes(name, nbytes, len(ranks))
        self.count += 1
        # the emulator hands the result over a little after the link frees: on this machine's timeline
        wake = (self.net.emulation_step_s if in_step else self.net.emulation_s) if link > 0 else 0.0
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
        """Seconds the issuing rank's cores spend as it issues: a host transport's time, else 0; in a
        group of one, an all-gather or reduce-scatter still copies input to output (one pass)."""
        ranks = range(self.n) if ranks is None else ranks
        if len(ranks) == 1:
            return nbytes * self.copy_s_per_byte if name in ("all_gather", "reduce_scatter") else 0.0
        if not self.on_host:
            return 0.0
        if self.net.route(ranks, self.transport).at_wait and not self.on_futures:  # moved at the wait
            return 0.0
        return self.net.transport_time(name, nbytes, len(ranks))

    def launch(self, name: str, nbytes: float, at: float, ranks=None, in_step: bool = False) -> tuple[float, Pending]:
        """``issue`` from the rank's timeline at ``at``: (when the rank goes on, the collective)."""
        return at + self.host_s(name, nbytes, ranks), self.issue(name, nbytes, at, ranks, in_step)

    def wait(self, t: float, done: Pending) -> float:
        """The rank, at ``t``, waits for ``done``: when it goes on (under ``at_wait`` after moving its
        group's bytes up to it), plus ``wake`` (``measure.emulation_overhead``)."""
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
