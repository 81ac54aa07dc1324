"""Draw a simulated pipeline `Timeline` as a standalone SVG (plain string building).

One row per rank, one box per compute action (forward, backward and, for a split
backward, its weight gradient W in different colours, labelled with the
microbatch), idle time left blank, and the bubble fraction in the title.

    >>> from parc.compiler.schedule import one_f_one_b
    >>> from parc.compiler.schedule_sim import simulate
    >>> svg = timeline_svg(simulate(one_f_one_b(4, 8)), title="1F1B, 4 stages")
    >>> svg.startswith("<svg") and "bubble 27.3%" in svg
    True
"""

from __future__ import annotations

from xml.sax.saxutils import escape

from parc.compiler.schedule import ActionKind, Slot, Timeline, bubble_fraction

__all__ = ["timeline_svg"]

# Blue forward, orange backward (B), green weight gradient (W) of a split backward.
_FILL = {ActionKind.F: "#4e79a7", ActionKind.B: "#f28e2b", ActionKind.W: "#59a14f"}
_NAME = {ActionKind.F: "forward", ActionKind.B: "backward", ActionKind.W: "weight gradient"}
_LEFT = 64  # room for the "rank N" labels
_TOP = 36  # room for the title
_ROW = 30  # height of one rank's row; boxes leave a 4-pixel gap between rows
_FONT = 'font-family="monospace" font-size="12"'


def timeline_svg(timeline: Timeline, *, title: str = "pipeline schedule", unit: int = 28) -> str:
    """An SVG drawing of `timeline`; `unit` is the width in pixels of one time unit."""
    ranks = sorted(timeline.slots)
    width = _LEFT + timeline.makespan * unit + 16
    height = _TOP + len(ranks) * _ROW + 32
    heading = f"{title} — bubble {bubble_fraction(timeline):.1%}"
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" {_FONT}>',
        f"<title>{escape(heading)}</title>",
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="8" y="22" font-size="14">{escape(heading)}</text>',
    ]
    for row, rank in enumerate(ranks):
        y = _TOP + row * _ROW
        parts.append(f'<text x="8" y="{y + 17}">rank {rank}</text>')
        parts += [_box(slot, y, unit) for slot in timeline.compute(rank)]
    drawn = {s.action.kind for r in ranks for s in timeline.compute(r)}
    parts += _legend(_TOP + len(ranks) * _ROW + 20, [k for k in _FILL if k in drawn])
    parts.append("</svg>")
    return "\n".join(parts)


def _box(slot: Slot, y: int, unit: int) -> str:
    kind, microbatch = slot.action.kind, slot.action.microbatch
    x, w = _LEFT + slot.start * unit, (slot.end - slot.start) * unit
    return (
        f'<g class="{kind.value}"><title>{slot.action}: {_NAME[kind]} of microbatch '
        f"{microbatch}, t={slot.start}..{slot.end}</title>"
        f'<rect x="{x}" y="{y}" width="{w}" height="{_ROW - 4}" fill="{_FILL[kind]}" '
        f'stroke="white"/>'
        f'<text x="{x + w / 2:g}" y="{y + 17}" text-anchor="middle" fill="white">'
        f"{microbatch}</text></g>"
    )


def _legend(y: int, kinds: list[ActionKind]) -> list[str]:
    parts = []
    for i, kind in enumerate(kinds):
        x = _LEFT + i * 140
        parts.append(f'<rect x="{x}" y="{y - 10}" width="12" height="12" fill="{_FILL[kind]}"/>')
        parts.append(f'<text x="{x + 18}" y="{y}">{_NAME[kind]}</text>')
    return parts
