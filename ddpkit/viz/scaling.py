"""Predicted weak scaling to 256 ranks, one panel per network: the cost model's curves, drawn."""
from __future__ import annotations

from ddpkit.costmodel.simulate import MiB, Profile, simulate
from ddpkit.network import as_network
from ddpkit.strategies.table import HEADLINE
from ddpkit.strategies.table import strategy as strategy_row
from ddpkit.viz._common import new_figure  # shows in a notebook without pyplot


def plot_scaling(profile: Profile, strategies=HEADLINE, networks=("100GbE", "nvlink"),
                 world_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256), bucket_cap_mb: float | None = None):
    """Predicted weak scaling to 256 ranks, a panel per network (efficiency = one rank's time / N
    ranks'), the headline rungs by default; hybrid sharding's curve starts at its smallest world
    size. The ring's (N-1) alpha makes the far right pessimistic (NCCL switches to trees)."""
    fig = new_figure(3.6)
    axes = fig.subplots(1, len(networks), sharey=True, squeeze=False)[0]
    for ax, net in zip(axes, networks, strict=True):
        net = as_network(net)
        for s in strategies:
            sizes = [n for n in world_sizes if strategy_row(s).fits(n, net)]
            first = 1 if strategy_row(s).fits(1, net) else min(sizes, default=None)
            if first is None:
                continue
            base = simulate(s, profile, first, net, bucket_cap_mb).ms_per_step
            eff = [100 * base / simulate(s, profile, n, net, bucket_cap_mb).ms_per_step for n in sizes]
            ax.plot(sizes, eff, marker="o", ms=3, label=s if first == 1 else f"{s} (from {first} ranks)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(world_sizes), [str(n) for n in world_sizes], fontsize=8)
        ax.minorticks_off()
        ax.set_ylim(0, 110)  # room above 100%: a sharded optimizer can beat one unsharded rank
        ax.set_title(net.describe(), fontsize=10)
        ax.set_xlabel("ranks (GPUs)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("scaling efficiency (%)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Predicted weak scaling, {profile.param_bytes / MiB:.1f} MiB of parameters, "
                 f"{(profile.forward_s + profile.backward_s) * 1e3:.1f} ms compute per step")
    return fig
