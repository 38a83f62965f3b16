"""`unless_disconnected`: a call's upstream work is cancelled when its agent goes away, and
only then; whatever else happens to the work or to the request's task is passed on as it is."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import Request

from darl.gateway.calls.model_call import ClientGone, unless_disconnected

WAIT = 5.0


class Connection:
    """The ASGI receive channel of an agent's request whose body was read: it reports a
    disconnect once `hang_up` is called, and nothing before."""

    def __init__(self) -> None:
        self._gone = asyncio.Event()
        self.request = Request({"type": "http", "method": "POST", "headers": []}, self.receive)

    async def receive(self) -> dict[str, Any]:
        await self._gone.wait()
        return {"type": "http.disconnect"}

    def hang_up(self) -> None:
        self._gone.set()


def own_tasks() -> set[asyncio.Task[Any]]:
    return asyncio.all_tasks() - {asyncio.current_task()}


async def test_the_work_s_result_comes_back_and_no_watcher_is_left() -> None:
    before = own_tasks()
    connection = Connection()
    assert await unless_disconnected(connection.request, asyncio.sleep(0, "answer")) == "answer"
    await asyncio.sleep(0)  # the cancelled watcher finishes
    assert own_tasks() == before
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0


async def test_an_agent_that_hangs_up_cancels_the_work() -> None:
    connection = Connection()
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def upstream_call() -> str:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    async def call() -> str:
        return await unless_disconnected(connection.request, upstream_call())

    task = asyncio.create_task(call())
    await asyncio.wait_for(started.wait(), WAIT)
    connection.hang_up()
    with pytest.raises(ClientGone):
        await asyncio.wait_for(task, WAIT)
    assert cancelled.is_set()
    assert task.cancelling() == 0  # the task's own cancel was taken back: it ends by ClientGone


async def test_a_cancel_from_elsewhere_stays_a_cancel() -> None:
    """The request's task cancelled by someone else (a server shutting down) is not an agent
    that went away."""
    connection = Connection()
    started = asyncio.Event()

    async def upstream_call() -> None:
        started.set()
        await asyncio.sleep(60)

    task = asyncio.create_task(unless_disconnected(connection.request, upstream_call()))
    await asyncio.wait_for(started.wait(), WAIT)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, WAIT)


async def test_a_hang_up_inside_a_timeout_leaves_the_timeout_s_cancel_alone() -> None:
    """An agent that leaves while an enclosing `asyncio.timeout` has fired: the timeout's
    cancel is not mistaken for the agent's (it still becomes TimeoutError)."""
    connection = Connection()

    async def upstream_call() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            connection.hang_up()  # the agent leaves as the timeout cancels
            await asyncio.sleep(0.05)
            raise

    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await unless_disconnected(connection.request, upstream_call())


async def test_the_work_s_error_passes_through() -> None:
    connection = Connection()

    async def failing() -> None:
        raise ValueError("the upstream answered nonsense")

    with pytest.raises(ValueError, match="nonsense"):
        await unless_disconnected(connection.request, failing())


async def test_work_that_finishes_despite_the_hang_up_keeps_its_result() -> None:
    connection = Connection()

    async def stubborn() -> str:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            return "finished anyway"
        return "never"

    async def call() -> str:
        return await unless_disconnected(connection.request, stubborn())

    task = asyncio.create_task(call())
    await asyncio.sleep(0)
    connection.hang_up()
    assert await asyncio.wait_for(task, WAIT) == "finished anyway"
    assert task.cancelling() == 0
