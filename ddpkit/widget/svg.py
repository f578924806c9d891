"""A few lines of SVG: what the widget's live plots are drawn with.

The live plots redraw a few times a second while ranks train on the same cores, so they are
built as SVG text (string formatting) rather than rendered by matplotlib (laying out and
rasterising a figure: CPU taken from the ranks each time; ``python benchmarks/bench_live.py``
measures what the live widget costs a step). The browser draws them; a test reads them as
strings. Every mark can carry a ``<title>``: hovering shows what it is.
"""
from __future__ import annotations

import html
import math

from ddpkit.units import human_bytes
from ddpkit.viz.style import comm_colour

FONT = "font-family:sans-serif"


def _num(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".") if isinstance(v, float) else str(v)


class Svg:
    """An SVG image of ``width`` x ``height`` pixels, built mark by mark."""

    def __init__(self, width: int, height: int, css_class: str = ""):
        self.width, self.height, self.css_class = width, height, css_class
        self.parts: list[str] = []

    def _add(self, tag: str, attrs: dict, title: str | None = None, body: str = "") -> None:
        a = " ".join(f'{k.rstrip("_").replace("_", "-")}="{_num(v) if isinstance(v, float) else v}"'
                     for k, v in attrs.items() if v is not None)
        inner = (f"<title>{html.escape(title)}</title>" if title else "") + body
        self.parts.append(f"<{tag} {a}>{inner}</{tag}>" if inner else f"<{tag} {a}/>")

    def rect(self, x, y, w, h, fill, title=None, **attrs) -> None:
        self._add("rect", dict(x=float(x), y=float(y), width=float(max(w, 0.8)), height=float(h),
                               fill=fill, **attrs), title)

    def circle(self, cx, cy, r, fill, title=None, **attrs) -> None:
        self._add("circle", dict(cx=float(cx), cy=float(cy), r=float(r), fill=fill, **attrs), title)

    def line(self, x1, y1, x2, y2, stroke="#444", width=1.0, dash=None, **attrs) -> None:
        self._add("line", dict(x1=float(x1), y1=float(y1), x2=float(x2), y2=float(y2), stroke=stroke,
                               stroke_width=width, stroke_dasharray=dash, **attrs))

    def path(self, points, fill="none", stroke=None, width=1.0, title=None, closed=False, **attrs) -> None:
        if not points:
            return
        d = "M" + "L".join(f"{_num(float(x))},{_num(float(y))}" for x, y in points) + ("Z" if closed else "")
        self._add("path", dict(d=d, fill=fill, stroke=stroke, stroke_width=width if stroke else None, **attrs),
                  title)

    def text(self, x, y, s, size=11, anchor="start", weight=None, fill="#222", title=None, **attrs) -> None:
        self._add("text", dict(x=float(x), y=float(y), font_size=size, text_anchor=anchor, font_weight=weight,
                               fill=fill, style=FONT, **attrs), title, html.escape(str(s)))

    def html(self) -> str:
        cls = f' class="{self.css_class}"' if self.css_class else ""
        return (f'<svg{cls} xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height}" '
                f'viewBox="0 0 {self.width} {self.height}" style="max-width:100%;height:auto">'
                + "".join(self.parts) + "</svg>")


class Scale:
    """A linear map from data (``lo``..``hi``) to pixels (``a``..``b``)."""

    def __init__(self, lo: float, hi: float, a: float, b: float):
        if hi <= lo:
            hi = lo + 1.0
        self.lo, self.hi, self.a, self.b = lo, hi, a, b

    def __call__(self, v: float) -> float:
        return self.a + (v - self.lo) * (self.b - self.a) / (self.hi - self.lo)

    def ticks(self, n: int = 6) -> list[float]:
        return nice_ticks(self.lo, self.hi, n)


def nice_ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    """Round numbers (1, 2, 5 x 10^k apart) from ``lo`` to ``hi``, about ``n`` of them."""
    span = hi - lo
    if span <= 0:
        return [lo]
    raw = span / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step + 1e-9) + 1)]


def x_axis(svg: Svg, scale: Scale, y: float, label: str, fmt=lambda v: f"{v:g}") -> None:
    """Ticks and their numbers along ``y``, the label under them."""
    svg.line(scale.a, y, scale.b, y, stroke="#888")
    for v in scale.ticks():
        x = scale(v)
        svg.line(x, y, x, y + 4, stroke="#888")
        svg.text(x, y + 15, fmt(v), size=11, anchor="middle", fill="#555")
    svg.text((scale.a + scale.b) / 2, y + 30, label, size=12, anchor="middle", fill="#444")


def message(text: str) -> str:
    """What a view shows instead of a plot: plain words, never empty axes."""
    return f"<div class='ddpkit-plot-message' style='padding:12px;color:#555;{FONT}'>{html.escape(text)}</div>"


def collective_bars(svg: Svg, records, y: float, height: float, ms, t_end: int, when) -> None:
    """One bar per collective record, launch to completion (``t_end`` while still in flight), in
    its bucket's or unit's colour; the hover title says what, how many bytes, then ``when(r)``."""
    for r in records:
        end = r.end_ns if r.end_ns is not None else t_end
        which = f"bucket {r.bucket}" if r.bucket is not None else (r.unit or "")
        svg.rect(ms(r.start_ns), y, ms(end) - ms(r.start_ns), height, comm_colour(r), stroke="#333",
                 stroke_width=0.5, title=f"{r.name} {which}: {human_bytes(r.nbytes, 1)}, {when(r)}")
