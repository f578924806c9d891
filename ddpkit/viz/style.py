"""The colours of every figure, plots and widget alike: plain strings, no matplotlib, so the widget's
SVG views read them without importing it.
"""
from __future__ import annotations

from ddpkit.memory import CATEGORIES

# Compute spans and collectives get fixed colours, so every plot reads the same way.
SPAN_COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "sync": "#c44e52", "step": "#55a868"}
OVERLAP_COLOUR = "#2ca02c"
WAIT_COLOUR = "#c9c9c9"  # backward waiting for communication (after its last gradient was ready)

# matplotlib's tab20 less its greens and greys (the timeline's "hidden" and "waiting", and no bucket),
# one colour per bucket or FSDP unit, cycling.
BUCKET_COLOURS = ("#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#d62728",
                  "#ff9896", "#9467bd", "#c5b0d5", "#8c564b", "#c49c94", "#e377c2", "#f7b6d2",
                  "#bcbd22", "#dbdb8d", "#17becf", "#9edae5")

# One colour per memory category, in the order of ``ddpkit.memory.CATEGORIES`` (the one list of them).
CATEGORY_COLOURS = dict(zip(CATEGORIES, ("#4c72b0", "#dd8452", "#55a868", "#8172b3", "#c44e52", "#937860"),
                            strict=True))
OTHER_COLOUR = "#937860"  # the plots' colour for a category not in the list (a job's own)


def bucket_colour(bucket):
    """A colour per bucket index (cycling through ``BUCKET_COLOURS``; None -> grey)."""
    if bucket is None:
        return "#7f7f7f"
    return BUCKET_COLOURS[int(bucket) % len(BUCKET_COLOURS)]


def comm_colour(r):
    """A collective's colour: its bucket's, or a stable colour per FSDP unit name."""
    if r.bucket is not None or r.unit is None:
        return bucket_colour(r.bucket)
    return bucket_colour(sum(map(ord, r.unit)))

