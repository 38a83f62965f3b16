"""The half-open interval [start, end)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Interval:
    """The numbers `start <= x < end`; empty when `start == end`."""

    start: float
    end: float

    def __post_init__(self) -> None:
        if self.end < self.start:
            raise ValueError(f"interval ends at {self.end}, before its start {self.start}")

    @property
    def length(self) -> float:
        return self.end - self.start

    def is_empty(self) -> bool:
        return self.start == self.end

    def contains(self, point: float) -> bool:
        return self.start <= point < self.end

    def overlaps(self, other: Interval) -> bool:
        """Whether the two share at least one point (touching intervals do not)."""
        return self.start < other.end and other.start < self.end

    def touches(self, other: Interval) -> bool:
        """Whether one ends exactly where the other starts."""
        return self.end == other.start or other.end == self.start

    def intersection(self, other: Interval) -> Interval | None:
        start = max(self.start, other.start)
        end = min(self.end, other.end)
        if start >= end:
            return None
        return Interval(start, end)

    def hull(self, other: Interval) -> Interval:
        """The smallest interval holding both."""
        return Interval(min(self.start, other.start), max(self.end, other.end))

    def shift(self, offset: float) -> Interval:
        return Interval(self.start + offset, self.end + offset)

    def split(self, at: float) -> tuple[Interval, Interval]:
        """The parts before and from `at`, which must lie strictly inside."""
        if not self.start < at < self.end:
            raise ValueError(f"{at} is not strictly inside {self}")
        return Interval(self.start, at), Interval(at, self.end)

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"
