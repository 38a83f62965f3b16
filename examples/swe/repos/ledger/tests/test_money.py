import pytest
from ledger import CurrencyMismatch, Money


def test_parse_whole_and_cents():
    assert Money.parse("12.34") == Money(1234)


def test_parse_one_decimal():
    assert Money.parse("7.5") == Money(750)


def test_parse_no_decimals():
    assert Money.parse("3") == Money(300)


def test_parse_thousands_separators():
    assert Money.parse("1,234.56") == Money(123456)


def test_parse_negative():
    assert Money.parse("-0.05") == Money(-5)


def test_parse_keeps_the_currency():
    assert Money.parse("2.00", currency="EUR") == Money(200, "EUR")


def test_parse_rejects_three_decimals():
    with pytest.raises(ValueError):
        Money.parse("1.234")


def test_parse_rejects_words():
    with pytest.raises(ValueError):
        Money.parse("ten")


def test_str():
    assert str(Money(123456)) == "1,234.56 USD"


def test_str_of_small_negative_amounts():
    assert str(Money(-5, "EUR")) == "-0.05 EUR"


def test_add_and_subtract():
    assert Money(150) + Money(275) == Money(425)
    assert Money(150) - Money(275) == Money(-125)


def test_negate():
    assert -Money(300) == Money(-300)


def test_currencies_do_not_mix():
    with pytest.raises(CurrencyMismatch):
        Money(100, "USD") + Money(100, "EUR")


def test_times_rounds_to_the_cent():
    assert Money(1000).times(0.0725) == Money(72)


def test_times_rounds_halves_to_even():
    assert Money(5).times(0.5) == Money(2)
    assert Money(7).times(0.5) == Money(4)


def test_is_zero():
    assert Money(0).is_zero()
    assert not Money(1).is_zero()
