"""How an activity heartbeats while it awaits work that does not heartbeat itself: the whole
activity (`heartbeats_throughout`, a decorator, as the Temporal samples' `auto_heartbeater`),
one step of it (`heartbeating`), or each of its steps (a `Heartbeater` handed down to them).
The cadence is the one rule, `heartbeat_interval`."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from temporalio import activity

from darl.workflows.heartbeats import Heartbeat, heartbeat_interval

T = TypeVar("T")
P = ParamSpec("P")


async def heartbeating(
    work: Awaitable[T], interval: float, heartbeat: Heartbeat | None = None
) -> T:
    """Finish `work` (shielded from a second cancellation), calling `heartbeat` (the
    activity's, with no details, by default) every `interval` seconds meanwhile; its result
    is the result."""
    task = asyncio.ensure_future(work)
    beat = heartbeat or activity.heartbeat
    while True:
        done, _ = await asyncio.wait({task}, timeout=interval)
        if done:
            return task.result()
        beat()


@dataclass(frozen=True)
class Heartbeater:
    """An activity's heartbeat and its cadence, for code that awaits its work in several
    steps: `await heartbeater(work)` is `work`, heartbeating every `every` seconds meanwhile."""

    heartbeat: Heartbeat
    every: float

    async def __call__(self, work: Awaitable[T], /) -> T:
        return await heartbeating(work, self.every, self.heartbeat)


def heartbeats_throughout(
    longest: float,
) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Coroutine[Any, Any, T]]]:
    """Make an async activity heartbeat while it runs, as `heartbeating` its whole body does:
    three times per the activity's heartbeat timeout, at most `longest` seconds apart.
    Put it under `@activity.defn`, which reads the signature through it."""

    def decorate(run: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
        @functools.wraps(run)
        async def run_heartbeating(*args: P.args, **kwargs: P.kwargs) -> T:
            timeout = activity.info().heartbeat_timeout
            seconds = timeout.total_seconds() if timeout is not None else None
            return await heartbeating(run(*args, **kwargs), heartbeat_interval(seconds, longest))

        return run_heartbeating

    return decorate
