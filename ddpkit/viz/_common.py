"""What the plots share: a notebook-friendly Figure, colours, and byte/time units."""
from __future__ import annotations

import functools
import io

WIDTH_IN = 9.0  # readable at notebook width

# Compute spans and collectives get fixed colours, so every plot reads the same way.
SPAN_COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "sync": "#c44e52", "step": "#55a868"}
OVERLAP_COLOUR = "#2ca02c"


@functools.cache
def _figure_class():
    from matplotlib.figure import Figure

    class NotebookFigure(Figure):
        """A Figure that Jupyter shows as a PNG even when pyplot was never imported."""

        def _repr_png_(self):
            buf = io.BytesIO()
            self.savefig(buf, format="png", dpi=100, bbox_inches="tight")
            return buf.getvalue()

    return NotebookFigure


def new_figure(height_in: float, width_in: float = WIDTH_IN):
    """A matplotlib Figure (object API, Agg canvas: safe off the main thread, no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = _figure_class()(figsize=(width_in, height_in), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


# matplotlib's tab20, as hex: one colour per bucket (or FSDP unit), cycling after 20. Plain
# strings, so the widget's SVG plots use the same colours without importing matplotlib.
BUCKET_COLOURS = ("#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#2ca02c", "#98df8a", "#d62728",
                  "#ff9896", "#9467bd", "#c5b0d5", "#8c564b", "#c49c94", "#e377c2", "#f7b6d2",
                  "#7f7f7f", "#c7c7c7", "#bcbd22", "#dbdb8d", "#17becf", "#9edae5")
CATEGORY_COLOURS = {
    "parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_state": "#55a868",
    "communication_buffers": "#8172b3", "activations": "#c44e52", "unsharded_parameters": "#937860",
}
WAIT_COLOUR = "#c9c9c9"  # backward waiting for communication (after its last gradient was ready)


def bucket_colour(bucket):
    """A colour per bucket index (tab20 cycles after 20 buckets; None -> grey)."""
    if bucket is None:
        return "#7f7f7f"
    return BUCKET_COLOURS[int(bucket) % 20]


def comm_colour(r):
    """A collective's colour: its bucket's, or a stable colour per FSDP unit name."""
    if r.bucket is not None or r.unit is None:
        return bucket_colour(r.bucket)
    return bucket_colour(sum(map(ord, r.unit)))


def plural(n: int, word: str) -> str:
    """"1 bucket", "8 buckets": a count with its noun, never "1 buckets"."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def byte_unit(max_bytes: float) -> tuple[str, float]:
    """('MiB', 2**20) etc., the largest unit that keeps the biggest value >= 1."""
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if max_bytes >= size:
            return name, size
    return "bytes", 1


def no_data(ax, message: str) -> None:
    """Say why a panel is empty instead of drawing a blank axis (shared x ticks are kept)."""
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, wrap=True)
    ax.set_yticks([])
    ax.tick_params(axis="x", labelbottom=False)
