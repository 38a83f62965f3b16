import pytest
from intervals import Interval


def test_length():
    assert Interval(2, 7).length == 5


def test_an_interval_cannot_end_before_it_starts():
    with pytest.raises(ValueError):
        Interval(5, 4)


def test_empty_interval():
    assert Interval(3, 3).is_empty()
    assert not Interval(3, 4).is_empty()


def test_contains_its_start_but_not_its_end():
    interval = Interval(1, 5)
    assert interval.contains(1)
    assert interval.contains(4.5)
    assert not interval.contains(5)


def test_does_not_contain_points_before_it():
    assert not Interval(1, 5).contains(0)


def test_overlapping_intervals():
    assert Interval(0, 5).overlaps(Interval(4, 8))
    assert Interval(4, 8).overlaps(Interval(0, 5))


def test_touching_intervals_do_not_overlap():
    assert not Interval(0, 5).overlaps(Interval(5, 8))


def test_touching_intervals_touch():
    assert Interval(0, 5).touches(Interval(5, 8))
    assert Interval(5, 8).touches(Interval(0, 5))
    assert not Interval(0, 5).touches(Interval(6, 8))


def test_intersection():
    assert Interval(0, 5).intersection(Interval(3, 9)) == Interval(3, 5)


def test_intersection_of_nested_intervals():
    assert Interval(0, 10).intersection(Interval(2, 4)) == Interval(2, 4)


def test_intersection_of_touching_intervals_is_none():
    assert Interval(0, 5).intersection(Interval(5, 9)) is None


def test_hull():
    assert Interval(0, 2).hull(Interval(5, 9)) == Interval(0, 9)


def test_shift():
    assert Interval(1, 3).shift(10) == Interval(11, 13)


def test_split():
    assert Interval(0, 10).split(4) == (Interval(0, 4), Interval(4, 10))


def test_split_at_an_end_is_an_error():
    with pytest.raises(ValueError):
        Interval(0, 10).split(10)


def test_str():
    assert str(Interval(1, 2)) == "[1, 2)"
