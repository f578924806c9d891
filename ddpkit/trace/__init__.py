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

Nothing here draws: plots (``ddpkit.viz``) and the widget read these records.
"""
from ddpkit.trace.chrome import LANES, to_chrome_trace
from ddpkit.trace.figures import (
    BucketFill, Timeline, bucket_fill, bucket_fill_order, fill_rows, launch_order, layer_of, loss_per_step,
    memory_peak, memory_series, timeline,
)
from ddpkit.trace.measures import (
    backward_phases, collective_bytes, collective_counts, comm_after_backward_ms, comm_bytes_per_step,
    overlap_fraction, overlap_intervals, ring_bytes,
)
from ddpkit.trace.recorder import Recorder
from ddpkit.trace.records import Record, Trace, as_trace
from ddpkit.trace.gap import Gap, StepBreakdown, decompose, format_gaps, step_breakdown

__all__ = [
    "Record", "Recorder", "Trace", "as_trace", "to_chrome_trace", "ring_bytes",
    "comm_bytes_per_step", "collective_counts", "collective_bytes", "overlap_fraction",
    "overlap_intervals", "comm_after_backward_ms", "bucket_fill_order", "launch_order", "LANES",
    "backward_phases", "fill_rows", "layer_of", "memory_series", "memory_peak", "loss_per_step",
    "bucket_fill", "BucketFill", "timeline", "Timeline", "decompose", "step_breakdown", "format_gaps", "Gap",
    "StepBreakdown",
]
