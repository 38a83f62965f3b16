"""One agent call on its way through the gateway (`ModelCall`): what the gateway knows of it,
from the body it forwards to the version that answered, and the record it becomes; and the
watches on the agent's connection: one that cancels work done before the policy server is
asked when the agent leaves, one that lets the policy server's answer come whatever the agent
does and says whether the agent was still there (an answer it never received is recorded
too, for the next attempt's replay: rule 10).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from darl.gateway.calls.traffic import Admission
from darl.gateway.protocols.chat.protocol import UPSTREAM_PATHS, Endpoint
from darl.gateway.protocols.chat.sent_messages import SentMessages
from darl.gateway.protocols.translation import Translation, protocol_of
from darl.gateway.store.record import CallRecord
from darl.workflows.rollout_token import TokenClaims

T = TypeVar("T")

# The status a call is recorded failed with when its agent hung up (nginx's "client closed").
CLIENT_CLOSED = 499


class ClientGone(Exception):
    """The agent went away while its call was at work."""


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work` in this task, cancelling it (and the upstream call inside) if the agent
    goes away: then ClientGone. One watcher task per call, which cancels this task when the
    agent's connection reports a disconnect; no task for `work` and no wait set."""
    current = asyncio.current_task()
    if current is None:
        raise RuntimeError("unless_disconnected needs a running task")
    gone = False

    async def watch() -> None:
        nonlocal gone
        await _disconnected(request)
        gone = True
        current.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        result = await work
    except asyncio.CancelledError:
        # Ours (and no one else's, a server shutting down say): the agent went away.
        if gone and current.uncancel() == 0:
            raise ClientGone from None
        raise
    finally:
        watcher.cancel()
    if gone:  # `work` finished despite the cancel: its result stands, the cancel is taken back
        current.uncancel()
    return result


async def to_the_end(request: Request, work: Awaitable[T]) -> tuple[T, bool]:
    """Await `work` to its end whatever the agent does; returns its result and whether the
    agent went away meanwhile (its connection reported a disconnect). The answer a policy
    server was asked for is generated either way: kept, it spares the next attempt asking
    again. `work` is bounded by its own deadline."""
    left = False

    async def watch() -> None:
        nonlocal left
        await _disconnected(request)
        left = True

    watcher = asyncio.ensure_future(watch())
    try:
        result = await work
    finally:
        watcher.cancel()
    return result, left


@dataclass
class ModelCall:
    """One agent call on its way through the gateway."""

    request: Request
    endpoint: Endpoint
    claims: TokenClaims
    forwarded: dict[str, Any]
    upstream: str
    deadline: float
    started: float = field(default_factory=time.monotonic)
    call_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    admission: Admission | None = None
    retries: int = 0
    # The policy version the policy server proved for the weights that answered.
    served_version: int | None = None
    # The agent's protocol when it is not the endpoint's own (the Responses or Messages API).
    translation: Translation | None = None
    # Recorded, as answered or as failed: an agent that leaves after that leaves nothing to say.
    settled: bool = False
    # Whether the agent asked for the prompt's token ids (DARL forces them upstream anyway).
    prompt_ids_asked: bool = False
    # The chat messages as the agent sent them (not a translation's), for the store.
    sent_messages: SentMessages | None = None
    # The agent went away (or its attempt ended) while the call was at the policy server: the
    # answer is recorded unreceived (see `CallRecord.unreceived`).
    unreceived: bool = False
    # The request's `Idempotency-Key`, kept in its record (see `idempotency`).
    idempotency_key: str | None = None

    @property
    def protocol(self) -> str:
        return protocol_of(self.endpoint, self.translation)

    @property
    def url(self) -> str:
        return self.upstream + UPSTREAM_PATHS[self.endpoint]

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def admitted(self) -> Admission:
        if self.admission is None:
            raise RuntimeError("the call was never admitted")
        return self.admission

    def proven_version(self) -> int:
        """The version to record: only ever the one the policy server proved (a call whose
        answer came without one is never recorded; see `UpstreamExchange.behind`)."""
        if self.served_version is None:
            raise RuntimeError("recording a call whose weights' version is unknown")
        return self.served_version

    def headers(self) -> dict[str, str]:
        version = self.served_version
        return {
            "X-Darl-Call-Id": self.call_id,
            "X-Darl-Policy-Version": str(
                self.admitted().policy_version if version is None else version
            ),
        }

    def record(
        self,
        response: dict[str, Any],
        prompt_ids: Sequence[int],
        latency_ms: float,
        streamed: bool,
    ) -> CallRecord:
        """The call as the trajectory store keeps it (its sequence is the store's to give)."""
        return CallRecord(
            call_id=self.call_id,
            rollout_id=self.claims.rollout_id,
            attempt=self.claims.attempt,
            sequence=-1,
            endpoint=self.endpoint,
            upstream=self.admitted().upstream,
            policy_version=self.proven_version(),
            created_at=time.time(),
            latency_ms=latency_ms,
            retry_count=self.retries,
            streamed=streamed,
            request=self.forwarded,
            response=response,
            prompt_token_ids=prompt_ids,
            protocol=self.protocol,
            exchange=self.translation.exchange if self.translation else {},
            sent_messages=self.sent_messages,
            unreceived=self.unreceived,
            idempotency_key=self.idempotency_key,
        )
