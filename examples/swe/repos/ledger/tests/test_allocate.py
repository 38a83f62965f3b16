import pytest
from ledger import Money


def test_allocate_evenly():
    assert Money(900).allocate([1, 1, 1]) == [Money(300), Money(300), Money(300)]


def test_allocate_gives_leftover_cents_to_the_first_parts():
    assert Money(100).allocate([1, 1, 1]) == [Money(34), Money(33), Money(33)]


def test_allocate_two_leftover_cents():
    assert Money(5).allocate([1, 1, 1]) == [Money(2), Money(2), Money(1)]


def test_allocate_by_ratio():
    assert Money(1000).allocate([3, 7]) == [Money(300), Money(700)]


def test_allocate_by_uneven_ratio():
    assert Money(1001).allocate([1, 2]) == [Money(334), Money(667)]


def test_allocate_never_loses_a_cent():
    parts = Money(1003).allocate([2, 3, 5])
    assert sum(part.cents for part in parts) == 1003


def test_allocate_with_a_zero_ratio():
    assert Money(10).allocate([0, 1]) == [Money(0), Money(10)]


def test_allocate_keeps_the_currency():
    assert Money(3, "EUR").allocate([1, 2]) == [Money(1, "EUR"), Money(2, "EUR")]


def test_allocate_needs_ratios():
    with pytest.raises(ValueError):
        Money(10).allocate([])


def test_allocate_needs_a_positive_total():
    with pytest.raises(ValueError):
        Money(10).allocate([0, 0])
