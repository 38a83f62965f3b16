"""Trace context around the gateway's spans. `TokenTraceContext` joins an agent's calls to its
rollout's trace when the agent sends no `traceparent`: the rollout token carries the trace
context of the rollout's launch, and this ASGI wrapper hands it on as if the agent had sent
it. `HandedOnContext`, in a gateway that makes no spans of its own (`GatewaySettings.traced`),
makes the request's trace context current, and `hand_on_context` (an aiohttp client
middleware) puts the current context on each request a session sends: the calls the gateway
makes for an agent's call carry its context on to the policy server as it came (see
`Forwarder`), and so do the rollout worker's (`darl.activities.http`)."""

from __future__ import annotations

from typing import Any

import aiohttp
from opentelemetry import context, propagate
from opentelemetry.instrumentation.aiohttp_client import create_trace_config

from darl.gateway.auth import presented_key_from_headers
from darl.workflows.rollout_token import TokenError, decode_claims


class TokenTraceContext:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope = self._with_traceparent(scope)
        await self.app(scope, receive, send)

    @staticmethod
    def _with_traceparent(scope: dict[str, Any]) -> dict[str, Any]:
        headers: list[tuple[bytes, bytes]] = scope.get("headers") or []
        if any(name == b"traceparent" for name, _ in headers):
            return scope
        token = presented_key_from_headers(
            {k.decode("latin-1"): v.decode("latin-1") for k, v in headers}
        )
        if token is None:
            return scope
        try:
            traceparent = decode_claims(token).traceparent
        except TokenError:
            return scope
        if not traceparent:
            return scope
        # A `tracestate` sent without its `traceparent` belongs to no trace (W3C Trace
        # Context): it must not ride along with the token's.
        kept = [(name, value) for name, value in headers if name != b"tracestate"]
        return {**scope, "headers": [*kept, (b"traceparent", traceparent.encode("latin-1"))]}


class HandedOnContext:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        fields = propagate.get_global_textmap().fields
        carrier = {
            key: value.decode("latin-1")
            for name, value in scope.get("headers") or []
            if (key := name.decode("latin-1")) in fields
        }
        attached = context.attach(propagate.extract(carrier))
        try:
            await self.app(scope, receive, send)
        finally:
            context.detach(attached)


async def hand_on_context(
    request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
) -> aiohttp.ClientResponse:
    """The current trace context on `request`, as it is: what an untraced session sends in
    place of a client span's. aiohttp runs it again for each redirect and retry."""
    propagate.inject(request.headers)
    return await handler(request)


def client_tracing(traced: bool) -> dict[str, Any]:
    """An aiohttp `ClientSession`'s keywords: traced, a client span for each request, which
    carries its own context on; untraced, no span, and the current context handed on as it
    is (`hand_on_context`)."""
    if traced:
        return {"trace_configs": [create_trace_config()]}
    return {"middlewares": (hand_on_context,)}
