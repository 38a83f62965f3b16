"""`LRUCache`: a map that holds at most `bound` entries and forgets the least recently used
first. The gateway's per-rollout and per-attempt memories (open and closed marks, replay
sessions, store tails, recovered deliveries) are all of this kind, so their memory follows the
live rollouts whatever a run's length. `bench/lru_bench.py` compares it with cachetools."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar, overload

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
D = TypeVar("D")


class LRUCache(Generic[K, V]):
    """At most `bound` (at least 1) entries; `get` and `put` make an entry the most recently
    used, `peek`, `in` and `pop` do not. An entry `in_use` says is busy is never evicted, nor
    the one just put: while too few are free, the cache holds more than `bound`, and each `put`
    looks through the busy ones for an entry to evict."""

    __slots__ = ("_entries", "_in_use", "bound")

    def __init__(self, bound: int, *, in_use: Callable[[V], bool] | None = None) -> None:
        if bound < 1:
            raise ValueError(f"an LRUCache holds at least one entry, not {bound}")
        self.bound = bound
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._in_use = in_use

    @overload
    def get(self, key: K) -> V | None: ...
    @overload
    def get(self, key: K, default: D) -> V | D: ...
    def get(self, key: K, default: object = None) -> object:
        value = self._entries.get(key, _MISSING)
        if value is _MISSING:
            return default
        self._entries.move_to_end(key)
        return value

    @overload
    def peek(self, key: K) -> V | None: ...
    @overload
    def peek(self, key: K, default: D) -> V | D: ...
    def peek(self, key: K, default: object = None) -> object:
        """The entry, left where it is in the order of use."""
        return self._entries.get(key, default)

    def put(self, key: K, value: V) -> None:
        entries = self._entries
        entries[key] = value
        entries.move_to_end(key)
        if len(entries) > self.bound:
            self._evict(key)

    @overload
    def pop(self, key: K) -> V | None: ...
    @overload
    def pop(self, key: K, default: D) -> V | D: ...
    def pop(self, key: K, default: object = None) -> object:
        return self._entries.pop(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[K]:
        """The keys, least recently used first."""
        return iter(self._entries)

    def _evict(self, kept: K) -> None:
        entries = self._entries
        if self._in_use is None:
            while len(entries) > self.bound:
                entries.popitem(last=False)
            return
        excess = len(entries) - self.bound
        evicted: list[K] = []
        for key, value in entries.items():  # least recently used first
            if key != kept and not self._in_use(value):
                evicted.append(key)
                if len(evicted) == excess:
                    break
        for key in evicted:
            del entries[key]


_MISSING = object()
