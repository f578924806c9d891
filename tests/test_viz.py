"""Every plot renders to a non-empty PNG with the Agg canvas, from full and from empty records."""
from __future__ import annotations

import io
import subprocess
import sys

import pytest

from ddpkit.memory_formulas import predicted_model_state, zero_predictions
from ddpkit.trace import Record, Trace
from ddpkit.viz import plot_bucket_fill, plot_memory, plot_timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=60)
    return buf.getvalue()


def assert_png(fig):
    data = png(fig)
    assert data.startswith(PNG_MAGIC) and len(data) > 5_000
    return data


def synthetic_trace(ranks=2, steps=2, buckets=3, grads_per_bucket=2, late_steps=()) -> Trace:
    """A plausible overlapped-DDP trace: grads ready in backward, bucket i launched when full
    (in ``late_steps`` the all-reduces start when backward ends instead, as in bucketed DDP)."""
    recs = []
    for rank in range(ranks):
        t = 1_000_000 * rank  # ranks a little out of step
        for step in range(steps):
            recs.append(Record("span", "compute", "forward", rank, step, t, t + 2_000_000))
            bw0, bw1 = t + 2_000_000, t + 8_000_000
            recs.append(Record("span", "compute", "backward", rank, step, bw0, bw1))
            g = bw0
            late = bw1 - (bw0 + 700_000 * grads_per_bucket) if step in late_steps else 0
            for b in range(buckets):
                for j in range(grads_per_bucket):
                    g += 700_000
                    recs.append(Record("instant", "grad_ready", f"layers.{b}.{j}.weight", rank, step, g, bucket=b))
                recs.append(Record("span", "comm", "all_reduce", rank, step, g + late, g + late + 1_800_000,
                                   nbytes=4096 * (b + 1), bucket=b))
            recs.append(Record("span", "compute", "sync", rank, step, bw1, bw1 + 300_000))
            recs.append(Record("span", "compute", "step", rank, step, bw1 + 300_000, bw1 + 1_300_000))
            recs.append(Record("counter", "memory", "memory", rank, step, bw1 + 1_300_000,
                               args={"parameters": 4000, "gradients": 4000, "optimizer_state": 8000,
                                     "communication_buffers": 4000, "activations": 1500}))
            t = bw1 + 2_000_000
    return Trace(recs, world_size=ranks, backend="gloo")


def test_bucket_fill_renders_a_row_per_layer():
    fig = plot_bucket_fill(synthetic_trace(), rank=1, step=0)
    assert_png(fig)
    top = fig.axes[0]
    assert "rank 1, step 0" in top.get_title()
    assert [t.get_text() for t in top.get_yticklabels()][:2] == ["layers.0.0", "layers.0.1"]
    assert [t.get_text() for t in fig.axes[1].get_yticklabels()] == [f"bucket {b} all_reduce" for b in range(3)]
    assert "ms" in fig.axes[1].get_xlabel()


