"""A loss curve as a standalone SVG (plain string building, no plotting library)."""

from __future__ import annotations

from collections.abc import Sequence
from xml.sax.saxutils import escape

__all__ = ["loss_curve_svg"]


def loss_curve_svg(
    points: Sequence[tuple[int, float]], *, title: str, width: int = 640, height: int = 320
) -> str:
    """Steps on x, loss on y, with the first and last values labelled."""
    left, right, top, bottom = 56, 16, 36, 36
    steps = [s for s, _ in points] or [0]
    losses = [v for _, v in points] or [0.0]
    x0, x1 = min(steps), max(max(steps), min(steps) + 1)
    y0, y1 = min(losses), max(losses)
    if y1 - y0 < 1e-9:
        y0, y1 = y0 - 0.5, y1 + 0.5

    def xy(step: int, loss: float) -> tuple[float, float]:
        x = left + (step - x0) / (x1 - x0) * (width - left - right)
        y = top + (y1 - loss) / (y1 - y0) * (height - top - bottom)
        return x, y

    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(s, v) for s, v in points))
    ticks = []
    for i in range(5):
        value = y0 + (y1 - y0) * i / 4
        _, y = xy(x0, value)
        ticks.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{width - right}" y2="{y:.1f}" stroke="#ddd"/>'
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{value:.2f}</text>'
        )
    return "\n".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="monospace" font-size="12">',
            f'<rect width="{width}" height="{height}" fill="white"/>',
            f'<text x="{left}" y="22" font-size="14">{escape(title)}</text>',
            *ticks,
            f'<polyline fill="none" stroke="#4e79a7" stroke-width="2" points="{path}"/>',
            f'<text x="{width - right}" y="{height - 10}" text-anchor="end">step {x1}</text>',
            f'<text x="{left}" y="{height - 10}">step {x0}</text>',
            "</svg>",
        ]
    )
