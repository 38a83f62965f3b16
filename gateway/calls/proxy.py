"""The capture pipeline of one model call (docs/architecture.md, rule 1): check the rollout,
force what training needs (token ids, logprobs, model, temperature), forward to the rollout's
policy server, write the full record to the trajectory store, queue its small event for the
workflow (see `recording`), and only then answer the agent. A streamed answer reaches the agent
as it comes, except its final chunk, which is held back until the call is recorded. An agent
that goes away once its call is at the policy server leaves the answer to come and to be
recorded unreceived, for the next attempt's replay (rule 10).

The version recorded on a call is the one the policy server proved for the weights that
answered (see `versions`, rule 8); an answer from weights behind the run's version is
neither recorded nor answered: the call waits for the server to catch up and is sent again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import aiohttp
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from darl.gateway import json_codec
from darl.gateway.calls.answer_pump import AnswerPump
from darl.gateway.calls.delivery import EventDelivery
from darl.gateway.calls.forwarding import Forwarder, UpstreamReply
from darl.gateway.calls.in_flight import CallsInFlight
from darl.gateway.calls.model_call import ClientGone, ModelCall, to_the_end, unless_disconnected
from darl.gateway.calls.recording import CallRecorder
from darl.gateway.calls.replay import ReplayBook
from darl.gateway.calls.replayer import Replayer
from darl.gateway.calls.rollouts import RolloutRegistry
from darl.gateway.calls.traffic import PauseGate, UpstreamPool
from darl.gateway.calls.upstream_models import UpstreamModels
from darl.gateway.calls.versions import UpstreamVersions, version_in
from darl.gateway.defaults import CALL_DEADLINE_SECONDS, TRAIN_TEMPERATURE, VAL_TEMPERATURE
from darl.gateway.errors import (
    NOT_FAILURES,
    APIError,
    BadRequestError,
    RolloutFinishedError,
    UpstreamError,
    UpstreamVersionUnreadableError,
    error_body,
)
from darl.gateway.metrics import GatewayMetrics
from darl.gateway.protocols.chat.capture import (
    CaptureError,
    StreamAssembler,
    answer_as_asked,
    asked_for_prompt_ids,
    split_sse,
    sse_data,
)
from darl.gateway.protocols.chat.prompt_ids import answer_of
from darl.gateway.protocols.chat.protocol import CHAT, Endpoint, validate_body
from darl.gateway.protocols.chat.sent_messages import SentMessages, with_messages_read
from darl.gateway.protocols.overflow import context_length_exceeded, is_context_overflow
from darl.gateway.protocols.translation import (
    StreamTranslation,
    Translation,
    protocol_of,
    upstream_error_message,
)
from darl.gateway.store.base import TrajectoryStore
from darl.workflows.rollout_token import TokenClaims

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499


@dataclass(frozen=True)
class ProxySettings:
    model: str | None = None
    train_temperature: float | None = TRAIN_TEMPERATURE
    val_temperature: float | None = VAL_TEMPERATURE
    call_deadline_seconds: float = CALL_DEADLINE_SECONDS


class ModelCallProxy:
    def __init__(
        self,
        *,
        settings: ProxySettings,
        pool: UpstreamPool,
        gate: PauseGate,
        forwarder: Forwarder,
        store: TrajectoryStore,
        registry: RolloutRegistry,
        delivery: EventDelivery,
        metrics: GatewayMetrics,
        versions: UpstreamVersions,
        replays: ReplayBook,
        stale_wait_seconds: float,
    ) -> None:
        self.settings = settings
        self.versions = versions
        self.stale_wait_seconds = stale_wait_seconds
        self.delivery = delivery
        self.pool = pool
        self.gate = gate
        self.forwarder = forwarder
        self.store = store
        self.registry = registry
        self.metrics = metrics
        self.upstream_models = UpstreamModels(
            forwarder=forwarder,
            pool=pool,
            model=settings.model,
            call_deadline_seconds=settings.call_deadline_seconds,
        )
        self.in_flight = CallsInFlight()
        self.recorder = CallRecorder(
            store=store, registry=registry, delivery=delivery, metrics=metrics, replays=replays
        )
        self.replayer = Replayer(
            replays,
            store,
            registry,
            delivery,
            metrics,
            self.upstream_models.prompt_ids,
            in_flight=self.in_flight,
            wait_seconds=settings.call_deadline_seconds,
        )

    async def handle(
        self,
        request: Request,
        endpoint: Endpoint,
        claims: TokenClaims,
        body: dict[str, Any],
        spoken: type[Translation] | None = None,
    ) -> Response:
        """One agent call: `body` as the endpoint's own (a chat call's messages as sent, maybe:
        `SentMessages`), or in the protocol `spoken`, which translates it into a chat call. A
        call that fails is recorded as failed (status, error, latency, retries) before the
        agent hears of it. An attempt that resumes by replay gets the recorded answer to a
        request the record holds (rule 10)."""
        started = time.monotonic()
        call: ModelCall | None = None
        protocol = protocol_of(endpoint, spoken)
        try:
            # A finished attempt takes nothing, not even a failed call.
            await self.registry.check_open(claims.rollout_id, claims.attempt)
            self.registry.check_budget(claims.rollout_id, claims.attempt)
            translation = await spoken.of(body, claims, self.store) if spoken else None
            if translation is not None:
                body = translation.chat
            stream = validate_body(endpoint, body)
            prompt_ids_asked = asked_for_prompt_ids(body)
            sent = body.get("messages")
            if claims.replay is not None:
                # Matched against the record by its messages' contents.
                body = with_messages_read(body)
                # The model is the record's: no policy server is asked to name it.
                forced = self.force(body, endpoint, claims.mode, model="")
                replayed = await self.replayer.answer(
                    endpoint, claims, forced, translation, stream, prompt_ids_asked
                )
                if replayed is not None:
                    return replayed
            upstream = self.pool.pick(claims.rollout_id)
            call = ModelCall(
                request=request,
                endpoint=endpoint,
                claims=claims,
                forwarded=self.force(
                    body, endpoint, claims.mode, await self.upstream_models.model_for(upstream)
                ),
                upstream=upstream,
                deadline=time.monotonic() + self.settings.call_deadline_seconds,
                translation=translation,
                prompt_ids_asked=prompt_ids_asked,
                # The store compares a conversation as sent, if the agent sent it as it is.
                sent_messages=sent if isinstance(sent, SentMessages) else None,
            )
            with self.in_flight.holding(claims.rollout_id, claims.attempt):
                return await (self._streamed(call) if stream else self._whole(call))
        except ClientGone:
            kept = call is not None and call.unreceived and call.settled
            log.info("agent of %s went away; answer kept unreceived: %s", claims.rollout_id, kept)
            await self.recorder.failed(
                claims, protocol, call, started, CLIENT_CLOSED, "the agent went away"
            )
            return Response(status_code=CLIENT_CLOSED)
        except APIError as err:
            if not isinstance(err, NOT_FAILURES):
                await self.recorder.failed(claims, protocol, call, started, err.status, err.message)
            raise

    def force(
        self, body: dict[str, Any], endpoint: Endpoint, mode: str, model: str
    ) -> dict[str, Any]:
        forced = dict(body)
        forced["model"] = model
        forced["return_token_ids"] = True
        temperature = (
            self.settings.train_temperature if mode == "train" else self.settings.val_temperature
        )
        if temperature is not None:
            forced["temperature"] = temperature
        if endpoint == CHAT:
            forced["logprobs"] = True
        else:
            forced["logprobs"] = max(int(body.get("logprobs") or 0), 0)
        return forced

    # --- whole answers -------------------------------------------------------------------

    async def _whole(self, call: ModelCall) -> Response:
        while True:
            await self._until_upstream_current(call)
            async with self.gate.admitted(call.upstream, call.time_left()) as call.admission:
                reply = await self._send(call, stream=False)
                arrived = time.monotonic()
                if reply.status == 200:
                    call.served_version = version_in(reply.headers)
                    if call.served_version is None:
                        call.served_version = await self._version_after(call, arrived)
            if reply.status != 200 or not self._behind(call):
                break
        latency_ms = self._upstream_done(call)
        if reply.status != 200:
            return await self._refused(call, reply.status, reply.body, reply.content_type)
        try:
            # Its prompt's token ids stay bytes: the store parses only what is new in them.
            data = answer_of(call.endpoint, reply.body)
        except ValueError as err:
            raise UpstreamError(f"policy server {call.upstream} answered non-JSON") from err
        # Once the policy server has answered, recording finishes even if the agent leaves,
        # so the store and the workflow never disagree.
        await asyncio.shield(self.recorder.answered(call, data, latency_ms, streamed=False))
        if call.unreceived:
            raise ClientGone
        if call.translation is not None:
            answer = call.translation.answer(data, call.call_id)
            return Response(
                json_codec.dumps(answer), media_type="application/json", headers=call.headers()
            )
        # The agent gets the policy server's bytes as they came, its prompt's ids if it asked.
        passed_on = answer_as_asked(call.endpoint, reply.body, data, asked=call.prompt_ids_asked)
        return Response(passed_on, media_type="application/json", headers=call.headers())

    async def _refused(
        self, call: ModelCall, status: int, body: bytes, content_type: str
    ) -> Response:
        """The policy server's error answer (after retries): recorded as a failed call, and
        passed on to the agent, in its protocol's shape; a prompt over the context as the
        agent's API says it (raised: `handle` records it)."""
        message = upstream_error_message(body)
        if is_context_overflow(status, body):
            size = await self.upstream_models.prompt_size(call)
            raise context_length_exceeded(call.protocol, size, message)
        await self.recorder.failed(call.claims, call.protocol, call, call.started, status, message)
        if call.translation is None:
            return Response(body, status, media_type=content_type)
        code = (UpstreamError if status >= 500 else BadRequestError).code
        shaped = call.translation.error_body(status, message, code)
        return Response(json.dumps(shaped), status, media_type="application/json")

    # --- streamed answers ----------------------------------------------------------------

    async def _streamed(self, call: ModelCall) -> Response:
        while True:
            await self._until_upstream_current(call)
            stack = AsyncExitStack()
            try:
                call.admission = await stack.enter_async_context(
                    self.gate.admitted(call.upstream, call.time_left())
                )
                reply = await self._send(call, stream=True)
                stack.push_async_callback(reply.aclose)
                if reply.status != 200:
                    content = await reply.read()
                    await stack.aclose()
                    self._upstream_done(call)
                    return await self._refused(call, reply.status, content, reply.content_type)
                # A server that says at the start that its weights are behind: nothing has
                # reached the agent yet, so the call waits and goes again.
                call.served_version = version_in(reply.headers)
                if call.served_version is not None and self._behind(call):
                    await stack.aclose()
                    continue
            except BaseException:
                await stack.aclose()
                raise
            break
        # Read to its end by a task of its own, which closes the stack, whatever the agent
        # does; the background covers an agent that left before the relay started.
        pump = AnswerPump(call, self._relay_events(call, stack, reply))
        self.in_flight.hold_until_done(call.claims.rollout_id, call.claims.attempt, pump.task)
        return StreamingResponse(
            self._relay(call, pump),
            media_type="text/event-stream",
            headers=call.headers(),
            background=BackgroundTask(self._stream_over, call, pump),
        )

    async def _stream_over(self, call: ModelCall, pump: AnswerPump) -> None:
        """The response is over: an answer still being read was not read by the agent."""
        if pump.task.done():
            return
        pump.agent_left()
        if not call.settled:
            gone = "the agent went away before its stream began"
            await self.recorder.failed(
                call.claims, call.protocol, call, call.started, CLIENT_CLOSED, gone
            )

    async def _relay(self, call: ModelCall, pump: AnswerPump) -> AsyncIterator[bytes]:
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
        latency_ms = self._upstream_done(call)
        if failure is None and not assembler.finished:
            failure = "the policy server's stream ended before the answer did"
        if failure is None:
            # The weights may have changed under a long stream (an `inflight: keep` sync):
            # what they were at its end is what finished it.
            try:
                call.served_version = await self._version_after(call, time.monotonic())
            except APIError as err:
                failure = err.message
            else:
                if self._behind(call):
                    failure = (
                        f"the policy server's weights (version {call.served_version}) are "
                        f"behind the run's ({call.admitted().policy_version})"
                    )
        if failure is not None:
            # The agent gets an error, never the end of an answer that was not recorded.
            log.warning("stream of %s not recorded: %s", call.claims.rollout_id, failure)
            if not call.unreceived:  # its agent, gone, was failed by nothing
                await self.note_incident(call.claims, f"stream not recorded: {failure}")
            await self.recorder.failed(call.claims, call.protocol, call, call.started, 502, failure)
            yield _stream_error(translated, f"call not recorded: {failure}", UpstreamError.code)
            return
        response = assembler.response()
        try:
            await asyncio.shield(self.recorder.answered(call, response, latency_ms, streamed=True))
        except APIError as err:
            if err.status >= 500:
                await self.note_incident(call.claims, f"stream not recorded: {err.message}")
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

    async def _send(self, call: ModelCall, stream: bool) -> UpstreamReply:
        """The policy server's reply, whatever the agent does meanwhile (`to_the_end`): an
        agent that left makes the call's answer unreceived."""
        reply, left = await to_the_end(
            call.request,
            self.forwarder.send(
                call.url,
                call.forwarded,
                call.deadline,
                stream,
                headers={"X-Darl-Call-Id": call.call_id},
            ),
        )
        call.unreceived = call.unreceived or left
        call.retries = reply.retries
        return reply

    # --- which weights answered ----------------------------------------------------------

    async def _version_after(self, call: ModelCall, arrived: float) -> int | None:
        """The version the upstream reports when asked after the answer arrived, asked
        whatever the agent does: an answer is recorded, received or not, with its version."""
        try:
            return await self.versions.version_after(call.upstream, arrived)
        except (aiohttp.ClientError, TimeoutError) as err:
            raise UpstreamVersionUnreadableError(
                f"cannot read the policy version of policy server {call.upstream}: {err!r}"
            ) from err

    def _behind(self, call: ModelCall) -> bool:
        """Whether the answer came from weights older than the version the call was admitted
        under (a policy server that restarted on older weights): it must not be recorded."""
        return self.versions.note(
            call.upstream, call.served_version, call.admitted().policy_version
        )

    async def _until_upstream_current(self, call: ModelCall) -> None:
        if call.upstream in self.versions.stale:
            seconds = max(0.0, min(self.stale_wait_seconds, call.time_left()))
            await unless_disconnected(
                call.request,
                self.versions.wait_until_current(call.upstream, self.gate.policy_version, seconds),
            )

    async def note_incident(self, claims: TokenClaims, error: str) -> None:
        """DARL failed this attempt's agent: see `CallRecorder.incident`."""
        await self.recorder.incident(claims, error)

    def _upstream_done(self, call: ModelCall) -> float:
        """Milliseconds from admission to the policy server's full answer (retries included)."""
        latency = time.monotonic() - call.started
        self.metrics.upstream_seconds.observe(latency)
        self.metrics.upstream_retries.inc(call.retries)
        return latency * 1000


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
