"""A streamed answer read from its policy server to its end by a task of its own
(`AnswerPump`), whatever its agent does: the agent reads the events as they come, and one that
goes away mid-stream leaves the answer to finish (within the call's deadline) and to be
recorded unreceived, for the next attempt's replay rather than a second generation (rule 10).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

from darl.gateway.calls.model_call import ModelCall


class AnswerPump:
    def __init__(self, call: ModelCall, events: AsyncGenerator[bytes, None]) -> None:
        """Start reading `events` (the relay of the policy server's stream, which records the
        call at its end). The events wait in memory for the agent: at most the answer's."""
        self._call = call
        self._events = events
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._deadline: asyncio.TimerHandle | None = None
        self.task = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        try:
            async for event in self._events:
                self._queue.put_nowait(event)
        finally:
            self._queue.put_nowait(None)
            await self._events.aclose()
            if self._deadline is not None:
                self._deadline.cancel()

    async def events(self) -> AsyncIterator[bytes]:
        """The events for the agent, as they come; then the pump's own failure, if any."""
        while (event := await self._queue.get()) is not None:
            yield event
        await self.task

    def agent_left(self) -> None:
        """The agent stopped reading: the answer is read on, to be recorded unreceived (unless
        recorded already), and given up at the call's deadline."""
        if self.task.done() or self._deadline is not None:
            return
        self._call.unreceived = True
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(max(0.0, self._call.time_left()), self.task.cancel)
