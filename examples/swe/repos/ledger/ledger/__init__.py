"""Money in minor units and a double-entry ledger of accounts and transactions."""

from ledger.book import Entry, Ledger, Transaction, UnbalancedTransaction
from ledger.money import CurrencyMismatch, Money

__all__ = ["CurrencyMismatch", "Entry", "Ledger", "Money", "Transaction", "UnbalancedTransaction"]
