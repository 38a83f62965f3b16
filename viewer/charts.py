"""Per-step curves of a training run drawn as small server-side SVG charts (no JavaScript
plotting library, nothing fetched by the browser)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

from markupsafe import Markup

from darl.workflows.training_state import StepRecord

WIDTH, HEIGHT, PAD = 360, 150, 32
# The plot starts right of the y axis' labels (up to 7 characters: "1.23e+03"), never under them.
LEFT = 56


@dataclass(frozen=True)
class Curve:
    title: str
    value: Callable[[StepRecord], float | None]
    band: Callable[[StepRecord], float] | None = None


CURVES = (
    Curve("reward mean (± std)", lambda r: r.reward_mean, lambda r: r.reward_std),
    Curve("success rate", lambda r: r.success_rate),
    Curve("validation reward", lambda r: r.val_reward_mean),
    Curve("response tokens (mean)", lambda r: r.response_tokens_mean),
    Curve("paused seconds", lambda r: r.paused_seconds),
    Curve("staleness (mean)", lambda r: r.staleness_mean),
    Curve("rollouts / s", lambda r: r.rollouts_per_minute / 60.0),
)


def _scale(
    lo: float, hi: float, size: float, flip: bool, start: float = PAD
) -> Callable[[float], float]:
    span = (hi - lo) or 1.0

    def at(value: float) -> float:
        fraction = (value - lo) / span
        return start + (1 - fraction if flip else fraction) * (size - start - PAD)

    return at


def chart(curve: Curve, records: Sequence[StepRecord]) -> Markup:
    points = [
        (r.step, value, curve.band(r) if curve.band else 0.0)
        for r in records
        if (value := curve.value(r)) is not None
    ]
    title = escape(curve.title)
    head = (
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
        f'role="img" aria-label="{title}" data-points="{len(points)}">'
        f'<text x="{PAD}" y="16" class="title">{title}</text>'
    )
    if not points:
        return Markup(head + f'<text x="{PAD}" y="{HEIGHT / 2}">no steps yet</text></svg>')
    steps = [s for s, _, _ in points]
    lows = [v - b for _, v, b in points]
    highs = [v + b for _, v, b in points]
    x = _scale(
        min(steps), max(steps) if len(steps) > 1 else min(steps) + 1, WIDTH, False, start=LEFT
    )
    y = _scale(min(lows), max(highs), HEIGHT, True)
    parts = [head]
    if curve.band is not None:
        outline = [(x(s), y(v + b)) for s, v, b in points]
        outline += [(x(s), y(v - b)) for s, v, b in reversed(points)]
        parts.append(
            '<polygon class="band" points="'
            + " ".join(f"{px:.1f},{py:.1f}" for px, py in outline)
            + '"/>'
        )
    line = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v, _ in points)
    parts.append(f'<polyline class="line" points="{line}"/>')
    for s, v, _ in points:
        parts.append(
            f'<circle class="pt" cx="{x(s):.1f}" cy="{y(v):.1f}" r="2.5" data-step="{s}">'
            f"<title>step {s}: {v:.4g}</title></circle>"
        )
    parts.append(
        f'<text x="{LEFT}" y="{HEIGHT - 6}" class="axis">step {min(steps)}</text>'
        f'<text x="{WIDTH - PAD}" y="{HEIGHT - 6}" class="axis" text-anchor="end">'
        f"step {max(steps)}</text>"
        f'<text x="{LEFT - 6}" y="{PAD + 4}" class="axis" text-anchor="end">'
        f"{max(highs):.3g}</text>"
        f'<text x="{LEFT - 6}" y="{HEIGHT - PAD}" class="axis" text-anchor="end">'
        f"{min(lows):.3g}</text></svg>"
    )
    return Markup("".join(parts))


def charts(records: Sequence[StepRecord]) -> list[Markup]:
    return [chart(curve, records) for curve in CURVES]
