"""Serving a replayed call (rule 10, see `replay`): the recorded answer, in the protocol the
agent speaks, whole or as a stream, recorded first as a call of the new attempt (rule 1) with
its original version, tokens and logprobs and the call it reproduces. No policy server is
asked: a replayed call is served while the gateway is paused for a weight sync and never
counts against an upstream's load.

A request the record does not hold waits first for the calls of the record's attempts still
at a policy server through this gateway (`CallsInFlight`): the agent lost with a call in
flight asked it, and its answer, recorded unreceived when it comes, answers the request
instead of a second generation.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from fastapi.responses import Response, StreamingResponse

from darl.gateway.calls.delivery import EventDelivery, event_of
from darl.gateway.calls.in_flight import CallsInFlight
from darl.gateway.calls.replay import Match, ReplayBook, ReplaySession
from darl.gateway.calls.rollouts import RolloutRegistry
from darl.gateway.defaults import CALL_DEADLINE_SECONDS
from darl.gateway.metrics import GatewayMetrics
from darl.gateway.protocols.chat.capture import answer_chunks, usage_of, with_prompt_token_ids
from darl.gateway.protocols.chat.protocol import Endpoint
from darl.gateway.protocols.translation import Translation
from darl.gateway.store.base import AlreadyReplayedError, ReplayOverError, TrajectoryStore
from darl.gateway.store.record import CallRecord
from darl.workflows.rollout_token import TokenClaims

log = logging.getLogger(__name__)

# The prompt's token ids of a request, as the rollout's policy server renders it.
Tokenize = Callable[[TokenClaims, Endpoint, dict[str, Any]], Awaitable[list[int]]]


class Replayer:
    def __init__(
        self,
        book: ReplayBook,
        store: TrajectoryStore,
        registry: RolloutRegistry,
        delivery: EventDelivery,
        metrics: GatewayMetrics,
        tokenize: Tokenize,
        *,
        in_flight: CallsInFlight | None = None,
        wait_seconds: float = CALL_DEADLINE_SECONDS,
    ) -> None:
        """`in_flight`: this gateway's live calls, whose answers a request the record does not
        hold waits for, at most `wait_seconds` (none: it waits for nothing)."""
        self.book = book
        self._store = store
        self._registry = registry
        self._delivery = delivery
        self._metrics = metrics
        self._tokenize = tokenize
        self._in_flight = in_flight if in_flight is not None else CallsInFlight()
        self._wait_seconds = wait_seconds

    async def answer(
        self,
        endpoint: Endpoint,
        claims: TokenClaims,
        forwarded: dict[str, Any],
        translation: Translation | None,
        stream: bool,
        prompt_ids_asked: bool,
        idempotency_key: str | None = None,
    ) -> Response | None:
        """The recorded answer to this request of a replaying attempt, recorded as its call
        (with the request's `idempotency_key`); None when the record holds no answer to it
        (the call goes live). The agent gets it as it would get it live: its prompt's token
        ids only if it asked for them."""
        started = time.monotonic()
        served = await self._take_and_record(
            endpoint, claims, forwarded, translation, stream, started, idempotency_key
        )
        if served is None:
            return None
        stored, match = served
        self._delivery.enqueue(event_of(stored, self._store.ref(stored)))
        self._metrics.replayed_calls.labels(str(match.normalized).lower()).inc()
        if match.recorded.record.unreceived:
            self._metrics.unreceived_replayed.inc()
        headers = {"X-Darl-Replayed-From": match.recorded.record.call_id}
        return recorded_answer(
            stored, translation, stream, forwarded, prompt_ids_asked, headers=headers
        )

    async def _take_and_record(
        self,
        endpoint: Endpoint,
        claims: TokenClaims,
        forwarded: dict[str, Any],
        translation: Translation | None,
        stream: bool,
        started: float,
        idempotency_key: str | None,
    ) -> tuple[CallRecord, Match] | None:
        """The first unused recorded call this request equals, recorded as the attempt's call;
        None when the request goes live. The session is this process's cache of the replay;
        the store decides (rule 10): a recorded call another replica served meanwhile is
        passed over for the next one, and once the attempt holds a live call nothing more is
        served from the record."""
        session = await self.book.session(claims)
        protocol = translation.protocol if translation is not None else endpoint
        while True:
            diverged_before = session.diverged
            match = session.take(protocol, endpoint, forwarded)
            if match is None:
                if await self._lineage_answered(claims, session, started):
                    session = await self.book.session(claims)
                    continue
                if session.diverged and not diverged_before:
                    self._metrics.replay_divergences.inc()
                    log.info(
                        "%s attempt %d: a request the record does not hold, %d recorded "
                        "call(s) left: the replay ends here",
                        claims.rollout_id,
                        claims.attempt,
                        session.left,
                    )
                return None
            try:
                record = await self._replayed_call(
                    endpoint, claims, translation, forwarded, match, stream, started
                )
                record = replace(record, idempotency_key=idempotency_key)
            except BaseException:
                # Nothing was written: the agent may ask again and get this call.
                session.give_back(match)
                raise
            # Once the append is under way the call counts as used, whatever happens: a
            # record that may exist is never offered a second time (the agent's retry goes
            # live, or takes the next record of its form).
            try:
                return await self._registry.record_call(record), match
            except AlreadyReplayedError as err:
                log.info(
                    "%s attempt %d: recorded call %s was served already (by another replica, "
                    "say); taking the next",
                    claims.rollout_id,
                    claims.attempt,
                    match.recorded.record.call_id,
                )
                session.served_elsewhere(err.reproduced)
            except ReplayOverError:
                log.info(
                    "%s attempt %d: the store holds a live call of the attempt: the replay is over",
                    claims.rollout_id,
                    claims.attempt,
                )
                session.end_replay()
                return None

    async def _lineage_answered(
        self, claims: TokenClaims, session: ReplaySession, started: float
    ) -> bool:
        """Whether calls of the record's attempts were in flight here and have been waited
        for (until `wait_seconds` after the request came): the session is then rebuilt from
        the store, which holds their answers, unreceived. False when none was, or the
        replay is over."""
        if session.live or claims.replay is None:
            return False
        left = self._wait_seconds - (time.monotonic() - started)
        sources = claims.replay.sources
        if left <= 0:
            return False
        with self._metrics.replay_waiting.track_inprogress():
            if not await self._in_flight.settled(claims.rollout_id, sources, left):
                return False
        self.book.forget(claims.rollout_id, claims.attempt)
        return True

    async def _replayed_call(
        self,
        endpoint: Endpoint,
        claims: TokenClaims,
        translation: Translation | None,
        forwarded: dict[str, Any],
        match: Match,
        stream: bool,
        started: float,
    ) -> CallRecord:
        """The replayed call as the attempt's trajectory will hold it, recorded before the agent
        hears of it (rule 1). Under a normalizer the prompt is the one the agent sent now,
        tokenized by the rollout's policy server (no generation); the answer is the recorded
        one."""
        original = match.recorded.record
        response, prompt_ids = original.response, original.prompt_token_ids
        if match.normalized:
            prompt_ids = await self._tokenize(claims, endpoint, forwarded)
            response = _with_prompt(endpoint, response, prompt_ids)
        record = reproduction(original, claims, translation, forwarded, stream, started)
        return replace(
            record,
            response=response,
            prompt_token_ids=prompt_ids,
            replay_normalized=match.normalized,
        )


def reproduction(
    original: CallRecord,
    claims: TokenClaims,
    translation: Translation | None,
    forwarded: dict[str, Any],
    stream: bool,
    started: float,
) -> CallRecord:
    """A call of the attempt of `claims` answered with `original`'s answer, tokens, logprobs
    and policy version (no policy server asked), the request being what the agent sent now:
    `forwarded` as the endpoint's, in `translation`'s protocol if it spoke another."""
    exchange: dict[str, Any] = {}
    if translation is not None:
        # This request's own (what a later `previous_response_id` reads of it), and the ids
        # the answer is built from: the first run's, so the agent gets the answer it got then.
        exchange = {
            **translation.exchange,
            "answered_as": original.exchange.get("answered_as", original.call_id),
        }
    return CallRecord(
        call_id=uuid.uuid4().hex,
        rollout_id=claims.rollout_id,
        attempt=claims.attempt,
        sequence=-1,
        endpoint=original.endpoint,
        upstream=original.upstream,
        policy_version=original.policy_version,
        created_at=time.time(),
        # The gateway's own time: no policy server was asked.
        latency_ms=(time.monotonic() - started) * 1000,
        retry_count=0,
        streamed=stream,
        request={**forwarded, "model": original.request.get("model")},
        response=original.response,
        prompt_token_ids=original.prompt_token_ids,
        protocol=translation.protocol if translation is not None else original.endpoint,
        exchange=exchange,
        replayed_from=original.call_id,
    )


def recorded_answer(
    stored: CallRecord,
    translation: Translation | None,
    stream: bool,
    forwarded: dict[str, Any],
    prompt_ids_asked: bool,
    *,
    headers: dict[str, str],
) -> Response:
    """The answer `stored` holds, as the agent's request asks it (`forwarded`): in the
    agent's protocol, whole or as a stream, its prompt's token ids only if it asked for them;
    with the call's id and version and `headers`."""
    endpoint = stored.endpoint
    answered_as = str(stored.exchange.get("answered_as") or stored.call_id)
    headers = {
        "X-Darl-Call-Id": stored.call_id,
        "X-Darl-Policy-Version": str(stored.policy_version),
        **headers,
    }
    if stream:
        include_usage = bool((forwarded.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(
            _events(
                endpoint, stored.response, translation, answered_as, include_usage, prompt_ids_asked
            ),
            media_type="text/event-stream",
            headers=headers,
        )
    if translation is not None:
        body = translation.answer(stored.response, answered_as)
    else:
        body = {**stored.response, "usage": usage_of(endpoint, stored.response)}
        if not prompt_ids_asked:
            body = with_prompt_token_ids(endpoint, body, None)
    return Response(json.dumps(body), media_type="application/json", headers=headers)


def _with_prompt(endpoint: Endpoint, response: dict[str, Any], ids: list[int]) -> dict[str, Any]:
    """The recorded answer with the prompt the agent sent now: its ids and its usage."""
    updated = with_prompt_token_ids(endpoint, response, ids)
    if response.get("usage"):
        completion = int(response["usage"].get("completion_tokens") or 0)
        updated["usage"] = {
            **response["usage"],
            "prompt_tokens": len(ids),
            "total_tokens": len(ids) + completion,
        }
    return updated


async def _events(
    endpoint: Endpoint,
    response: dict[str, Any],
    translation: Translation | None,
    answered_as: str,
    include_usage: bool,
    prompt_ids_asked: bool,
) -> AsyncIterator[bytes]:
    """The recorded answer as the stream of the agent's protocol (a translation reads the
    prompt's size from its ids)."""
    with_ids = prompt_ids_asked or translation is not None
    chunks = answer_chunks(endpoint, response, include_usage, with_prompt_ids=with_ids)
    if translation is None:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"
        return
    translated = translation.streaming(answered_as)
    for chunk in chunks:
        for event in translated.chunk(chunk):
            yield event
    for event in translated.done(response):
        yield event
