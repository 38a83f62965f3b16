"""The live calls of each attempt that are at a policy server through this gateway
(`CallsInFlight`). An attempt that resumes by replay (rule 10) and sends a request its record
does not hold waits for its lineage's calls still in flight here before it goes live: the
agent lost with one of them in flight asked what its successor asks again, and that answer,
recorded unreceived when it comes, is then replayed instead of generated twice. Only this
replica's calls are seen: a balancer that sends an attempt's calls to the replica of its
rollout (hashing by rollout) sends them here.

A call made with an `Idempotency-Key` is held under its key too, from its arrival until it is
recorded or failed: a retry with the key waits for it (`key_free`), then is answered from its
record (`idempotency`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

log = logging.getLogger(__name__)

Key = tuple[str, int]
# An attempt's call by its `Idempotency-Key`.
IdempotentKey = tuple[str, int, str]


class CallsInFlight:
    def __init__(self) -> None:
        # Per attempt, a future per live call, done when the call is recorded or failed. A
        # streamed call's is the task that reads its answer to the end, held here until then.
        self._calls: dict[Key, set[asyncio.Future[Any]]] = {}
        # Per attempt and `Idempotency-Key`, the same for the calls made with the key.
        self._keyed: dict[IdempotentKey, set[asyncio.Future[Any]]] = {}

    @contextlib.contextmanager
    def holding(self, rollout_id: str, attempt: int) -> Iterator[None]:
        """A live call of the attempt is at work for as long as this lasts."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        key = (rollout_id, attempt)
        self._add(key, done)
        try:
            yield
        finally:
            done.set_result(None)
            self._discard(key, done)

    def hold_until_done(
        self,
        rollout_id: str,
        attempt: int,
        task: asyncio.Task[Any],
        idempotency_key: str | None = None,
    ) -> None:
        """A live call of the attempt (made with `idempotency_key`, maybe) is at work until
        `task` ends (a reference is kept)."""
        key = (rollout_id, attempt)
        self._add(key, task)
        task.add_done_callback(lambda done: self._ended(key, done))
        if idempotency_key is not None:
            keyed = (rollout_id, attempt, idempotency_key)
            self._keyed.setdefault(keyed, set()).add(task)
            task.add_done_callback(lambda done: _discard(self._keyed, keyed, done))

    @contextlib.contextmanager
    def holding_key(self, rollout_id: str, attempt: int, idempotency_key: str) -> Iterator[None]:
        """A call of the attempt made with `idempotency_key` is at work for as long as this
        lasts (and, streamed, until its answer is read: `hold_until_done`)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        key = (rollout_id, attempt, idempotency_key)
        self._keyed.setdefault(key, set()).add(done)
        try:
            yield
        finally:
            done.set_result(None)
            _discard(self._keyed, key, done)

    async def key_free(
        self, rollout_id: str, attempt: int, idempotency_key: str, timeout: float
    ) -> bool:
        """Wait, at most `timeout` seconds, until no call of the attempt made with
        `idempotency_key` is at work here; False when one still is. Nothing awaited between
        this and `holding_key` lets another call with the key in."""
        key = (rollout_id, attempt, idempotency_key)
        deadline = asyncio.get_running_loop().time() + timeout
        while busy := self._keyed.get(key):
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return False
            log.info("%s attempt %d: a call with its idempotency key is in flight", *key[:2])
            await asyncio.wait(set(busy), timeout=left)
        return True

    async def settled(self, rollout_id: str, attempts: Sequence[int], timeout: float) -> bool:
        """Wait, at most `timeout` seconds, until no call of these attempts of the rollout is
        in flight here; False at once when none is."""
        waiting = {f for a in attempts for f in self._calls.get((rollout_id, a), ())}
        if not waiting:
            return False
        log.info(
            "%s: %d call(s) of attempt(s) %s in flight; waiting for their answers",
            rollout_id,
            len(waiting),
            list(attempts),
        )
        await asyncio.wait(waiting, timeout=max(0.0, timeout))
        return True

    def __len__(self) -> int:
        return sum(len(calls) for calls in self._calls.values())

    def _add(self, key: Key, future: asyncio.Future[Any]) -> None:
        self._calls.setdefault(key, set()).add(future)

    def _ended(self, key: Key, task: asyncio.Future[Any]) -> None:
        self._discard(key, task)
        failure = None if task.cancelled() else task.exception()
        if failure is not None:
            log.error("reading the answer of a call of %s failed", key[0], exc_info=failure)

    def _discard(self, key: Key, future: asyncio.Future[Any]) -> None:
        _discard(self._calls, key, future)


def _discard(calls: dict[Any, set[asyncio.Future[Any]]], key: Any, future: Any) -> None:
    held = calls.get(key)
    if held is None:
        return
    held.discard(future)
    if not held:
        del calls[key]
