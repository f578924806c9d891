"""A rank's communication state, shared by every ddpkit group of the rank, and what a job asks of it.

    comm = rankside.comm()                 # this rank's Comm (None outside ddpkit's process group)
    comm.snapshot()                        # {(collective, link): (calls, bytes, transport bytes)}
    comm.emulation_counts(), comm.transport_seconds()   # what the emulated links did so far
    with comm.real_transport(): ...        # no emulated delay inside: measure the transport itself

Every figure is a running total on this rank: subtract two readings to count a window.
"""
from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from dataclasses import dataclass, field

from ddpkit.comm.emulator import Emulator
from ddpkit.comm.flight import FlightRecorder
from ddpkit.network import Network


@dataclass
class Count:
    """Collectives of one kind on one link: how many, and the bytes this rank sent."""

    calls: int = 0
    bytes: float = 0.0            # by the algorithm (ring formulas, network.ring_bytes)
    transport_bytes: float = 0.0  # what the real backend moved (gloo's reduce-scatter: 2x)


@dataclass
class Comm:
    """What every ddpkit group of this rank shares: the network, its emulator, the counts, the flight ring."""

    network: Network
    real_backend: str                         # "shm", "cuda-ipc", "gloo" or "nccl": what moves the bytes
    emulator: Emulator = field(init=False)
    counts: dict = field(default_factory=lambda: defaultdict(Count))  # (op, link) -> Count
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    flight: FlightRecorder = field(default_factory=FlightRecorder, repr=False)

    def __post_init__(self):
        self.emulator = Emulator()

    def count(self, op: str, link: str, sent: float, moved: float) -> None:
        with self.lock:  # collectives are issued from autograd's threads too
            c = self.counts[(op, link)]
            c.calls += 1
            c.bytes += sent
            c.transport_bytes += moved

    def snapshot(self) -> dict:
        """``{(op, link): (calls, bytes, transport_bytes)}`` now; subtract two to get a window."""
        with self.lock:
            return {k: (c.calls, c.bytes, c.transport_bytes) for k, c in self.counts.items()}

    def set_network(self, network) -> None:
        """Emulate ``network`` from the next collective on (on every rank, between collectives)."""
        self.network = Network.from_dict(network) if isinstance(network, dict) else Network.of(network)

    @contextlib.contextmanager
    def real_transport(self):
        """Inside the block collectives take what the real transport takes (calibration)."""
        previous, self.emulator.enabled = self.emulator.enabled, False
        try:
            yield
        finally:
            self.emulator.enabled = previous

    def emulation_counts(self) -> tuple[int, int]:
        """``(collectives the emulated links carried, of which the transport outran the link)`` so far."""
        counts = self.emulator.fidelity().values()
        return sum(carried for carried, _ in counts), sum(outran for _, outran in counts)

    def transport_seconds(self) -> float:
        """Seconds this rank spent moving the bytes of collectives an emulated NIC carried; 0 off one."""
        return self.emulator.transport_s()


__all__ = ["Comm", "Count"]
