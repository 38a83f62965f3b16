from intervals import Interval, gaps, merge, subtract, total_length


def test_merge_overlapping():
    assert merge([Interval(0, 3), Interval(2, 5)]) == [Interval(0, 5)]


def test_merge_touching():
    assert merge([Interval(0, 3), Interval(3, 5)]) == [Interval(0, 5)]


def test_merge_keeps_disjoint_intervals_apart():
    assert merge([Interval(0, 1), Interval(2, 3)]) == [Interval(0, 1), Interval(2, 3)]


def test_merge_sorts():
    assert merge([Interval(5, 6), Interval(0, 1)]) == [Interval(0, 1), Interval(5, 6)]


def test_merge_a_contained_interval():
    assert merge([Interval(0, 10), Interval(2, 3)]) == [Interval(0, 10)]


def test_merge_drops_empty_intervals():
    assert merge([Interval(4, 4), Interval(0, 1)]) == [Interval(0, 1)]


def test_merge_nothing():
    assert merge([]) == []


def test_gaps():
    found = gaps([Interval(2, 3), Interval(5, 7)], within=Interval(0, 10))
    assert found == [Interval(0, 2), Interval(3, 5), Interval(7, 10)]


def test_gaps_ignores_intervals_outside():
    found = gaps([Interval(-5, -1), Interval(20, 30)], within=Interval(0, 10))
    assert found == [Interval(0, 10)]


def test_gaps_of_covered_range():
    assert gaps([Interval(-1, 4), Interval(4, 11)], within=Interval(0, 10)) == []


def test_gaps_with_an_interval_across_the_start():
    assert gaps([Interval(-3, 2)], within=Interval(0, 5)) == [Interval(2, 5)]


def test_subtract_from_the_middle():
    assert subtract(Interval(0, 10), Interval(3, 5)) == [Interval(0, 3), Interval(5, 10)]


def test_subtract_the_start():
    assert subtract(Interval(0, 10), Interval(-2, 4)) == [Interval(4, 10)]


def test_subtract_the_end():
    assert subtract(Interval(0, 10), Interval(7, 12)) == [Interval(0, 7)]


def test_subtract_everything():
    assert subtract(Interval(2, 4), Interval(0, 10)) == []


def test_subtract_something_apart():
    assert subtract(Interval(0, 2), Interval(5, 6)) == [Interval(0, 2)]


def test_total_length_counts_overlaps_once():
    assert total_length([Interval(0, 4), Interval(2, 6), Interval(10, 11)]) == 7
