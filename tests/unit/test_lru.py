"""`LRUCache` (gateway/lru.py): it holds at most `bound` entries and forgets the least recently
used first; `get` and `put` make an entry the most recent, `peek`, `in` and `pop` do not; an
entry `in_use` says is busy is never evicted, nor the one just put, even when every entry is
busy (the cache then holds more than `bound` until they are free)."""

from __future__ import annotations

import pytest

from darl.gateway.lru import LRUCache


def filled(bound: int, keys: str) -> LRUCache[str, int]:
    cache: LRUCache[str, int] = LRUCache(bound)
    for i, key in enumerate(keys):
        cache.put(key, i)
    return cache


def test_the_bound_is_kept_and_the_oldest_forgotten() -> None:
    cache = filled(3, "abcde")
    assert len(cache) == 3
    assert list(cache) == ["c", "d", "e"]
    assert "a" not in cache and "b" not in cache
    assert cache.get("e") == 4


def test_get_makes_an_entry_the_most_recent() -> None:
    cache = filled(3, "abc")
    assert cache.get("a") == 0
    assert list(cache) == ["b", "c", "a"]
    cache.put("d", 3)
    assert list(cache) == ["c", "a", "d"]


def test_putting_an_entry_again_replaces_it_and_makes_it_the_most_recent() -> None:
    cache = filled(3, "abc")
    cache.put("a", 10)
    assert list(cache) == ["b", "c", "a"]
    assert len(cache) == 3
    cache.put("d", 3)
    assert "b" not in cache
    assert cache.peek("a") == 10


def test_peek_and_in_leave_the_order_of_use() -> None:
    cache = filled(3, "abc")
    assert cache.peek("a") == 0
    assert "a" in cache
    assert list(cache) == ["a", "b", "c"]
    cache.put("d", 3)
    assert "a" not in cache
    assert list(cache) == ["b", "c", "d"]


def test_a_missing_key_gives_the_default() -> None:
    cache = filled(2, "ab")
    assert cache.get("z") is None
    assert cache.get("z", -1) == -1
    assert cache.peek("z") is None
    assert cache.peek("z", -1) == -1
    assert cache.pop("z") is None
    assert cache.pop("z", -1) == -1
    assert list(cache) == ["a", "b"]


def test_a_falsy_value_is_found() -> None:
    cache: LRUCache[str, int | None] = LRUCache(2)
    cache.put("zero", 0)
    cache.put("none", None)
    assert cache.get("zero", -1) == 0
    assert cache.get("none", -1) is None
    assert cache.peek("zero", -1) == 0


def test_pop_takes_the_entry_out() -> None:
    cache = filled(3, "abc")
    assert cache.pop("b") == 1
    assert "b" not in cache
    assert len(cache) == 2
    cache.put("d", 3)
    assert list(cache) == ["a", "c", "d"]


def test_an_entry_in_use_is_not_evicted() -> None:
    busy = {"a"}
    cache: LRUCache[str, str] = LRUCache(2, in_use=lambda value: value in busy)
    for key in "abc":
        cache.put(key, key)
    # "a" is the least recently used but busy: "b", the next, goes instead.
    assert list(cache) == ["a", "c"]
    busy.clear()
    cache.put("d", "d")
    assert list(cache) == ["c", "d"]


def test_when_every_entry_is_in_use_the_cache_grows_past_its_bound_until_they_are_free() -> None:
    busy = set("abcd")
    cache: LRUCache[str, str] = LRUCache(2, in_use=lambda value: value in busy)
    for key in "abcd":
        cache.put(key, key)
    assert list(cache) == ["a", "b", "c", "d"]
    busy.clear()
    cache.put("e", "e")
    assert len(cache) == 2
    assert list(cache) == ["d", "e"]


def test_the_entry_just_put_is_kept_even_if_not_in_use_and_the_rest_are() -> None:
    busy = {"a", "b"}
    cache: LRUCache[str, str] = LRUCache(2, in_use=lambda value: value in busy)
    for key in "abc":
        cache.put(key, key)
    assert list(cache) == ["a", "b", "c"]
    assert cache.get("c") == "c"


def test_only_as_many_as_the_excess_are_evicted() -> None:
    busy = {"b"}
    cache: LRUCache[str, str] = LRUCache(3, in_use=lambda value: value in busy)
    for key in "abcd":
        cache.put(key, key)
    assert list(cache) == ["b", "c", "d"]


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError):
        LRUCache(0)
