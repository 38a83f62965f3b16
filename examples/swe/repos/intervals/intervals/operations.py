"""Lists of intervals: merged, complemented and subtracted."""

from __future__ import annotations

from collections.abc import Iterable

from intervals.interval import Interval


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union as sorted, disjoint intervals: overlapping or touching ones are joined,
    empty ones dropped."""
    merged: list[Interval] = []
    for interval in sorted(intervals):
        if interval.is_empty():
            continue
        if merged and interval.start <= merged[-1].end:
            last = merged[-1]
            merged[-1] = Interval(last.start, max(last.end, interval.end))
        else:
            merged.append(interval)
    return merged


def gaps(intervals: Iterable[Interval], within: Interval) -> list[Interval]:
    """The parts of `within` that none of `intervals` covers, in order."""
    found = []
    cursor = within.start
    for interval in merge(intervals):
        if interval.end <= cursor:
            continue
        if interval.start >= within.end:
            break
        if interval.start > cursor:
            found.append(Interval(cursor, interval.start))
        cursor = interval.end
    if cursor < within.end:
        found.append(Interval(cursor, within.end))
    return found


def subtract(interval: Interval, removed: Interval) -> list[Interval]:
    """What is left of `interval` without `removed`: none, one or two pieces."""
    if not interval.overlaps(removed):
        return [] if interval.is_empty() else [interval]
    pieces = []
    if removed.start > interval.start:
        pieces.append(Interval(interval.start, removed.start))
    if removed.end < interval.end:
        pieces.append(Interval(removed.end, interval.end))
    return pieces


def total_length(intervals: Iterable[Interval]) -> float:
    """The length of the union: overlaps counted once."""
    return sum(interval.length for interval in merge(intervals))
