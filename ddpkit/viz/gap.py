"""The gap to perfect scaling, stacked: ideal time, then each part of the gap, per world size."""
from __future__ import annotations

from ddpkit.trace.gap import GAP_PARTS, PART_LABELS
from ddpkit.viz._common import new_figure

PART_COLOURS = {"contention": "#dd8452", "host_overhead": "#937860", "exposed_comm": "#8172b3",
                "straggler_wait": "#c44e52"}
IDEAL_COLOUR = "#c9d6e8"


def plot_scaling_gap(gaps, title: str | None = None):
    """Stacked bars of ``trace.gap.decompose`` results, a panel per mode, a bar per world size: the
    perfect-scaling time, then the gap's parts (a negative one hatched downwards); a black line at
    the measured step, the efficiency above."""
    from matplotlib.patches import Patch

    gaps = list(gaps)
    modes = [m for m in ("strong", "weak") if any(g.mode == m for g in gaps)]
    fig = new_figure(4.6)
    axes = fig.subplots(1, max(len(modes), 1), sharey=True, squeeze=False)[0]
    for ax, mode in zip(axes, modes, strict=False):
        mine = sorted((g for g in gaps if g.mode == mode), key=lambda g: g.world_size)
        for i, g in enumerate(mine):
            ax.bar(i, g.ideal_ms, width=0.6, color=IDEAL_COLOUR, edgecolor="black", lw=0.4)
            top = g.ideal_ms
            for part in GAP_PARTS:
                v = g.parts[part]
                if v >= 0:
                    ax.bar(i, v, bottom=top, width=0.6, color=PART_COLOURS[part], edgecolor="black", lw=0.4)
                else:
                    ax.bar(i, -v, bottom=top + v, width=0.6, color="white", edgecolor=PART_COLOURS[part],
                           hatch="///", lw=0.8)
                top += v
            ax.plot([i - 0.38, i + 0.38], [g.step_ms] * 2, color="black", lw=2)
            ax.annotate(f"{g.efficiency:.0%}", (i, max(g.step_ms, top)), xytext=(0, 4), textcoords="offset points",
                        ha="center", fontsize=9, fontweight="bold")
        ax.set_xticks(range(len(mine)), [f"{g.world_size} rank{'s' if g.world_size != 1 else ''}" for g in mine])
        ax.set_xlim(-0.6, len(mine) - 0.4)
        what = "same global batch" if mode == "strong" else "same batch per rank"
        ax.set_title(f"{mode} scaling ({what})", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    highest = max((max(g.step_ms, g.ideal_ms + sum(v for v in g.parts.values() if v > 0)) for g in gaps), default=1.0)
    axes[0].set_ylim(0, 1.12 * highest)  # room for the efficiency labels
    axes[0].set_ylabel("ms per step")
    handles = [Patch(facecolor=IDEAL_COLOUR, edgecolor="black", lw=0.4)]
    labels = ["perfect scaling from 1 rank"]
    for part in GAP_PARTS:
        handles.append(Patch(facecolor=PART_COLOURS[part], edgecolor="black", lw=0.4))
        labels.append(PART_LABELS[part])
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="///"))
    labels.append("a part below zero")
    from matplotlib.lines import Line2D

    handles.append(Line2D([], [], color="black", lw=2))
    labels.append("measured step (label: efficiency)")
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(title or "Where the time goes: the gap to perfect scaling, in parts")
    return fig
