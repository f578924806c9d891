"""Clocks: every rank's records on rank 0's clock, and CUDA event times on the host's.

    offset_ns, rtt_ns = align_clocks(clock, device)   # what Recorder.align_clocks calls
    anchor = CudaClock(device, clock)                  # CUDA events -> host ns (the recorder's)
"""
from __future__ import annotations


def align_clocks(clock, device, group=None, rounds: int = 8) -> tuple[int, int]:
    """(this rank's clock minus rank 0's, the bound on that estimate's error), in ns.

    Each round every rank reads its clock before (t_a) and after (t_b) an all-gather; every window
    contains the moment the last rank entered, so the midpoints read one instant, each off by at
    most half its round trip. The round with the smallest worst round trip gives offset = my
    midpoint - rank 0's. Every rank of ``group`` calls it; outside a process group: 0."""
    import torch
    import torch.distributed as dist

    from ddpkit import rankside

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 0
    n = dist.get_world_size(group)
    dev = probe_device(device)
    # NCCL returns from a collective once it is *queued* on the GPU: wait for it to be done,
    # or t_b is read before the all-gather even started and the round trip bounds nothing
    finish = (lambda: torch.cuda.synchronize(dev)) if dev.type != "cpu" else (lambda: None)
    probe = torch.zeros(1, dtype=torch.int64, device=dev)
    out = [torch.zeros_like(probe) for _ in range(n)]
    mine = []  # (round trip, midpoint) per round
    for _ in range(rounds):
        rankside.barrier(group, on=dev)
        finish()
        t_a = clock()
        dist.all_gather(out, probe, group=group)
        finish()
        t_b = clock()
        mine.append((t_b - t_a, (t_a + t_b) // 2))
    # share every rank's rounds: (n, rounds, 2) int64
    local = torch.tensor(mine, dtype=torch.int64, device=dev)
    every = [torch.zeros_like(local) for _ in range(n)]
    dist.all_gather(every, local, group=group)
    every = torch.stack(every).cpu()
    best = int(every[:, :, 0].max(dim=0).values.argmin())
    me = dist.get_rank(group)
    return int(every[me, best, 1] - every[0, best, 1]), int(every[:, best, 0].max())


def probe_device(device):
    """Where the clock probe lives: the rank's GPU under a *real* NCCL backend (CUDA tensors only), else the CPU."""
    import torch

    from ddpkit import rankside

    return torch.device(device) if rankside.backend() == "nccl" else torch.device("cpu")


def cuda_event(device):
    """A timing event on ``device``'s current stream (also right from a callback thread whose
    current device is another GPU)."""
    import torch

    ev = torch.cuda.Event(enable_timing=True)
    ev.record(torch.cuda.current_stream(device))
    return ev


class CudaClock:
    """Converts CUDA event times to host ns through one (event, host time) anchor taken at start."""

    def __init__(self, device, clock):
        import torch

        self.device = device
        with torch.cuda.device(device):
            torch.cuda.synchronize()
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
            torch.cuda.synchronize()  # the stream was idle: the anchor fired just now
            self.host_ns = clock()

    def synchronize(self):
        import torch

        torch.cuda.synchronize(self.device)

    def to_host_ns(self, ev) -> int:
        return self.host_ns + int(self.event.elapsed_time(ev) * 1e6)
