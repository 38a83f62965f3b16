"""A live call's streamed answer (`StreamRelay`): the policy server's events reach the agent as
they come, except the one that ends the answer and what follows it, which wait until the call
is recorded (rule 1), so an agent never sees the end of an answer the store does not hold. The
stream is read to its end by a task of its own (`AnswerPump`): an agent that hangs up leaves
the answer to be recorded unreceived, for the next attempt's replay (rule 10).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from darl.gateway.calls.answer_pump import AnswerPump
from darl.gateway.calls.forwarding import UpstreamReply
from darl.gateway.calls.in_flight import CallsInFlight
from darl.gateway.calls.model_call import CLIENT_CLOSED, ModelCall
from darl.gateway.calls.recording import CallRecorder
from darl.gateway.calls.upstream_exchange import UpstreamExchange
from darl.gateway.calls.versions import version_in
from darl.gateway.errors import APIError, RolloutFinishedError, UpstreamError, error_body
from darl.gateway.protocols.chat.capture import (
    CaptureError,
    StreamAssembler,
    answer_as_asked,
    split_sse,
    sse_data,
)
from darl.gateway.protocols.chat.prompt_ids import answer_of
from darl.gateway.protocols.stream import StreamTranslation

log = logging.getLogger(__name__)


class StreamRelay:
    def __init__(
        self, *, exchange: UpstreamExchange, recorder: CallRecorder, in_flight: CallsInFlight
    ) -> None:
        self.exchange = exchange
        self.recorder = recorder
        self.in_flight = in_flight

    async def respond(self, call: ModelCall) -> Response:
        """The streamed answer to `call`, once its policy server has begun one from weights
        that are not behind the run's (or its refusal)."""
        exchange = self.exchange
        while True:
            await exchange.until_upstream_current(call)
            stack = AsyncExitStack()
            try:
                call.admission = await stack.enter_async_context(
                    exchange.gate.admitted(call.upstream, call.time_left())
                )
                reply = await exchange.send(call, stream=True)
                stack.push_async_callback(reply.aclose)
                if reply.status != 200:
                    content = await reply.read()
                    await stack.aclose()
                    exchange.upstream_done(call)
                    return await exchange.refused(call, reply.status, content, reply.content_type)
                # A server that says at the start that its weights are behind: nothing has
                # reached the agent yet, so the call waits and goes again.
                call.served_version = version_in(reply.headers)
                if call.served_version is not None and exchange.behind(call):
                    await stack.aclose()
                    continue
            except BaseException:
                await stack.aclose()
                raise
            break
        # Read to its end by a task of its own, which closes the stack, whatever the agent
        # does; the background covers an agent that left before the relay started.
        pump = AnswerPump(call, self._relay_events(call, stack, reply))
        claims = call.claims
        self.in_flight.hold_until_done(
            claims.rollout_id, claims.attempt, pump.task, call.idempotency_key
        )
        return StreamingResponse(
            self._to_agent(call, pump),
            media_type="text/event-stream",
            headers=call.headers(),
            background=BackgroundTask(self._response_over, call, pump),
        )

    async def _response_over(self, call: ModelCall, pump: AnswerPump) -> None:
        """The response is over: an answer still being read was not read by the agent."""
        if pump.task.done():
            return
        pump.agent_left()
        if not call.settled:
            gone = "the agent went away before its stream began"
            await self.recorder.failed(
                call.claims, call.protocol, call, call.started, CLIENT_CLOSED, gone
            )

    async def _to_agent(self, call: ModelCall, pump: AnswerPump) -> AsyncIterator[bytes]:
        """The stream to the agent; an agent that hangs up before the call is recorded leaves
        a failed call (499), as one that hangs up on a whole answer does, and the answer to
        be recorded unreceived once the policy server has finished it."""
        try:
            async for event in pump.events():
                yield event
        except (GeneratorExit, asyncio.CancelledError):
            pump.agent_left()
            if not call.settled:
                gone = "the agent went away mid-stream"
                failed = self.recorder.failed(
                    call.claims, call.protocol, call, call.started, CLIENT_CLOSED, gone
                )
                await asyncio.shield(failed)
            raise

    async def _relay_events(
        self, call: ModelCall, stack: AsyncExitStack, reply: UpstreamReply
    ) -> AsyncGenerator[bytes, None]:
        """Relay the SSE events as they come, except the one that ends the answer and what
        follows it: those wait until the call is recorded."""
        assembler = StreamAssembler(call.endpoint)
        translated = call.translation.streaming(call.call_id) if call.translation else None
        held: list[tuple[bytes, dict[str, Any] | None]] = []
        failure: str | None = None
        async with stack:
            buffer = bytearray()
            try:
                async for raw in reply.chunks():
                    buffer += raw
                    for event in split_sse(buffer):
                        data = sse_data(event)
                        chunk: dict[str, Any] | None = None
                        if data is not None and data != "[DONE]":
                            try:
                                chunk = answer_of(call.endpoint, data.encode())
                                ends = assembler.add(chunk)
                            except (CaptureError, ValueError) as err:
                                failure = str(err)
                                break
                            if translated is None:
                                event = answer_as_asked(
                                    call.endpoint,
                                    event,
                                    chunk,
                                    asked=call.prompt_ids_asked,
                                    event=True,
                                )
                            if ends:
                                held.append((event, chunk))
                                continue
                        if held:
                            held.append((event, chunk))
                        else:
                            for out in _relayed(translated, event, chunk):
                                yield out
                    if failure is not None:
                        break
            except (aiohttp.ClientError, TimeoutError) as err:
                failure = f"the policy server's stream broke: {err!r}"
        latency_ms = self.exchange.upstream_done(call)
        if failure is None and not assembler.finished:
            failure = "the policy server's stream ended before the answer did"
        if failure is None:
            failure = await self._behind_at_the_end(call)
        if failure is not None:
            # The agent gets an error, never the end of an answer that was not recorded.
            log.warning("stream of %s not recorded: %s", call.claims.rollout_id, failure)
            if not call.unreceived:  # its agent, gone, was failed by nothing
                await self.recorder.incident(call.claims, f"stream not recorded: {failure}")
            await self.recorder.failed(call.claims, call.protocol, call, call.started, 502, failure)
            yield _stream_error(translated, f"call not recorded: {failure}", UpstreamError.code)
            return
        response = assembler.response()
        try:
            await asyncio.shield(self.recorder.answered(call, response, latency_ms, streamed=True))
        except APIError as err:
            if err.status >= 500:
                await self.recorder.incident(call.claims, f"stream not recorded: {err.message}")
            if not isinstance(err, RolloutFinishedError):
                await self.recorder.failed(
                    call.claims, call.protocol, call, call.started, err.status, err.message
                )
            yield _stream_error(translated, err.message, err.code)
            return
        for event, chunk in held:
            for out in _relayed(translated, event, chunk):
                yield out
        if translated is not None:
            for out in translated.done(response):
                yield out

    async def _behind_at_the_end(self, call: ModelCall) -> str | None:
        """Why the finished stream may not be recorded, if it may not: the weights may have
        changed under a long stream (an `inflight: keep` sync), and what they were at its end
        is what finished it."""
        try:
            call.served_version = await self.exchange.version_after(call, time.monotonic())
        except APIError as err:
            return err.message
        if self.exchange.behind(call):
            return (
                f"the policy server's weights (version {call.served_version}) are "
                f"behind the run's ({call.admitted().policy_version})"
            )
        return None


def _relayed(
    translated: StreamTranslation | None, event: bytes, chunk: dict[str, Any] | None
) -> list[bytes]:
    """What the agent gets of one upstream event: the event itself, or its translation."""
    if translated is None:
        return [event]
    return translated.chunk(chunk) if chunk is not None else []


def _stream_error(translated: StreamTranslation | None, message: str, code: str) -> bytes:
    if translated is not None:
        return translated.error(message, code)
    body = error_body(message, "server_error", code)
    return f"data: {json.dumps(body)}\n\n".encode()
