"""The desync view: each rank's sequence of collectives around the one where the ranks parted.

It draws a ``ddpkit.comm.desync.Diagnosis`` (what ``ddpkit.DesyncError`` carries): a lane per rank,
a box per collective of the parted group, by index (``AROUND`` before and after), the op and
size written in it (hover: dtype, labels, the line of code that issued it). The parted index is
a red column; a rank that issued nothing there gets a dashed box saying why (its job finished,
it waits in another collective, it is still computing). SVG, as the other views (``svg.py``).
"""
from __future__ import annotations

from ddpkit.comm.desync import describe_entry
from ddpkit.units import human_bytes
from ddpkit.widget.svg import Svg, message

LEFT = 150        # px for the lane labels
CELL = 128        # px per collective
LANE = 44         # px per rank
TOP = 40
OP_COLOURS = {"all_reduce": "#90caf9", "all_gather": "#a5d6a7", "reduce_scatter": "#ffcc80",
              "broadcast": "#ce93d8", "barrier": "#e0e0e0"}
PARTED = "#c62828"


def desync_view(diagnosis) -> str:
    """HTML (an SVG) of ``diagnosis``'s lanes, the parted collective marked."""
    if diagnosis is None:
        return message("No desync: the ranks' collectives matched.")
    d = diagnosis
    ranks = sorted(r for r in d.views if r in d.ranks)
    indices = d.indices()
    # wide enough for its two lines of words too (about 7 and 5.5 px a character): a diagnosis of
    # one collective (the wrong group's) is narrower than its own headline
    title, subtitle = d.summary(), d.headline().partition(": ")[2]
    width = max(LEFT + CELL * len(indices) + 16, int(8 + 7 * len(title)), int(8 + 5.6 * len(subtitle)))
    height = TOP + LANE * len(ranks) + 30
    svg = Svg(width, height, "ddpkit-desync")
    svg.text(4, 14, title, size=12, weight="bold", fill=PARTED)
    svg.text(4, 29, subtitle, size=10, fill="#555")
    col = {i: LEFT + CELL * k for k, i in enumerate(indices)}
    x = col[d.index]
    svg.rect(x - 3, TOP - 4, CELL, LANE * len(ranks) + 8, "#fdecea", stroke=PARTED, stroke_width=1.5,
             title=f"collective #{d.index}: where the ranks parted", class_="ddpkit-parted")
    for i in indices:
        svg.text(col[i] + CELL / 2 - 3, height - 10, f"#{i}", size=10, anchor="middle",
                 fill=PARTED if i == d.index else "#555", weight="bold" if i == d.index else None)
    for k, r in enumerate(ranks):
        y = TOP + k * LANE
        svg.text(LEFT - 8, y + LANE / 2 - 2, f"rank {r}", size=11, anchor="end", weight="bold")
        svg.text(LEFT - 8, y + LANE / 2 + 11, _state_word(d.views[r]), size=9, anchor="end", fill="#555")
        lane = {e.index: e for e in d.lanes.get(r, ())}
        for i in indices:
            e = lane.get(i)
            if e is not None:
                _box(svg, col[i], y, e, parted=i == d.index)
            elif i == d.index:
                svg.rect(col[i], y + 6, CELL - 6, LANE - 12, "#ffffff", stroke=PARTED, stroke_width=1,
                         stroke_dasharray="4,3", title=f"rank {r}: {d.describe(r)}", class_="ddpkit-missing")
                _words_in_box(svg, col[i] + (CELL - 6) / 2, y + LANE / 2, _missing_word(d, r))
    return svg.html()


def _words_in_box(svg: Svg, x: float, y: float, words: str, fits: int = 21) -> None:
    """``words`` centred at (x, y) in a box's 122 px: on two lines where one would spill over
    ("waits in #19 of another group")."""
    if len(words) <= fits or " " not in words:
        svg.text(x, y + 4, words, size=10, anchor="middle", fill=PARTED)
        return
    cut = min((i for i, ch in enumerate(words) if ch == " "), key=lambda i: abs(i - len(words) / 2))
    svg.text(x, y - 1, words[:cut], size=10, anchor="middle", fill=PARTED)
    svg.text(x, y + 10, words[cut + 1:], size=10, anchor="middle", fill=PARTED)


def _box(svg: Svg, x: float, y: float, e, parted: bool) -> None:
    svg.rect(x, y + 6, CELL - 6, LANE - 12, OP_COLOURS.get(e.op, "#eeeeee"),
             stroke=PARTED if parted else "#555", stroke_width=2 if parted else 0.6,
             title=f"#{e.index}: {describe_entry(e)}", class_="ddpkit-collective")
    text = e.op if e.op == "barrier" else f"{e.op} {human_bytes(e.nbytes, 1)}"
    svg.text(x + (CELL - 6) / 2, y + LANE / 2 + 4, text, size=10, anchor="middle")


def _state_word(view) -> str:
    if view.state == "running":
        return f"waiting {view.waited:.1f} s" if view.waiting is not None else "running"
    return {"broken": "collective failed", "stopped": "stopped"}.get(view.state, view.state)


def _missing_word(d, rank: int) -> str:
    v = d.views[rank]
    if v.state == "finished":
        return "finished its job"
    where = v.pending()
    if where is not None and where != (d.key, d.index):
        return f"waits in #{where[1]} of another group"
    return "nothing issued" if v.state in ("failed", "died", "broken") else "not issued yet"
