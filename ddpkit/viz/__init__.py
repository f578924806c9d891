"""Plots: recorded runs (a Trace), compare results and the cost model's predictions; each returns a Figure.

    from ddpkit.viz import plot_bucket_fill, plot_timeline, plot_memory
    plot_bucket_fill(trace)          # which gradient was ready when, coloured by bucket
    plot_timeline(trace)             # per rank: compute and comm lanes, the overlap shaded
    plot_memory({strategy: [...], ...}, predicted=...)   # memory samples per strategy
    plot_compare(records)            # a compare run (ddpkit.compare): ms/step, bytes, state
    plot_scaling(profile)            # the cost model's predicted scaling to 256 ranks
    plot_scaling_gap(gaps)           # a measured gap to perfect scaling, in parts (trace.gap)
    plot_memory_against_n(sweep)     # memory per rank at 1, 2, 4 ranks (ddpkit.memory_sweep)
    plot_reveal(reveal)              # a prediction against its measurement (ddpkit.predictions)
    plot_ledger(entries)             # a learner's predictions against the measurements
    plot_class(rows)                 # a class's misses, per question

matplotlib is imported inside the functions (ranks that only record never load it); figures use
the object API, so a thread can draw them, and display themselves as PNG in a notebook.
"""
from ddpkit.viz.buckets import plot_bucket_fill
from ddpkit.viz.compare import plot_compare
from ddpkit.viz.gap import plot_scaling_gap
from ddpkit.viz.memory import plot_memory, plot_memory_against_n
from ddpkit.viz.predictions import plot_class, plot_ledger, plot_reveal
from ddpkit.viz.scaling import plot_scaling
from ddpkit.viz.timeline import plot_timeline

__all__ = ["plot_bucket_fill", "plot_timeline", "plot_memory", "plot_compare", "plot_scaling", "plot_scaling_gap",
           "plot_memory_against_n", "plot_reveal", "plot_ledger", "plot_class"]
