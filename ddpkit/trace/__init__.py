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

Nothing here draws (``ddpkit.viz`` and the widget read these records). The modules load on first
use of their names; the seam (``ddpkit.trace.seam``) loads none of them.
"""
from ddpkit.lazy import lazy_names

# Where each name lives (its one public home is that module; this package hands it on, loaded on
# first use). Every public function and class of these modules is here (tests/test_package_face.py).
_HOMES = {
    **dict.fromkeys(["LANES", "same_collectives", "to_chrome_trace"], ".chrome"),
    **dict.fromkeys(["BucketFill", "RankLanes", "Timeline", "bucket_fill", "bucket_fill_order", "comm_rows",
                     "fill_rows", "launch_order", "layer_of", "loss_per_step", "memory_peak", "memory_series",
                     "pack_rows", "packed_label", "peak_of", "timeline"], ".figures"),
    **dict.fromkeys(["backward_phases", "collective_bytes", "collective_counts", "comm_after_backward_ms",
                     "comm_bytes_per_step", "overlap_fraction", "overlap_intervals"], ".measures"),
    **dict.fromkeys(["Recorder"], ".recorder"),
    **dict.fromkeys(["Record", "Trace", "as_trace"], ".records"),
    **dict.fromkeys(["Gap", "StepBreakdown", "decompose", "format_gaps", "step_breakdown", "step_ends"], ".gap"),
}
__all__ = list(_HOMES)
__getattr__, __dir__ = lazy_names(globals(), _HOMES)
