"""The live calls of each attempt that are at a policy server through this gateway
(`CallsInFlight`). An attempt that resumes by replay (rule 10) and sends a request its record
does not hold waits for its lineage's calls still in flight here before it goes live: the
agent lost with one of them in flight asked what its successor asks again, and that answer,
recorded unreceived when it comes, is then replayed instead of generated twice. Only this
replica's calls are seen: a balancer that sends an attempt's calls to the replica of its
rollout (hashing by rollout) sends them here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

log = logging.getLogger(__name__)

Key = tuple[str, int]


class CallsInFlight:
    def __init__(self) -> None:
        # Per attempt, a future per live call, done when the call is recorded or failed. A
        # streamed call's is the task that reads its answer to the end, held here until then.
        self._calls: dict[Key, set[asyncio.Future[Any]]] = {}

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

    def hold_until_done(self, rollout_id: str, attempt: int, task: asyncio.Task[Any]) -> None:
        """A live call of the attempt is at work until `task` ends (a reference is kept)."""
        key = (rollout_id, attempt)
        self._add(key, task)
        task.add_done_callback(lambda done: self._ended(key, done))

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
        calls = self._calls.get(key)
        if calls is None:
            return
        calls.discard(future)
        if not calls:
            del self._calls[key]
