"""A double-entry ledger: every transaction's entries sum to zero."""

from __future__ import annotations

from dataclasses import dataclass

from ledger.money import CurrencyMismatch, Money

KINDS = ("asset", "liability", "equity", "income", "expense")
# Accounts whose balance grows with credits: their balance is shown with the sign flipped.
CREDIT_NORMAL = frozenset({"liability", "equity", "income"})


class UnbalancedTransaction(ValueError):
    """A transaction whose debits and credits differ."""


@dataclass(frozen=True)
class Entry:
    """A debit (positive amount) or credit (negative amount) to one account."""

    account: str
    amount: Money


@dataclass(frozen=True)
class Transaction:
    description: str
    entries: tuple[Entry, ...]


class Ledger:
    """Accounts by name and the transactions posted to them, in one currency."""

    def __init__(self, currency: str = "USD") -> None:
        self.currency = currency
        self._kinds: dict[str, str] = {}
        self._transactions: list[Transaction] = []

    def open(self, name: str, kind: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown account kind {kind!r}: use one of {', '.join(KINDS)}")
        if name in self._kinds:
            raise ValueError(f"account {name!r} is already open")
        self._kinds[name] = kind

    def post(self, description: str, *entries: tuple[str, Money]) -> Transaction:
        """Record a transaction of (account, amount) entries that sum to zero."""
        if len(entries) < 2:
            raise ValueError("a transaction needs at least two entries")
        total = 0
        for account, amount in entries:
            if account not in self._kinds:
                raise KeyError(f"no account {account!r}: open it first")
            if amount.currency != self.currency:
                raise CurrencyMismatch(f"{amount} in a {self.currency} ledger")
            total += amount.cents
        if total != 0:
            raise UnbalancedTransaction(f"{description!r} is off by {Money(total, self.currency)}")
        transaction = Transaction(description, tuple(Entry(a, m) for a, m in entries))
        self._transactions.append(transaction)
        return transaction

    def balance(self, account: str) -> Money:
        """The account's balance, positive on its normal side."""
        if account not in self._kinds:
            raise KeyError(f"no account {account!r}")
        cents = 0
        for transaction in self._transactions:
            for entry in transaction.entries:
                if entry.account == account:
                    cents += entry.amount.cents
        if self._kinds[account] in CREDIT_NORMAL:
            cents = -cents
        return Money(cents, self.currency)

    def trial_balance(self) -> list[tuple[str, Money]]:
        """Every account with a non-zero balance, by name."""
        rows = []
        for name in sorted(self._kinds):
            balance = self.balance(name)
            if not balance.is_zero():
                rows.append((name, balance))
        return rows

    def net_income(self) -> Money:
        """Income minus expenses."""
        cents = 0
        for name, kind in self._kinds.items():
            if kind == "income":
                cents += self.balance(name).cents
            elif kind == "expense":
                cents -= self.balance(name).cents
        return Money(cents, self.currency)

    def history(self, account: str) -> list[tuple[str, Money]]:
        """(description, running balance) after each transaction touching the account."""
        sign = -1 if self._kinds[account] in CREDIT_NORMAL else 1
        running = 0
        rows = []
        for transaction in self._transactions:
            change = sum(e.amount.cents for e in transaction.entries if e.account == account)
            if change:
                running += sign * change
                rows.append((transaction.description, Money(running, self.currency)))
        return rows
