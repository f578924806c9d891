"""Memory per category, per rank and per strategy, beside the ZeRO formulas' predictions."""
from __future__ import annotations

from ddpkit.memory import CATEGORIES
from ddpkit.memory_formulas import STAGE_OF_STRATEGY
from ddpkit.trace import Trace, memory_peak
from ddpkit.viz._common import byte_unit, new_figure, no_data
from ddpkit.viz.style import CATEGORY_COLOURS, OTHER_COLOUR


def _per_rank(value) -> list[dict]:
    """A {category: bytes}, a list of them, or a Trace (each rank's peak) -> a list per rank."""
    if isinstance(value, Trace):
        peaks = [memory_peak(value.records, [rank]) for rank in value.ranks]
        return [peak[3] for peak in peaks if peak is not None]
    if isinstance(value, dict):
        return [value]
    return list(value)


def _normalise(measured) -> dict[str, list[dict]]:
    """{group label: [per-rank {category: bytes}]} from any accepted form."""
    if isinstance(measured, Trace) or isinstance(measured, (list, tuple)):
        return {"measured": _per_rank(measured)}
    if isinstance(measured, dict) and measured and all(isinstance(v, (int, float)) for v in measured.values()):
        return {"measured": [measured]}
    return {str(k): _per_rank(v) for k, v in measured.items()}


def _stage_of(label: str) -> str | None:
    """The ZeRO stage a label names ("fsdp", "fsdp by class", "ZeRO-3"), else None."""
    if label in STAGE_OF_STRATEGY.values():
        return label
    words = label.lower().replace("(", " ").split()
    return STAGE_OF_STRATEGY.get(label.lower()) or (STAGE_OF_STRATEGY.get(words[0]) if words else None)


def _prediction_for(label: str, predicted):
    """(tick label, prediction) for a group: its own, or its stage's (tick: the stage, else
    "formula"); (None, None) if none."""
    if not predicted:
        return None, None
    stage = _stage_of(label)
    if label in predicted:
        return stage or "formula", predicted[label]
    return (stage, predicted[stage]) if stage in predicted else (None, None)


def plot_memory(measured, predicted=None, title: str | None = None):
    """Stacked bars of bytes by category, a bar per rank in each group, the ZeRO formula's
    prediction hatched beside. ``measured``: a Trace, per-rank ``{category: bytes}``, or
    ``{label: that}``; ``predicted``: ``{label or ZeRO stage: {category: bytes}}``."""
    groups = _normalise(measured)
    if not any(groups.values()):  # words, not empty axes that read as "zero bytes"
        fig = new_figure(1.2)
        ax = fig.subplots()
        no_data(ax, "Memory was not recorded in this run (a recorded train_step samples it; or call "
                    "ddpkit.memory.record_memory(recorder, model, optimizer))")
        ax.axis("off")
        return fig
    bars = sum(len(ranks) + bool(_prediction_for(label, predicted)[1]) for label, ranks in groups.items())
    fig = new_figure(4.2, width_in=max(9.0, 0.42 * bars + 0.3 * len(groups) + 2.5))  # ~0.4 in a bar
    ax = fig.subplots()
    present = {c for ranks in groups.values() for sample in ranks for c in sample}
    cats = [c for c in CATEGORIES if c in present]
    cats += sorted(c for c in present if c not in cats and not c.startswith("cuda_"))
    tallest = 0.0
    for ranks in groups.values():
        for sample in ranks:
            tallest = max(tallest, sum(sample.get(c, 0) for c in cats), sample.get("cuda_max_allocated", 0))
    for label in groups:
        _, pred = _prediction_for(label, predicted)
        if pred:
            tallest = max(tallest, sum(pred.get(c, 0) for c in cats))
    unit, size = byte_unit(tallest)

    x, ticks, ticklabels, group_centres = 0.0, [], [], []
    cuda_peak_shown = False
    for label, ranks in groups.items():
        first = x
        # short tick labels (a rank's number, the formula's stage), so neighbours never touch;
        # the group's name goes under them, the axis label says what the numbers are
        bars = [(str(i), sample, False) for i, sample in enumerate(ranks)]
        stage, pred = _prediction_for(label, predicted)
        if pred:
            bars.append((stage, pred, True))
        for name, sample, is_prediction in bars:
            bottom = 0.0
            for c in cats:
                v = sample.get(c, 0) / size
                if not v:
                    continue
                ax.bar(x, v, bottom=bottom, width=0.8, color=CATEGORY_COLOURS.get(c, OTHER_COLOUR),
                       alpha=0.45 if is_prediction else 0.95, hatch="//" if is_prediction else None,
                       edgecolor="black", lw=0.4)
                bottom += v
            if "cuda_max_allocated" in sample:  # the allocator's own peak, for comparison
                ax.plot(x, sample["cuda_max_allocated"] / size, marker="_", ms=18, color="black")
                cuda_peak_shown = True
            ticks.append(x)
            ticklabels.append(name)
            x += 1.0
        group_centres.append(((first + x - 1.0) / 2, label))
        x += 0.8  # a gap between groups

    ax.set_xticks(ticks, ticklabels, fontsize=8)
    has_formula = any(_prediction_for(label, predicted)[1] for label in groups)
    ax.set_xlabel("rank" + (" (hatched: the ZeRO formula of that stage)" if has_formula else ""), fontsize=9,
                  labelpad=24 if len(groups) > 1 or next(iter(groups)) != "measured" else 4)
    if len(groups) > 1 or next(iter(groups)) != "measured":
        below = -25  # under the tick labels, above the axis label
        for centre, label in group_centres:
            ax.annotate(label, (centre, 0), xycoords=("data", "axes fraction"), xytext=(0, below),
                        textcoords="offset points", ha="center", fontsize=9, fontweight="bold")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    # the legend in category order (the stacking order, bottom first)
    handles = [Patch(facecolor=CATEGORY_COLOURS.get(c, OTHER_COLOUR), edgecolor="black", lw=0.4) for c in cats][::-1]
    labels = [c.replace("_", " ") for c in cats][::-1]  # top of the stack first
    if any(_prediction_for(label, predicted)[1] for label in groups):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//"))
        labels.append("ZeRO formula (model states only)")
    if cuda_peak_shown:
        handles.append(Line2D([], [], marker="_", ms=18, ls="", color="black"))
        labels.append("CUDA max allocated")
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              frameon=False)
    ax.set_ylabel(f"memory per rank ({unit})")
    ax.set_title(title or "Memory per rank by category")
    ax.grid(axis="y", alpha=0.3)
    return fig


