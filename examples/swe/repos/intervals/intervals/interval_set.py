"""A set of numbers stored as sorted, disjoint intervals."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator

from intervals.interval import Interval
from intervals.operations import merge, subtract


class IntervalSet:
    """Numbers as a sorted list of disjoint, non-touching intervals."""

    def __init__(self, intervals: Iterable[Interval] = ()) -> None:
        self._intervals = merge(intervals)

    def __iter__(self) -> Iterator[Interval]:
        return iter(self._intervals)

    def __len__(self) -> int:
        return len(self._intervals)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IntervalSet):
            return NotImplemented
        return self._intervals == other._intervals

    def __repr__(self) -> str:
        return f"IntervalSet({', '.join(str(i) for i in self._intervals)})"

    def __contains__(self, point: float) -> bool:
        starts = [interval.start for interval in self._intervals]
        index = bisect_right(starts, point) - 1
        return index >= 0 and self._intervals[index].contains(point)

    def add(self, interval: Interval) -> None:
        self._intervals = merge([*self._intervals, interval])

    def remove(self, interval: Interval) -> None:
        kept: list[Interval] = []
        for existing in self._intervals:
            kept.extend(subtract(existing, interval))
        self._intervals = kept

    def union(self, other: IntervalSet) -> IntervalSet:
        return IntervalSet([*self._intervals, *other._intervals])

    def intersection(self, other: IntervalSet) -> IntervalSet:
        """Walks both sorted lists once, advancing whichever interval ends first."""
        found = []
        mine, theirs = self._intervals, other._intervals
        i = j = 0
        while i < len(mine) and j < len(theirs):
            common = mine[i].intersection(theirs[j])
            if common is not None:
                found.append(common)
            if mine[i].end < theirs[j].end:
                i += 1
            else:
                j += 1
        return IntervalSet(found)

    def total_length(self) -> float:
        return sum(interval.length for interval in self._intervals)

    def span(self) -> Interval | None:
        """From the first start to the last end; None for the empty set."""
        if not self._intervals:
            return None
        return Interval(self._intervals[0].start, self._intervals[-1].end)
