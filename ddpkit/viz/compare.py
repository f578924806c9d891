"""Bar charts of one compare run: ms/step, bytes sent and model state per strategy."""
from __future__ import annotations

from ddpkit.viz._common import new_figure


def plot_compare(records: list[dict]):
    """Bar charts of ms/step, comm bytes/step and model state per strategy (a matplotlib Figure).

    ddpkit's strategies in blue, torch's own in grey; a value a strategy does not report
    (torch's wrappers communicate out of our recorder's sight) is marked "not measured".
    """
    ok = [r for r in records if "error" not in r]
    fig = new_figure(3.4)
    axes = fig.subplots(1, 3)
    names = [r["strategy"] for r in ok]
    colours = ["tab:gray" if n.startswith("torch_") else "tab:blue" for n in names]
    for ax, key, label, scale in ((axes[0], "ms_per_step", "ms per step (median)", 1),
                                  (axes[1], "comm_bytes_per_step", "MB sent per rank per step", 1e6),
                                  (axes[2], "model_state_bytes", "model state MB per rank", 1e6)):
        values = [r[key] for r in ok]
        ax.bar(names, [(v or 0) / scale for v in values], color=colours)
        for i, v in enumerate(values):
            if v is None:
                ax.text(i, 0.03, "not measured", rotation=90, ha="center", va="bottom", fontsize=7,
                        color="dimgray", transform=ax.get_xaxis_transform())
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelrotation=45)
        for t in ax.get_xticklabels():
            t.set_horizontalalignment("right")
            t.set_rotation_mode("anchor")
    ws = ok[0]["world_size"] if ok else "?"
    fig.suptitle(f"ddpkit compare: {ws} ranks, model {ok[0]['model'] if ok else '?'} (grey: torch's own)")
    return fig
