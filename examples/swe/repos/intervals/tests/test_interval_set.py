from intervals import Interval, IntervalSet


def test_a_set_merges_what_it_is_given():
    numbers = IntervalSet([Interval(0, 2), Interval(1, 4), Interval(6, 7)])
    assert list(numbers) == [Interval(0, 4), Interval(6, 7)]
    assert len(numbers) == 2


def test_membership():
    numbers = IntervalSet([Interval(0, 2), Interval(5, 8)])
    assert 0 in numbers
    assert 6 in numbers
    assert 2 not in numbers
    assert 4 not in numbers


def test_membership_before_the_first_interval():
    assert -1 not in IntervalSet([Interval(0, 2)])


def test_membership_in_the_empty_set():
    assert 0 not in IntervalSet()


def test_add_joins_neighbours():
    numbers = IntervalSet([Interval(0, 2), Interval(5, 8)])
    numbers.add(Interval(2, 5))
    assert list(numbers) == [Interval(0, 8)]


def test_remove_splits_an_interval():
    numbers = IntervalSet([Interval(0, 10)])
    numbers.remove(Interval(3, 4))
    assert list(numbers) == [Interval(0, 3), Interval(4, 10)]


def test_remove_across_intervals():
    numbers = IntervalSet([Interval(0, 3), Interval(5, 8)])
    numbers.remove(Interval(2, 6))
    assert list(numbers) == [Interval(0, 2), Interval(6, 8)]


def test_union():
    left = IntervalSet([Interval(0, 2)])
    right = IntervalSet([Interval(1, 3), Interval(9, 10)])
    assert left.union(right) == IntervalSet([Interval(0, 3), Interval(9, 10)])


def test_intersection():
    left = IntervalSet([Interval(0, 5), Interval(8, 12)])
    right = IntervalSet([Interval(3, 9), Interval(11, 20)])
    expected = IntervalSet([Interval(3, 5), Interval(8, 9), Interval(11, 12)])
    assert left.intersection(right) == expected


def test_intersection_with_one_long_interval():
    left = IntervalSet([Interval(1, 2), Interval(3, 4), Interval(5, 6)])
    right = IntervalSet([Interval(0, 10)])
    assert left.intersection(right) == left


def test_total_length():
    assert IntervalSet([Interval(0, 2), Interval(1, 5), Interval(7, 8)]).total_length() == 6


def test_span():
    assert IntervalSet([Interval(3, 4), Interval(7, 9)]).span() == Interval(3, 9)


def test_span_of_the_empty_set():
    assert IntervalSet().span() is None


def test_sets_compare_by_their_intervals():
    assert IntervalSet([Interval(0, 1), Interval(1, 2)]) == IntervalSet([Interval(0, 2)])
    assert IntervalSet([Interval(0, 1)]) != IntervalSet([Interval(0, 2)])


def test_repr():
    assert repr(IntervalSet([Interval(0, 1), Interval(2, 3)])) == "IntervalSet([0, 1), [2, 3))"
