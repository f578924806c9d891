"""Predicted weak scaling to 256 ranks, one panel per network: the cost model's curves, drawn."""
from __future__ import annotations

from ddpkit.costmodel.simulate import MiB, Profile, simulate
from ddpkit.network import as_network
from ddpkit.viz._common import new_figure  # shows in a notebook without pyplot


def plot_scaling(profile: Profile, strategies=("overlapped", "zero1", "fsdp"), networks=("100GbE", "nvlink"),
                 world_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256), bucket_cap_mb: float = 25.0):
    """Predicted weak scaling (same per-rank batch at every size) to 256 ranks, one panel per
    network: scaling efficiency = time of one rank / time of N ranks. A matplotlib Figure.

    The ring formulas' latency term grows linearly with N ((N-1) alpha per all-gather): at
    hundreds of ranks NCCL switches to tree algorithms (log N), so for many small collectives
    (FSDP's per-unit all-gathers) the far right of these curves is pessimistic.
    """
    fig = new_figure(3.6)
    axes = fig.subplots(1, len(networks), sharey=True, squeeze=False)[0]
    for ax, net in zip(axes, networks, strict=True):
        net = as_network(net)
        for s in strategies:
            base = simulate(s, profile, 1, net, bucket_cap_mb).ms_per_step
            eff = [100 * base / simulate(s, profile, n, net, bucket_cap_mb).ms_per_step for n in world_sizes]
            ax.plot(world_sizes, eff, marker="o", ms=3, label=s)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(world_sizes), [str(n) for n in world_sizes], fontsize=8)
        ax.minorticks_off()
        ax.set_ylim(0, 105)
        ax.set_title(net.describe(), fontsize=10)
        ax.set_xlabel("ranks (GPUs)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("scaling efficiency (%)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Predicted weak scaling, {profile.param_bytes / MiB:.1f} MiB of parameters, "
                 f"{(profile.forward_s + profile.backward_s) * 1e3:.1f} ms compute per step")
    return fig
