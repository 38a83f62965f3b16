"""The capture pipeline of one model call (docs/architecture.md, rule 1): check the rollout,
force what training needs (token ids, logprobs, model, temperature), answer a replaying attempt
from its record (the `Replayer`), or forward to the rollout's policy server, write the full
record to the trajectory store, queue its small event for the workflow (see `recording`), and
only then answer the agent: whole here, streamed by the `StreamRelay`. An agent that goes away
once its call is at the policy server leaves the answer to come and to be recorded unreceived,
for the next attempt's replay (rule 10).

The version recorded on a call is the one the policy server proved for the weights that
answered (see `upstream_exchange`, rule 8); an answer from weights behind the run's version is
neither recorded nor answered: the call waits for the server to catch up and is sent again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from darl.gateway import json_codec
from darl.gateway.calls.forwarding import Forwarder
from darl.gateway.calls.idempotency import IdempotentCalls, first_try, idempotency_key
from darl.gateway.calls.in_flight import CallsInFlight
from darl.gateway.calls.model_call import CLIENT_CLOSED, ClientGone, ModelCall
from darl.gateway.calls.recording import CallRecorder
from darl.gateway.calls.replayer import Replayer
from darl.gateway.calls.rollouts import RolloutRegistry
from darl.gateway.calls.stream_relay import StreamRelay
from darl.gateway.calls.traffic import PauseGate, UpstreamPool
from darl.gateway.calls.upstream_exchange import UpstreamExchange
from darl.gateway.calls.upstream_models import UpstreamModels
from darl.gateway.calls.versions import UpstreamVersions, version_in
from darl.gateway.defaults import CALL_DEADLINE_SECONDS, TRAIN_TEMPERATURE, VAL_TEMPERATURE
from darl.gateway.errors import NOT_FAILURES, APIError, UpstreamError
from darl.gateway.metrics import GatewayMetrics
from darl.gateway.protocols.chat.capture import answer_as_asked, asked_for_prompt_ids
from darl.gateway.protocols.chat.prompt_ids import answer_of
from darl.gateway.protocols.chat.protocol import CHAT, Endpoint, validate_body
from darl.gateway.protocols.chat.sent_messages import SentMessages, with_messages_read
from darl.gateway.protocols.translation import Translation, protocol_of
from darl.gateway.store.base import TrajectoryStore
from darl.workflows.rollout_token import TokenClaims

log = logging.getLogger(__name__)


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
        metrics: GatewayMetrics,
        versions: UpstreamVersions,
        upstream_models: UpstreamModels,
        recorder: CallRecorder,
        replayer: Replayer,
        in_flight: CallsInFlight,
        idempotent: IdempotentCalls,
        stale_wait_seconds: float,
    ) -> None:
        """The proxy's peers are the `Gateway`'s: the admin routes reach the same replay book,
        the agent routes the same recorder and upstream models."""
        self.settings = settings
        self.pool = pool
        self.gate = gate
        self.store = store
        self.registry = registry
        self.upstream_models = upstream_models
        self.recorder = recorder
        self.replayer = replayer
        self.in_flight = in_flight
        self.idempotent = idempotent
        self.exchange = UpstreamExchange(
            forwarder=forwarder,
            gate=gate,
            versions=versions,
            upstream_models=upstream_models,
            recorder=recorder,
            metrics=metrics,
            stale_wait_seconds=stale_wait_seconds,
        )
        self.stream_relay = StreamRelay(
            exchange=self.exchange, recorder=recorder, in_flight=in_flight
        )

    async def handle(
        self,
        request: Request,
        endpoint: Endpoint,
        claims: TokenClaims,
        body: dict[str, Any],
        agent_protocol: type[Translation] | None = None,
    ) -> Response:
        """One agent call: `body` as the endpoint's own (a chat call's messages as sent, maybe:
        `SentMessages`), or in `agent_protocol`, the protocol whose `Translation` turns it into
        a chat call. A call that fails is recorded as failed (status, error, latency, retries)
        before the agent hears of it. An attempt that resumes by replay gets the recorded
        answer to a request the record holds (rule 10); a request with the `Idempotency-Key`
        of a call of its attempt, that call's answer (`idempotency`)."""
        key = idempotency_key(request)
        if key is None:
            return await self._handle(request, endpoint, claims, body, agent_protocol, None)
        async with self.idempotent.holding(claims, key):
            look_up = self.idempotent.look_up(claims, key, first_try(request))
            return await self._handle(request, endpoint, claims, body, agent_protocol, key, look_up)

    async def _handle(
        self,
        request: Request,
        endpoint: Endpoint,
        claims: TokenClaims,
        body: dict[str, Any],
        agent_protocol: type[Translation] | None,
        key: str | None,
        look_up_key: bool = False,
    ) -> Response:
        """`look_up_key`: the request's `key` may have been sent before (a retry): the
        attempt's call made with it, if any, answers it."""
        started = time.monotonic()
        call: ModelCall | None = None
        protocol = protocol_of(endpoint, agent_protocol)
        try:
            # A finished attempt takes nothing, not even a failed call.
            await self.registry.check_open(claims.rollout_id, claims.attempt)
            self.registry.check_budget(claims.rollout_id, claims.attempt)
            translation = (
                await agent_protocol.of(body, claims, self.store) if agent_protocol else None
            )
            if translation is not None:
                body = translation.chat
            stream = validate_body(endpoint, body)
            prompt_ids_asked = asked_for_prompt_ids(body)
            sent = body.get("messages")
            if claims.replay is not None or look_up_key:
                # Matched against the record by its messages' contents.
                body = with_messages_read(body)
                # The model is the record's: no policy server is asked to name it.
                forwarded = self.forwarded_body(body, endpoint, claims.mode, model="")
                asked = (forwarded, translation, stream, prompt_ids_asked)
                recorded = None
                if key is not None and look_up_key:
                    # The attempt's own call with this key first; then a replay's record.
                    recorded = await self.idempotent.answer(claims, key, endpoint, *asked)
                if recorded is None and claims.replay is not None:
                    recorded = await self.replayer.answer(
                        endpoint, claims, *asked, idempotency_key=key
                    )
                if recorded is not None:
                    return recorded
            upstream = self.pool.pick(claims.rollout_id)
            call = ModelCall(
                request=request,
                endpoint=endpoint,
                claims=claims,
                forwarded=self.forwarded_body(
                    body, endpoint, claims.mode, await self.upstream_models.model_for(upstream)
                ),
                upstream=upstream,
                deadline=time.monotonic() + self.settings.call_deadline_seconds,
                translation=translation,
                prompt_ids_asked=prompt_ids_asked,
                # The store compares a conversation as sent, if the agent sent it as it is.
                sent_messages=sent if isinstance(sent, SentMessages) else None,
                idempotency_key=key,
            )
            with self.in_flight.holding(claims.rollout_id, claims.attempt):
                return await (self.stream_relay.respond(call) if stream else self._whole(call))
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

    def forwarded_body(
        self, body: dict[str, Any], endpoint: Endpoint, mode: str, model: str
    ) -> dict[str, Any]:
        """`body` as the policy server is asked it: with what training needs set whatever the
        agent asked (the model, the prompt's and the answer's token ids, logprobs, the
        temperature of the rollout's mode)."""
        forwarded = dict(body)
        forwarded["model"] = model
        forwarded["return_token_ids"] = True
        temperature = (
            self.settings.train_temperature if mode == "train" else self.settings.val_temperature
        )
        if temperature is not None:
            forwarded["temperature"] = temperature
        if endpoint == CHAT:
            forwarded["logprobs"] = True
        else:
            forwarded["logprobs"] = max(int(body.get("logprobs") or 0), 0)
        return forwarded

    async def _whole(self, call: ModelCall) -> Response:
        """The whole answer to `call`, recorded before the agent gets it."""
        while True:
            await self.exchange.until_upstream_current(call)
            async with self.gate.admitted(call.upstream, call.time_left()) as call.admission:
                reply = await self.exchange.send(call, stream=False)
                arrived = time.monotonic()
                if reply.status == 200:
                    call.served_version = version_in(reply.headers)
                    if call.served_version is None:
                        call.served_version = await self.exchange.version_after(call, arrived)
            if reply.status != 200 or not self.exchange.behind(call):
                break
        latency_ms = self.exchange.upstream_done(call)
        if reply.status != 200:
            return await self.exchange.refused(call, reply.status, reply.body, reply.content_type)
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
