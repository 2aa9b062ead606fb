"""Charts drawn on the server as inline SVG: no script, no style attribute (the console's CSP forbids
inline style), only presentation attributes. Each series is told apart by a dash pattern and a marker
shape as well as a colour, and named in a legend, so nothing is said by colour alone; the numbers are
also given as a table beside each chart (the template's), for screen readers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec
from markupsafe import Markup, escape

WIDTH, HEIGHT = 640, 220
LEFT, RIGHT, TOP, BOTTOM = 64, 12, 12, 40
# Colours readable on white and by the common colour blindnesses (Okabe–Ito), each with its own dash.
COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")
DASHES = ("", "6 3", "2 3", "8 3 2 3", "1 2", "10 4", "4 4")
MARKERS = ("circle", "square", "diamond", "triangle", "circle", "square", "diamond")


class Series(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    values: list[float]


def _nice_max(top: float) -> float:
    """A round number at or above ``top`` for the axis (1, 2, 5 × 10^n)."""
    if top <= 0:
        return 1.0
    step = 1.0
    while step * 10 <= top:
        step *= 10
    while step > top:
        step /= 10
    for m in (1, 2, 5, 10):
        if step * m >= top:
            return step * m
    return step * 10


def _marker(shape: str, x: float, y: float, colour: str) -> str:
    if shape == "square":
        return f'<rect x="{x - 3:.1f}" y="{y - 3:.1f}" width="6" height="6" fill="{colour}"/>'
    if shape == "diamond":
        d = f"M{x:.1f} {y - 4:.1f}L{x + 4:.1f} {y:.1f}L{x:.1f} {y + 4:.1f}L{x - 4:.1f} {y:.1f}Z"
        return f'<path d="{d}" fill="{colour}"/>'
    if shape == "triangle":
        return f'<path d="M{x:.1f} {y - 4:.1f}L{x + 4:.1f} {y + 3:.1f}L{x - 4:.1f} {y + 3:.1f}Z" fill="{colour}"/>'
    return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>'


def line_chart(
    chart_id: str,
    title: str,
    desc: str,
    labels: Sequence[str],
    series: Sequence[Series],
    fmt: Callable[[float], str] = lambda v: f"{v:g}",
) -> Markup:
    """An SVG line chart: one line per series over ``labels`` (the x axis, in order), with a ``<title>``
    and ``<desc>`` it is labelled by, a y axis from 0 and a legend naming each line."""
    top = _nice_max(max((v for s in series for v in s.values), default=0.0))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    n = max(len(labels), 1)

    def x(i: int) -> float:
        return LEFT + (plot_w * i / (n - 1) if n > 1 else plot_w / 2)

    def y(v: float) -> float:
        return TOP + plot_h - plot_h * (v / top)

    legend_h = 18 * ((len(series) + 2) // 3)
    height = HEIGHT + legend_h
    t_id, d_id = f"{chart_id}-title", f"{chart_id}-desc"
    parts = [
        f'<svg id="{escape(chart_id)}" class="chart" role="img" aria-labelledby="{t_id} {d_id}" '
        f'viewBox="0 0 {WIDTH} {height}" width="100%" preserveAspectRatio="xMidYMid meet" '
        f'xmlns="http://www.w3.org/2000/svg">',
        f'<title id="{t_id}">{escape(title)}</title>',
        f'<desc id="{d_id}">{escape(desc)}</desc>',
    ]
    figures = {frac: fmt(top * frac) for frac in (0, 0.5, 1)}
    for frac, figure in figures.items():  # gridlines and the y axis' figures
        if frac == 0.5 and figure in (figures[0], figures[1]):
            continue  # a half that reads as 0 or the top (counts of 1): no second "0" on the axis
        gy = y(top * frac)
        parts.append(f'<line x1="{LEFT}" y1="{gy:.1f}" x2="{WIDTH - RIGHT}" y2="{gy:.1f}" stroke="#cccccc"/>')
        parts.append(
            f'<text x="{LEFT - 6}" y="{gy + 4:.1f}" text-anchor="end" font-size="11" fill="#333333">'
            f"{escape(figure)}</text>"
        )
    step = max(1, (len(labels) + 5) // 6)  # at most about six labels on the x axis
    for i, label in enumerate(labels):
        last = i == len(labels) - 1
        if (i % step == 0 and (last or len(labels) - 1 - i >= step / 2)) or last:
            # Labels never crowd the last one, which ends at the plot's edge rather than running past it.
            anchor = "end" if i == len(labels) - 1 and len(labels) > 1 else "middle"
            parts.append(
                f'<text x="{x(i):.1f}" y="{TOP + plot_h + 16}" text-anchor="{anchor}" font-size="11" '
                f'fill="#333333">{escape(label)}</text>'
            )
    parts.append(f'<line x1="{LEFT}" y1="{TOP + plot_h}" x2="{WIDTH - RIGHT}" y2="{TOP + plot_h}" stroke="#333333"/>')
    for k, s in enumerate(series):
        colour, dash, shape = COLOURS[k % len(COLOURS)], DASHES[k % len(DASHES)], MARKERS[k % len(MARKERS)]
        points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(s.values))
        dashed = f' stroke-dasharray="{dash}"' if dash else ""
        parts.append(
            f'<g aria-hidden="true"><polyline points="{points}" fill="none" '
            f'stroke="{colour}" stroke-width="2"{dashed}/>'
        )
        every = max(1, len(s.values) // 12)  # a dozen markers a line: enough to tell it apart, not a crowd
        parts.extend(_marker(shape, x(i), y(v), colour) for i, v in enumerate(s.values) if i % every == 0)
        parts.append("</g>")
        lx, ly = LEFT + (k % 3) * 190, HEIGHT + 4 + 18 * (k // 3)
        parts.append(
            f'<line x1="{lx}" y1="{ly}" x2="{lx + 24}" y2="{ly}" stroke="{colour}" stroke-width="2"{dashed}/>'
            + _marker(shape, lx + 12, ly, colour)
            + f'<text x="{lx + 30}" y="{ly + 4}" font-size="11" fill="#333333">{escape(s.name[:28])}</text>'
        )
    if not series:
        parts.append(
            f'<text x="{LEFT + plot_w / 2:.1f}" y="{TOP + plot_h / 2:.1f}" text-anchor="middle" font-size="13" '
            f'fill="#333333">{escape(desc)}</text>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))
