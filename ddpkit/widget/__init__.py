"""The cluster widget: what a displayed ``ddpkit.Cluster`` shows in a notebook.

    cluster = ddpkit.Cluster(world_size=2)
    cluster            # -> ClusterWidget(cluster): ranks, logs, progress, the record switch
    with cluster.recording():
        cluster.run(job)   # the widget draws bucket fill, timeline, memory and loss as it goes

One job per file:
- ``panel``: ``ClusterWidget``, the whole view, and the observer that keeps it current;
- ``ranks``: a row per rank (status, log tail, traceback);
- ``progress``: the run's progress bar, what the run is part of, and a strategy run's step time
  (with a note where the emulated network was faster than this machine can emulate);
- ``status``: a compact status line in the running cell, a note when a cell shuts the cluster down;
- ``live``: the plots of a recorded run, live and replayed, fed from ``state`` (bounded): a pane
  per view in ``live.VIEWS``, all drawn from one ``view.Frame``;
- ``view``: what a view is (``View``: name, tab title, how it draws a frame, its empty words,
  whether a run opens on its tab) and the ``Frame`` it draws;
- ``fill_view``, ``timeline_view``, ``memory_view``, ``loss_view``: the plots, as SVG (``svg``),
  each ending in its ``View``;
- ``desync_view``: each rank's collectives around the one where they parted (``ddpkit.DesyncError``);
- ``throttle``: at most one update per interval, however often asked.

To add a figure: write ``<name>_view.py`` (the SVG, from a figure of ``ddpkit.trace.figures``,
and its ``View`` at the end, as ``memory_view.py`` does) and add the view to ``live.VIEWS``; the
view's order there is its tab's place. A figure the view needs that the ``Frame`` lacks goes into
``view.Frame`` and the two places that build it (``LivePlots._live_frame``, ``_replay_frame``).

This package is imported only when a cluster is displayed: a rank never pays for ipywidgets.
"""
from __future__ import annotations

import weakref

from ddpkit.widget.panel import ClusterWidget, trace_of

__all__ = ["ClusterWidget", "show", "trace_of"]

_SHOWN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cluster -> its open widget


def show(cluster) -> ClusterWidget:
    """Display ``cluster``'s widget in the notebook: one per cluster while it is open, a new one
    once it was closed. A Cluster shown as a cell's value comes here (``ddpkit`` registers this
    with IPython: the cluster itself knows nothing of widgets)."""
    from IPython.display import display

    widget = _SHOWN.get(cluster)
    if widget is None or widget._closed:
        widget = _SHOWN[cluster] = ClusterWidget(cluster)
    display(widget)
    return widget
