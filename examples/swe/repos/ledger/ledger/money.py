"""Amounts of money held as whole cents, so sums never drift."""

from __future__ import annotations

from dataclasses import dataclass


class CurrencyMismatch(ValueError):
    """Arithmetic between amounts of different currencies."""


@dataclass(frozen=True, order=True)
class Money:
    """An amount in cents (minor units) of `currency`."""

    cents: int
    currency: str = "USD"

    @classmethod
    def parse(cls, text: str, currency: str = "USD") -> Money:
        """Money from text such as "12.34", "-0.50" or "1,234.5": at most two decimals."""
        cleaned = text.strip().replace(",", "")
        negative = cleaned.startswith("-")
        if negative:
            cleaned = cleaned[1:]
        whole, _, fraction = cleaned.partition(".")
        if not whole.isdigit() or len(fraction) > 2 or (fraction and not fraction.isdigit()):
            raise ValueError(f"not an amount of money: {text!r}")
        cents = int(whole) * 100 + int(fraction.ljust(2, "0"))
        return cls(-cents if negative else cents, currency)

    def __str__(self) -> str:
        sign = "-" if self.cents < 0 else ""
        whole, cents = divmod(abs(self.cents), 100)
        return f"{sign}{whole:,}.{cents:02d} {self.currency}"

    def __add__(self, other: Money) -> Money:
        self._check(other)
        return Money(self.cents + other.cents, self.currency)

    def __sub__(self, other: Money) -> Money:
        self._check(other)
        return Money(self.cents - other.cents, self.currency)

    def __neg__(self) -> Money:
        return Money(-self.cents, self.currency)

    def times(self, factor: float) -> Money:
        """The amount times `factor`, rounded to the nearest cent (halves to even)."""
        return Money(round(self.cents * factor), self.currency)

    def is_zero(self) -> bool:
        return self.cents == 0

    def allocate(self, ratios: list[int]) -> list[Money]:
        """The amount split in proportion to `ratios` without losing a cent: the cents left
        over go one each to the first parts."""
        total = sum(ratios)
        if not ratios or total <= 0:
            raise ValueError(f"ratios must have a positive sum, not {ratios}")
        shares = [self.cents * ratio // total for ratio in ratios]
        remainder = self.cents - sum(shares)
        for index in range(remainder):
            shares[index % len(shares)] += 1
        return [Money(share, self.currency) for share in shares]

    def _check(self, other: Money) -> None:
        if other.currency != self.currency:
            raise CurrencyMismatch(f"cannot combine {self.currency} and {other.currency}")
