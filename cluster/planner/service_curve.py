"""A served figure that depends on one count: ``[[x, y], ...]`` pairs.

The profile's ``service`` section (profile.py) keeps three of them:

- ``step_overhead_s``: what the served loop adds to a decode step of ``x``
  requests (a probe's served ITL with ``x`` streams less the profile's
  in-process step for that batch). One number (profiles written before the
  sweep) is the same overhead at every batch.
- ``prefill_beside_decode_s``: what a served prompt step takes beyond a lone
  one's while ``x`` decode streams run on the box's decode engines.
- ``prefill_after_idle_s``: what a served prompt step takes beyond one that
  follows its engine's previous step at once, after ``x`` seconds idle.

Between two points the figure is linear; below the first and past the last
point it stays at that point's value (a sweep says nothing about a batch it
did not run, and a slope carried past it would grow without a bound).
"""

from __future__ import annotations

import bisect
from typing import Any

Curve = list[tuple[float, float]]


def parse_curve(name: str, value: Any, x_min: float, number: bool = True) -> Curve:
    """``value`` as sorted points; a number (where ``number`` allows one) is
    one point at ``x_min`` (a flat curve). ``ValueError`` naming
    ``service.<name>`` on anything else."""
    if _num(value) and number:
        if value < 0:
            raise ValueError(f"profile: service.{name} must be >= 0")
        return [(x_min, float(value))]
    err = (
        f"profile: service.{name} must be {'a number >= 0 or ' if number else ''}a non-empty "
        f"list of [count >= {x_min:g}, seconds >= 0] pairs with increasing counts"
    )
    if not isinstance(value, list) or not value:
        raise ValueError(err)
    points = []
    for pair in value:
        if (
            not isinstance(pair, (list, tuple))
            or len(pair) != 2
            or not all(_num(v) for v in pair)
            or pair[0] < x_min
            or pair[1] < 0
        ):
            raise ValueError(err)
        points.append((float(pair[0]), float(pair[1])))
    if any(b[0] <= a[0] for a, b in zip(points, points[1:])):
        raise ValueError(err)
    return points


def curve_at(points: Curve, x: float) -> float:
    """The figure at ``x``: linear between points, flat outside them (0 without points)."""
    if not points:
        return 0.0
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    i = bisect.bisect_right([p[0] for p in points], x) - 1
    (x0, y0), (x1, y1) = points[i], points[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def curve_json(value: Any) -> Any:
    """A curve field as the profile's JSON writes it: a number stays a number."""
    if _num(value):
        return value
    return [[x, y] for x, y in value]


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
