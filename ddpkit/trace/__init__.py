"""The recorder: plain records of what each rank did, merged into a Trace, exported for Perfetto.

    rec = Recorder()                           # inside a rank (recorder.py: the hot path)
    model = OverlappedDDP(module, recorder=rec)
    ...
    trace = Trace.merge(cluster.run(job))      # all ranks' records in one Trace (records.py)
    with cluster.recording(): cluster.run(job) # or: the cluster records and streams (live.py)
    to_chrome_trace(trace, "trace.json")       # open in ui.perfetto.dev (chrome.py)
    overlap_fraction(trace)                    # numbers measured from records (measures.py)
    bucket_fill(trace), timeline(trace)        # what the plots and the widget draw (figures.py)
    decompose(trace_at_1, trace_at_n)          # the gap to perfect scaling, in parts (gap.py)

Nothing here draws: plots (``ddpkit.viz``) and the widget read these records. What strategies and
ddpkit's process group record through is the seam, ``ddpkit.trace.seam`` (``NullRecorder``, the rank's
recorder): importing it loads none of the modules below, which load on first use of their names.
"""
import importlib

# Where each name lives (its one public home is that module; this package hands it on, loaded on
# first use).
_HOMES = {
    **dict.fromkeys(["LANES", "to_chrome_trace"], "chrome"),
    **dict.fromkeys(["BucketFill", "Timeline", "bucket_fill", "bucket_fill_order", "fill_rows", "launch_order",
                     "layer_of", "loss_per_step", "memory_peak", "memory_series", "timeline"], "figures"),
    **dict.fromkeys(["backward_phases", "collective_bytes", "collective_counts", "comm_after_backward_ms",
                     "comm_bytes_per_step", "overlap_fraction", "overlap_intervals"], "measures"),
    **dict.fromkeys(["Recorder"], "recorder"),
    **dict.fromkeys(["Record", "Trace", "as_trace"], "records"),
    **dict.fromkeys(["Gap", "StepBreakdown", "decompose", "format_gaps", "step_breakdown"], "gap"),
}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'ddpkit.trace' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ddpkit.trace.{_HOMES[name]}"), name)
    globals()[name] = value  # looked up once
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
