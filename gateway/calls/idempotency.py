"""Idempotent model calls (`IdempotentCalls`): a request that comes with an `Idempotency-Key`
header (IETF draft-ietf-httpapi-idempotency-key-header) is answered, when a call of its attempt
was made with that key, from that call's record instead of being generated again: a Temporal
model activity retried after its worker died mid-call, or an HTTP client's own retry.

The key is looked up in the store among the attempt's calls, whichever replica recorded them;
a call with it still at a policy server through this gateway is waited for first (per replica:
a balancer that hashes by rollout sends the retry here). A received answer is served again
under its own call id, recorded nowhere anew; an answer its agent never received (the first
try's client went away, `CallRecord.unreceived`) is recorded as the attempt's call that
reproduces it (`replayed_from`), so the workflow hears of it once.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from darl.gateway.calls.delivery import EventDelivery, event_of
from darl.gateway.calls.in_flight import CallsInFlight
from darl.gateway.calls.replay import ReplayBook, canonical_form
from darl.gateway.calls.replayer import recorded_answer, reproduction
from darl.gateway.calls.rollouts import RolloutRegistry
from darl.gateway.errors import (
    IdempotencyKeyInFlightError,
    IdempotencyKeyReusedError,
    InvalidIdempotencyKeyError,
)
from darl.gateway.lru import LRUCache
from darl.gateway.metrics import GatewayMetrics
from darl.gateway.protocols.chat.protocol import Endpoint
from darl.gateway.protocols.translation import Translation
from darl.gateway.store.base import AlreadyReplayedError, TrajectoryStore
from darl.gateway.store.record import CallRecord
from darl.workflows.rollout_token import TokenClaims

log = logging.getLogger(__name__)

IDEMPOTENCY_KEY_HEADER = "idempotency-key"
# On an answer served from the record of the call made with the request's key.
IDEMPOTENT_REPLAY_HEADER = "X-Darl-Idempotent-Replay"
# Sent by a client that knows the key was never sent before (DARL's plugin, on the first try
# of a Temporal activity): the key is recorded, and not looked up among the attempt's calls
# (a read of all of them, per call).
FIRST_TRY_HEADER = "x-darl-first-try"
MAX_KEY_LENGTH = 200
# How many served keys a replica remembers (least recently used forgotten).
SERVED_KEYS = 65_536
_VALID_KEY = re.compile(f"[!-~]{{1,{MAX_KEY_LENGTH}}}")


def first_try(request: Request) -> bool:
    """The client says the request's key was never sent before (`X-Darl-First-Try: 1`)."""
    return request.headers.get(FIRST_TRY_HEADER) == "1"


def idempotency_key(request: Request) -> str | None:
    """The request's `Idempotency-Key`, None without one; 400 unless it is 1 to 200 visible
    ASCII characters."""
    key = request.headers.get(IDEMPOTENCY_KEY_HEADER)
    if key is None or _VALID_KEY.fullmatch(key):
        return key
    raise InvalidIdempotencyKeyError(
        f"the Idempotency-Key header must be 1 to {MAX_KEY_LENGTH} visible ASCII characters "
        f"(no spaces); got {len(key)} character(s): {key[:40]!r}",
        param="Idempotency-Key",
    )