def plot_memory_against_n(sweep: dict, formulas: dict | None = None, title: str | None = None):
    """Memory per rank against the number of ranks, a panel per strategy: ``sweep`` is
    ``{n: memory_sweep.memory_against_n(...)}``; ``formulas`` (``{(strategy, n): bytes}``) draws the
    ZeRO formula as a line over each bar: what it leaves out is above the line."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    sizes = sorted(sweep)
    strategies = list(dict.fromkeys(s for n in sizes for s in sweep[n]))
    # model states at the bottom, then what the formulas leave out (CATEGORIES' order)
    cats = [c for c in CATEGORIES if any(sweep[n][s].get(c) for n in sizes for s in sweep[n])]
    tallest = max(sum(sweep[n][s].get(c, 0) for c in cats) for n in sizes for s in sweep[n])
    unit, size = byte_unit(tallest)
    fig = new_figure(3.8, width_in=max(9.0, 1.9 * len(strategies) + 1.8))
    axes = fig.subplots(1, len(strategies), sharey=True, squeeze=False)[0]
    for ax, s in zip(axes, strategies, strict=True):
        shown = [n for n in sizes if s in sweep[n]]
        for i, n in enumerate(shown):
            bottom = 0.0
            for c in cats:
                v = sweep[n][s].get(c, 0) / size
                if v:
                    ax.bar(i, v, bottom=bottom, width=0.7, color=CATEGORY_COLOURS.get(c, OTHER_COLOUR),
                           edgecolor="black", lw=0.4)
                    bottom += v
            if formulas and (s, n) in formulas:
                ax.plot([i - 0.42, i + 0.42], [formulas[(s, n)] / size] * 2, color="black", lw=1.8)
        ax.set_xticks(range(len(shown)), [str(n) for n in shown])
        ax.set_xlabel("ranks", fontsize=9)
        ax.set_title(s, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel(f"memory per rank ({unit})")
    handles = [Patch(facecolor=CATEGORY_COLOURS.get(c, OTHER_COLOUR), edgecolor="black", lw=0.4) for c in cats][::-1]
    labels = [c.replace("_", " ") for c in cats][::-1]
    if formulas:
        handles.append(Line2D([], [], color="black", lw=1.8))
        labels.append("ZeRO formula (model states)")
    fig.legend(handles, labels, loc="outside right upper", fontsize=8, frameon=False)
    fig.suptitle(title or "Memory per rank against the number of ranks")
    return fig
