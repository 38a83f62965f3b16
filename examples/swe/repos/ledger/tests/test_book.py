import pytest
from ledger import CurrencyMismatch, Ledger, Money, UnbalancedTransaction


def test_post_and_balance():
    book = Ledger()
    book.open("cash", "asset")
    book.open("sales", "income")
    book.post("sale", ("cash", Money(500)), ("sales", Money(-500)))
    assert book.balance("cash") == Money(500)
    assert book.balance("sales") == Money(500)


def test_liabilities_are_positive_when_owed():
    book = Ledger()
    book.open("cash", "asset")
    book.open("loan", "liability")
    book.post("borrow", ("cash", Money(1000)), ("loan", Money(-1000)))
    assert book.balance("loan") == Money(1000)


def test_balance_sums_every_transaction():
    book = Ledger()
    book.open("cash", "asset")
    book.open("sales", "income")
    book.post("first", ("cash", Money(200)), ("sales", Money(-200)))
    book.post("second", ("cash", Money(300)), ("sales", Money(-300)))
    assert book.balance("cash") == Money(500)


def test_unbalanced_transactions_are_refused():
    book = Ledger()
    book.open("cash", "asset")
    book.open("sales", "income")
    with pytest.raises(UnbalancedTransaction):
        book.post("bad", ("cash", Money(500)), ("sales", Money(-400)))
    assert book.balance("cash") == Money(0)


def test_a_transaction_needs_two_entries():
    book = Ledger()
    book.open("cash", "asset")
    with pytest.raises(ValueError):
        book.post("lonely", ("cash", Money(0)))


def test_posting_to_an_unknown_account():
    book = Ledger()
    book.open("cash", "asset")
    with pytest.raises(KeyError):
        book.post("sale", ("cash", Money(5)), ("sales", Money(-5)))


def test_posting_another_currency():
    book = Ledger("EUR")
    book.open("cash", "asset")
    book.open("sales", "income")
    with pytest.raises(CurrencyMismatch):
        book.post("sale", ("cash", Money(5)), ("sales", Money(-5)))


def test_open_twice():
    book = Ledger()
    book.open("cash", "asset")
    with pytest.raises(ValueError):
        book.open("cash", "asset")


def test_open_an_unknown_kind():
    book = Ledger()
    with pytest.raises(ValueError):
        book.open("cash", "money")


def test_trial_balance_lists_non_zero_accounts_by_name():
    book = Ledger()
    book.open("sales", "income")
    book.open("cash", "asset")
    book.open("rent", "expense")
    book.post("sale", ("cash", Money(900)), ("sales", Money(-900)))
    assert book.trial_balance() == [("cash", Money(900)), ("sales", Money(900))]


def test_net_income():
    book = Ledger()
    book.open("cash", "asset")
    book.open("sales", "income")
    book.open("rent", "expense")
    book.post("sale", ("cash", Money(1000)), ("sales", Money(-1000)))
    book.post("rent", ("rent", Money(400)), ("cash", Money(-400)))
    assert book.net_income() == Money(600)


def test_history_is_a_running_balance():
    book = Ledger()
    book.open("cash", "asset")
    book.open("sales", "income")
    book.open("rent", "expense")
    book.post("sale", ("cash", Money(1000)), ("sales", Money(-1000)))
    book.post("rent", ("rent", Money(400)), ("cash", Money(-400)))
    assert book.history("cash") == [("sale", Money(1000)), ("rent", Money(600))]


def test_history_of_an_income_account():
    book = Ledger()
    book.open("cash", "asset")
    book.open("sales", "income")
    book.post("sale", ("cash", Money(250)), ("sales", Money(-250)))
    assert book.history("sales") == [("sale", Money(250))]
