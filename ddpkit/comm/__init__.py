"""How bytes travel between the ranks: every collective's journey, from a strategy's call to the wire.

- ``process_group``: ddpkit's process group, which every collective passes through (our strategies'
  and torch's): it counts it, records it (the one writer of a collective's record), hands it to
  the emulated link, keeps it in the flight ring, and has the real backend carry it;
- ``emulator``: the emulated network, a thread per link that completes a collective when the
  link would have delivered it, and the verdict where the real transfer outran the link;
- ``flight``: the flight recorder, a ring of this rank's last collectives the parent can read;
- ``desync``: the parent's reading of those rings when the ranks' collectives part;
- ``transport/``: the shared-memory transport that moves CPU ranks' bytes on one host.

``ddpkit.network`` and ``ddpkit.topology`` (what a link costs, which ranks share a node) are the
vocabulary this package shares with the cost model; they stay at the top.
"""