def test_bucket_fill_of_the_default_mlp_fits_a_screen_with_readable_labels():
    # 66 gradients: a weight and a bias per layer, one row each layer (33), labels at 9 pt
    recs = [Record("span", "compute", "backward", 0, 0, 0, 70_000_000)]
    names = ["head.bias", "head.weight"]
    names += [f"layers.{i}.0.{w}" for i in reversed(range(32)) for w in ("bias", "weight")]
    recs += [Record("instant", "grad_ready", n, 0, 0, 1_000_000 * (k + 1), bucket=k // 20) for k, n in enumerate(names)]
    fig = plot_bucket_fill(Trace(recs, 1), rank=0, step=0)
    labels = fig.axes[0].get_yticklabels()
    assert [t.get_text() for t in labels][:3] == ["head", "layers.31.0", "layers.30.0"] and len(labels) == 33
    assert all(t.get_fontsize() >= 9 for t in labels)
    assert fig.get_size_inches()[1] < 10
    many = [Record("instant", "grad_ready", f"layers.{i}.weight", 0, 0, i, bucket=0) for i in range(200)]
    fig = plot_bucket_fill(Trace(recs[:1] + many, 1), rank=0, step=0)
    assert len(fig.axes[0].get_yticklabels()) <= 36  # neighbours merged: "layers.0 .. layers.5"
    assert " .. " in fig.axes[0].get_yticklabels()[0].get_text()


def test_timeline_renders_all_steps_one_step_and_a_list():
    trace = synthetic_trace()
    for steps in (None, -1, [0, 1]):
        fig = plot_timeline(trace, steps=steps)
        assert_png(fig)
        ax = fig.axes[0]
        labels = [t.get_text() for t in ax.get_yticklabels()]
        assert labels == ["rank 0 compute", "bucket 0", "bucket 1", "bucket 2"] + \
                         ["rank 1 compute", "bucket 0", "bucket 1", "bucket 2"]
        assert "hidden under backward" in ax.get_title() and ax.get_xlabel() == "time (ms)"


def test_timeline_title_is_overlap_fraction_of_the_steps_drawn_and_splits_backward():
    from matplotlib.colors import to_hex

    from ddpkit.viz.style import WAIT_COLOUR

    # step 1: buckets launched at +1.4, +2.8, +4.2 ms into backward, 1.8 ms each: 4.6 ms of
    # communication, 2.8 of it before the last gradient (61%); step 0: all of it after backward
    trace = synthetic_trace(late_steps=(0,))
    for steps, shown in ((-1, "61%"), ([0], "0%"), (None, "30%")):
        title = plot_timeline(trace, steps=steps).axes[0].get_title()
        assert f"{shown} of communication" in title, (steps, title)
    trace = synthetic_trace()
    # backward computes until its last gradient is ready, then waits (a grey bar of its own)
    ax = plot_timeline(trace, steps=-1).axes[0]
    faces = {to_hex(c) for coll in ax.collections for c in coll.get_facecolors()}
    assert WAIT_COLOUR in faces


def test_memory_plot_per_rank_and_across_strategies_with_predictions():
    trace = synthetic_trace()
    assert_png(plot_memory(trace))  # each rank at its peak
    n = 1000
    per_rank = lambda k: [{"parameters": 4 * n / k, "gradients": 4 * n / k, "optimizer_state": 8 * n / k}] * 2  # noqa: E731
    fig = plot_memory({"overlapped": trace, "zero1": per_rank(1), "fsdp": per_rank(2)},
                      predicted=zero_predictions(n, 2))
    assert_png(fig)
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    # strategies are matched to their ZeRO stage's formula bar, labelled with the stage
    assert ticks.count("0") == 3 and ticks.count("1") == 3 and {"DDP", "ZeRO-1", "ZeRO-3"} <= set(ticks)
    # and no two labels under the bars overprint each other (five strategies, two ranks each)
    fig = plot_memory({s: per_rank(1) for s in ("overlapped", "sharded_optimizer", "zero1", "zero2", "fsdp")},
                      predicted={s: predicted_model_state(s, n, 2) for s in ("overlapped", "sharded_optimizer",
                                                                             "zero1", "zero2", "fsdp")})
    fig.canvas.draw()
    ax = fig.axes[0]
    boxes = [t.get_window_extent() for t in ax.get_xticklabels()] + [t.get_window_extent() for t in ax.texts]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), "labels overprint"
    assert fig.axes[0].get_ylabel().startswith("memory per rank (KiB)")
    # a variant keyed by its own label (notebook 12's "fsdp by class"): its formula bar still says
    # the stage, not the group's name (which stands under its bars, and overprinted rank 1's tick)
    fig = plot_memory({"fsdp": per_rank(2), "fsdp by class": per_rank(2)},
                      predicted={s: predicted_model_state("fsdp", n, 2) for s in ("fsdp", "fsdp by class")})
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert ticks == ["0", "1", "ZeRO-3", "0", "1", "ZeRO-3"], ticks


@pytest.mark.parametrize("plot", [plot_bucket_fill, plot_timeline, plot_memory])
def test_empty_records_render_a_message_not_an_error(plot):
    assert png(plot(Trace([], world_size=2))).startswith(PNG_MAGIC)


def test_a_figure_shows_itself_in_a_notebook():
    data = plot_timeline(synthetic_trace())._repr_png_()
    assert data.startswith(PNG_MAGIC)


def test_importing_viz_does_not_import_matplotlib():
    code = "import sys, ddpkit.viz; assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
