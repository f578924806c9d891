"""Bar charts of one compare run: ms/step, bytes sent and model state per strategy."""
from __future__ import annotations

from ddpkit.viz._common import new_figure


def plot_compare(records: list[dict]):
    """Bars of ms/step (``format_table``'s median), comm bytes/step and model state per strategy,
    ddpkit's in blue, torch's in grey; a value not reported says "not recorded", not zero."""
    ok = [r for r in records if "error" not in r]
    fig = new_figure(3.6)
    axes = fig.subplots(1, 3)
    names = [r["strategy"] for r in ok]
    colours = ["tab:gray" if n.startswith("torch_") else "tab:blue" for n in names]
    for ax, key, label, scale in ((axes[0], "ms_per_step", "ms per step (median of rounds)", 1),
                                  (axes[1], "comm_bytes_per_step", "MiB sent per rank per step", 2**20),
                                  (axes[2], "model_state_bytes", "model state MiB per rank", 2**20)):
        values = [r.get(key) for r in ok]
        shown = [i for i, v in enumerate(values) if v is not None]
        ax.bar([names[i] for i in shown], [values[i] / scale for i in shown], color=[colours[i] for i in shown])
        ax.set_xticks(range(len(names)), names)
        for i, v in enumerate(values):
            if v is None:
                ax.text(i, 0.03, "not recorded", rotation=90, ha="center", va="bottom", fontsize=8,
                        color="dimgray", style="italic", transform=ax.get_xaxis_transform())
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelrotation=45)
        for t in ax.get_xticklabels():
            t.set_horizontalalignment("right")
            t.set_rotation_mode("anchor")
    ws = ok[0]["world_size"] if ok else "?"
    fig.suptitle(f"ddpkit compare: {ws} ranks, model {describe_model(ok[0]) if ok else '?'} (grey: torch's own)")
    return fig


def describe_model(record: dict) -> str:
    """"mlp (width 128, depth 16)": a compare record's model in words, never a raw dict."""
    kwargs = record.get("model_kwargs") or {}
    inside = ", ".join(f"{k} {v}" for k, v in kwargs.items())
    return f"{record.get('model', '?')}" + (f" ({inside})" if inside else "")
