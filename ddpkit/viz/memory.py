"""Memory per category, per rank and per strategy, beside the ZeRO formulas' predictions."""
from __future__ import annotations

from ddpkit.memory import CATEGORIES, STAGE_OF_STRATEGY
from ddpkit.trace import Trace, memory_peak
from ddpkit.viz._common import CATEGORY_COLOURS, byte_unit, new_figure, no_data


def _per_rank(value) -> list[dict]:
    """A {category: bytes} dict, a list of them (one per rank), or a Trace -> list per rank
    (of a Trace: what each rank held at its peak, ``ddpkit.trace.memory_peak``)."""
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


def _prediction_for(label: str, predicted):
    """(name, predicted[label]), else the ZeRO stage of a strategy name; (None, None) if none."""
    if not predicted:
        return None, None
    if label in predicted:
        return label, predicted[label]
    stage = STAGE_OF_STRATEGY.get(label.lower())
    return (stage, predicted[stage]) if stage in (predicted or {}) else (None, None)


def plot_memory(measured, predicted=None, title: str | None = None):
    """Stacked bars of bytes by category: one bar per rank in each group (e.g. strategy), and,
    hatched beside them, the ZeRO formula's prediction for that group (model states only).

    ``measured``: a Trace (what each rank held at its peak), a list of per-rank
    ``{category: bytes}``, or ``{label: that}`` for several strategies. ``predicted``:
    ``{label: {category: bytes}}``, e.g. ``ddpkit.memory.zero_predictions(...)``, whose
    "DDP"/"ZeRO-1"/"ZeRO-3" are matched to labels naive/bucketed/overlapped, zero1, fsdp.
    """
    groups = _normalise(measured)
    if not any(groups.values()):  # words, not empty axes that read as "zero bytes"
        fig = new_figure(1.2)
        ax = fig.subplots()
        no_data(ax, "Memory was not recorded in this run (a recorded train_step samples it; or call "
                    "ddpkit.memory.record_memory(recorder, model, optimizer))")
        ax.axis("off")
        return fig
    fig = new_figure(4.2)
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
        bars = [(f"rank {i}", sample, False) for i, sample in enumerate(ranks)]
        stage, pred = _prediction_for(label, predicted)
        if pred:
            bars.append((f"{stage}\nformula", pred, True))
        for name, sample, is_prediction in bars:
            bottom = 0.0
            for c in cats:
                v = sample.get(c, 0) / size
                if not v:
                    continue
                ax.bar(x, v, bottom=bottom, width=0.8, color=CATEGORY_COLOURS.get(c, "#937860"),
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
    if len(groups) > 1 or next(iter(groups)) != "measured":
        below = -36 if any("\n" in t for t in ticklabels) else -24  # clear of two-line ticks
        for centre, label in group_centres:
            ax.annotate(label, (centre, 0), xycoords=("data", "axes fraction"), xytext=(0, below),
                        textcoords="offset points", ha="center", fontsize=9, fontweight="bold")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    # the legend in category order (the stacking order, bottom first)
    handles = [Patch(facecolor=CATEGORY_COLOURS.get(c, "#937860"), edgecolor="black", lw=0.4) for c in cats][::-1]
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