class IdempotentCalls:
    def __init__(
        self,
        *,
        store: TrajectoryStore,
        registry: RolloutRegistry,
        delivery: EventDelivery,
        metrics: GatewayMetrics,
        replays: ReplayBook,
        in_flight: CallsInFlight,
        wait_seconds: float,
    ) -> None:
        """`wait_seconds`: how long a retry waits for the call with its key still in flight
        here (as long as a call may take)."""
        self._store = store
        self._registry = registry
        self._delivery = delivery
        self._metrics = metrics
        self._replays = replays
        self._in_flight = in_flight
        self._wait_seconds = wait_seconds
        # Keys this replica has served (rollout, attempt, key): a request that says its key
        # is new but holds one of these is a try that woke after its retry, and is looked up.
        self._served: LRUCache[tuple[str, int, str], None] = LRUCache(SERVED_KEYS)

    @contextlib.asynccontextmanager
    async def holding(self, claims: TokenClaims, key: str) -> AsyncIterator[None]:
        """The request with `key` is the attempt's one call with it at work here while this
        lasts, once the call with it in flight here, if any, has been recorded or failed
        (409 when it has not within `wait_seconds`)."""
        rollout_id, attempt = claims.rollout_id, claims.attempt
        with self._metrics.idempotent_waiting.track_inprogress():
            free = await self._in_flight.key_free(rollout_id, attempt, key, self._wait_seconds)
        if not free:
            raise IdempotencyKeyInFlightError(
                f"a call of attempt {attempt} with Idempotency-Key {key!r} is still at the "
                f"policy server after {self._wait_seconds:.0f}s; retry later"
            )
        try:
            with self._in_flight.holding_key(rollout_id, attempt, key):
                yield
        finally:
            self._served.put((rollout_id, attempt, key), None)

    def look_up(self, claims: TokenClaims, key: str, first_try: bool) -> bool:
        """Whether a request with `key` is looked up among the attempt's calls: unless its
        client says the key is new (`X-Darl-First-Try`) and this replica has not served it
        (a first try that stalled past its retry, say)."""
        return not first_try or (claims.rollout_id, claims.attempt, key) in self._served

    async def answer(
        self,
        claims: TokenClaims,
        key: str,
        endpoint: Endpoint,
        forwarded: dict[str, Any],
        translation: Translation | None,
        stream: bool,
        prompt_ids_asked: bool,
    ) -> Response | None:
        """The answer of the attempt's call made with `key`, as this request asks it (`forwarded`
        with its messages read, in `translation`'s protocol if the agent speaks another); None
        when the attempt has no such call (the request goes live). 422 when that call was
        another request."""
        started = time.monotonic()
        record = await self._recorded(claims, key)
        if record is None:
            return None
        protocol = translation.protocol if translation is not None else endpoint
        if canonical_form(record.protocol, record.endpoint, record.request) != canonical_form(
            protocol, endpoint, forwarded
        ):
            raise IdempotencyKeyReusedError(
                f"Idempotency-Key {key!r} was used for a different request (call "
                f"{record.call_id} of attempt {claims.attempt}); a new request needs a new key",
                param="Idempotency-Key",
            )
        headers = {IDEMPOTENT_REPLAY_HEADER: "1"}
        unreceived = record.unreceived
        if unreceived:
            headers["X-Darl-Replayed-From"] = record.call_id
            record = await self._received(
                record, claims, key, translation, forwarded, stream, started
            )
        self._metrics.idempotent_answers.labels(str(unreceived).lower()).inc()
        log.info(
            "%s attempt %d: Idempotency-Key %r answered from call %s",
            claims.rollout_id,
            claims.attempt,
            key,
            record.call_id,
        )
        return recorded_answer(
            record, translation, stream, forwarded, prompt_ids_asked, headers=headers
        )

    async def _recorded(self, claims: TokenClaims, key: str) -> CallRecord | None:
        """The attempt's call made with `key` its agent received, else one it did not."""
        records = await self._store.read(claims.rollout_id, claims.attempt)
        keyed = [r for r in records if r.idempotency_key == key]
        received = [r for r in keyed if not r.unreceived]
        return next(iter(received or keyed), None)

    async def _received(
        self,
        unreceived: CallRecord,
        claims: TokenClaims,
        key: str,
        translation: Translation | None,
        forwarded: dict[str, Any],
        stream: bool,
        started: float,
    ) -> CallRecord:
        """`unreceived` recorded as the attempt's call that reproduces it (rule 1: before the
        agent hears of it), its event queued for the workflow; the one another replica
        recorded, if it was first."""
        call = reproduction(unreceived, claims, translation, forwarded, stream, started)
        try:
            stored = await self._registry.record_call(replace(call, idempotency_key=key))
        except AlreadyReplayedError:
            found = await self._recorded(claims, key)
            if found is None or found.unreceived:
                raise
            return found
        # The agent sees an answer no record of the lineage gave it: its replay is over.
        self._replays.end_replay(claims.rollout_id, claims.attempt)
        self._delivery.enqueue(event_of(stored, self._store.ref(stored)))
        return stored
