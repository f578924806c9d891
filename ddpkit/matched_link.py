"""A link matched to this machine's backward: where overlap has the most to hide (notebooks 04, 08).

    matched = match_backward(backward_s, grad_bytes, world_size, buckets=k)
    print(matched.arithmetic())          # the match, number by number
    cluster.network = matched.network

The presets (``ddpkit.network``) are real networks; on this laptop their link time can be far from a
step's backward, where overlap either has nothing to hide or cannot hide most of it. A matched link
makes one step's all-reduces take exactly a measured backward.
"""
from __future__ import annotations

from dataclasses import dataclass

from ddpkit.network import Link, Network, ring_bytes, ring_terms

MATCH_ALPHA_US = 100.0  # the latency of a matched link: the "paper" preset's


@dataclass(frozen=True)
class MatchedLink:
    """A link matched to a step's backward (``match_backward``): one step's all-reduces of every
    gradient take exactly as long on it as backward computes, so overlap, which can hide link time
    only while backward runs, has the most to hide and nothing left over. Its arithmetic, with
    S the gradients' bytes, N ranks, k buckets (a message each) and alpha its latency:

        link time of a step  = k 2(N-1) alpha + 2(N-1)/N S beta  := backward
        so               beta = (backward - k 2(N-1) alpha) / (2(N-1)/N S)
    """

    backward_s: float   # backward of one step, measured as the ranks train (all computing at once)
    grad_bytes: int     # S: the bytes of every gradient a step all-reduces
    world_size: int     # N
    buckets: int = 1    # k: all-reduces a step, each paying the latency
    alpha: float = MATCH_ALPHA_US * 1e-6

    def __post_init__(self):
        if not (self.backward_s > 0 and self.grad_bytes > 0 and self.world_size >= 2 and self.buckets >= 1
                and self.alpha >= 0):
            raise ValueError(f"a matched link needs backward_s > 0, grad_bytes > 0, world_size >= 2, buckets >= 1 "
                             f"and alpha >= 0; got {self.backward_s}, {self.grad_bytes}, {self.world_size}, "
                             f"{self.buckets}, {self.alpha}")
        if self.latency_s >= self.backward_s:
            raise ValueError(f"{self.messages} messages of {self.alpha * 1e6:g} us ({self.latency_s * 1e3:.2f} ms) "
                             f"take longer than backward ({self.backward_s * 1e3:.2f} ms): no bandwidth matches; "
                             "use fewer buckets or a smaller alpha")

    @property
    def messages(self) -> int:
        return self.buckets * int(ring_terms("all_reduce", self.grad_bytes, self.world_size)[0])

    @property
    def latency_s(self) -> float:
        return self.messages * self.alpha

    @property
    def sent_bytes(self) -> float:
        return ring_bytes("all_reduce", self.grad_bytes, self.world_size)

    @property
    def link(self) -> Link:
        # collective_time's bytes term solved for beta: an all-reduce's busiest link carries what a rank sends
        carried = ring_terms("all_reduce", self.grad_bytes, self.world_size)[1]
        return Link("matched", self.alpha, (self.backward_s - self.latency_s) / carried)

    @property
    def network(self) -> Network:
        """The network to give a Cluster (``cluster.network = m.network``)."""
        return Network(self.link.name, inter=self.link)

    def arithmetic(self) -> str:
        """The match, number by number, as a learner can check it."""
        n, mib, link = self.world_size, 2**20, self.link
        return "\n".join([
            f"backward: {self.backward_s * 1e3:.2f} ms a step, measured",
            f"a step's all-reduces on {n} ranks: {self.buckets} x 2(N-1) = {self.messages} messages x "
            f"{self.alpha * 1e6:g} us = {self.latency_s * 1e3:.2f} ms of latency, and 2(N-1)/N x "
            f"{self.grad_bytes / mib:.2f} MiB = {self.sent_bytes / mib:.2f} MiB ({self.sent_bytes / 1e6:.2f} MB) "
            "sent per rank",
            f"bandwidth for both to take {self.backward_s * 1e3:.2f} ms: {self.sent_bytes / 1e6:.2f} MB / "
            f"({self.backward_s * 1e3:.2f} - {self.latency_s * 1e3:.2f}) ms = {link.gbytes_per_s:.3g} GB/s",
            f"so the network: {link.describe()}"])


def match_backward(backward_s: float, grad_bytes: int, world_size: int, buckets: int = 1,
                   alpha_us: float = MATCH_ALPHA_US) -> MatchedLink:
    """A link on which a step's all-reduces (``buckets`` of them, ``grad_bytes`` in all, on
    ``world_size`` ranks) take ``backward_s``, this machine's measured backward: where overlap
    hides the most (``MatchedLink``; its ``.network`` goes to a Cluster)."""
    return MatchedLink(backward_s, int(grad_bytes), world_size, buckets, alpha_us * 1e-6)
