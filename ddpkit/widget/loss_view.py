"""The loss view: the loss per step, the mean over the ranks (SVG, small, beside the tabs)."""
from __future__ import annotations

from ddpkit.widget.svg import Scale, Svg, message, nice_ticks
from ddpkit.widget.view import Frame, View

WIDTH, HEIGHT = 300, 210
MAX_POINTS = 500  # longer curves are drawn from every k-th step

NOT_RECORDED = "Loss: not recorded in this run (a recorded ddpkit.experiment.train_step records it)."
PENDING = "Loss: drawn once every rank has reported the first step's loss."


def loss_view(losses: dict[int, float], marker_step: int | None = None, empty: str = NOT_RECORDED) -> str:
    """HTML (an SVG) of ``{step: loss}``; a dot marks ``marker_step``. Without a loss, the words
    ``empty`` (mid-run: that it comes once every rank sent one, not that it was never recorded)."""
    if not losses:
        return message(empty)
    steps = sorted(losses)
    every = -(-len(steps) // MAX_POINTS)
    drawn = steps[::every] + ([steps[-1]] if (len(steps) - 1) % every else [])
    top = max(losses.values())
    svg = Svg(WIDTH, HEIGHT, "ddpkit-loss")
    x = Scale(steps[0], max(steps[-1], steps[0] + 1), 44, WIDTH - 10)
    y = Scale(0.0, top * 1.05 or 1.0, HEIGHT - 34, 30)
    first, last = losses[steps[0]], losses[steps[-1]]
    svg.text(4, 13, "Loss per step (mean over ranks)", size=13, weight="bold")
    svg.text(4, 26, f"step {steps[0]}: {first:.3f}  ->  step {steps[-1]}: {last:.3f}", size=11, fill="#333")
    for v in nice_ticks(0.0, top * 1.05, 4):
        svg.line(44, y(v), WIDTH - 10, y(v), stroke="#eee")
        svg.text(40, y(v) + 3, f"{v:g}", size=11, anchor="end", fill="#555")
    svg.line(44, HEIGHT - 34, WIDTH - 10, HEIGHT - 34, stroke="#888")
    for v in nice_ticks(steps[0], steps[-1], 4):
        if float(v).is_integer():
            svg.text(x(v), HEIGHT - 21, f"{int(v)}", size=11, anchor="middle", fill="#555")
    svg.text((44 + WIDTH - 10) / 2, HEIGHT - 6, "step", size=11, anchor="middle", fill="#444")
    svg.path([(x(s), y(losses[s])) for s in drawn], stroke="#1f77b4", width=1.5,
             title=f"loss, {len(steps)} steps")
    if marker_step in losses:
        svg.circle(x(marker_step), y(losses[marker_step]), 4, "#d62728",
                   title=f"step {marker_step}: loss {losses[marker_step]:.4f}")
    return svg.html()


def _figure(frame: Frame, empty: str) -> str:
    return loss_view(frame.losses, marker_step=frame.marker, empty=empty)


LOSS = View("loss", None, _figure, pending=PENDING, missing=NOT_RECORDED)  # small, beside the tabs
