"""What the matplotlib plots share: a notebook-friendly Figure, byte units, the words of an empty panel.

Their colours are ``style.py``'s, which the widget's SVG views share."""
from __future__ import annotations

import functools
import io

WIDTH_IN = 9.0  # readable at notebook width


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
