"""Joins an agent's calls to its rollout's trace when the agent sends no `traceparent`: the
rollout token carries the trace context of the rollout's launch, and this ASGI wrapper hands it
to the OpenTelemetry middleware as if the agent had sent it."""

from __future__ import annotations

from typing import Any

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
        return {**scope, "headers": [*headers, (b"traceparent", traceparent.encode("latin-1"))]}
