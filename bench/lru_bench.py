"""The bounded LRU maps of the gateway's hot path, per operation: `darl.gateway.lru.LRUCache`
against `cachetools.LRUCache` and an OrderedDict moved and trimmed inline (no call of its own:
the floor). Prints nanoseconds per get (a hit), put (a key already held) and put that evicts
(a new key into a full map); asserts nothing.

    .venv/bin/python -m bench.lru_bench [--bound 100000] [--ops 200000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import time
from collections import OrderedDict
from collections.abc import Callable

import cachetools

from darl.gateway.lru import LRUCache

Key = tuple[str, int]
# name -> (a map, full at `bound`; its get loop; its put loop), each loop over a list of keys.
Loops = tuple[Callable[[list[Key]], None], Callable[[list[Key]], None]]


def keys(count: int, start: int = 0) -> list[Key]:
    """Keys shaped as the gateway's: (rollout id, attempt)."""
    return [(f"rollout-{i // 8:08d}", i % 8) for i in range(start, start + count)]


def lru_cache_loops(bound: int) -> Loops:
    lru: LRUCache[Key, bool] = LRUCache(bound)

    def gets(batch: list[Key]) -> None:
        get = lru.get
        for key in batch:
            get(key)

    def puts(batch: list[Key]) -> None:
        put = lru.put
        for key in batch:
            put(key, True)

    return gets, puts


def cachetools_loops(bound: int) -> Loops:
    lru: cachetools.LRUCache[Key, bool] = cachetools.LRUCache(maxsize=bound)

    def gets(batch: list[Key]) -> None:
        get = lru.get
        for key in batch:
            get(key)

    def puts(batch: list[Key]) -> None:
        for key in batch:
            lru[key] = True

    return gets, puts


def ordered_dict_loops(bound: int) -> Loops:
    entries: OrderedDict[Key, bool] = OrderedDict()

    def gets(batch: list[Key]) -> None:
        for key in batch:
            if entries.get(key) is not None:
                entries.move_to_end(key)

    def puts(batch: list[Key]) -> None:
        for key in batch:
            entries[key] = True
            entries.move_to_end(key)
            while len(entries) > bound:
                entries.popitem(last=False)

    return gets, puts


IMPLEMENTATIONS: dict[str, Callable[[int], Loops]] = {
    "LRUCache": lru_cache_loops,
    "cachetools": cachetools_loops,
    "OrderedDict": ordered_dict_loops,
}


def per_op(loop: Callable[[list[Key]], None], batches: list[list[Key]]) -> float:
    """The best run over the batches, in nanoseconds per operation."""
    best = None
    for batch in batches:
        started = time.perf_counter_ns()
        loop(batch)
        took = time.perf_counter_ns() - started
        best = took if best is None else min(best, took)
    assert best is not None
    return best / len(batches[0])


def measure(make: Callable[[int], Loops], bound: int, ops: int, repeat: int) -> list[float]:
    gets, puts = make(bound)
    held = keys(bound)
    puts(held)
    hits = [held[(i * 7919) % bound] for i in range(ops)]
    fresh = keys(ops * repeat, start=bound)
    evicting = [fresh[i * ops : (i + 1) * ops] for i in range(repeat)]
    return [per_op(gets, [hits] * repeat), per_op(puts, [hits] * repeat), per_op(puts, evicting)]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--bound", type=int, default=100_000)
    parser.add_argument("--ops", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(f"bound {args.bound:,}, {args.ops:,} operations, best of {args.repeat} (ns/op)")
    print(f"{'':<14}{'get':>8}{'put':>8}{'put+evict':>12}")
    for name, make in IMPLEMENTATIONS.items():
        get, put, evict = measure(make, args.bound, args.ops, args.repeat)
        print(f"{name:<14}{get:>8.0f}{put:>8.0f}{evict:>12.0f}")


if __name__ == "__main__":
    main()
