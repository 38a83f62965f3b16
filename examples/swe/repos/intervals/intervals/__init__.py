"""Half-open intervals of numbers, lists of them and sets made of them."""

from intervals.interval import Interval
from intervals.interval_set import IntervalSet
from intervals.operations import gaps, merge, subtract, total_length

__all__ = ["Interval", "IntervalSet", "gaps", "merge", "subtract", "total_length"]
