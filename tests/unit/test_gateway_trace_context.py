"""A gateway that makes no spans of its own (`GatewaySettings.traced=False`) hands the trace
context of the agent's call on to the policy server as it came: every request it makes for
the call carries it (the model call, and the `/tokenize` and `/v1/models` asks a call or
`count_tokens` needs), from the agent's own headers or from its rollout token. A real
aiohttp server on loopback stands in for the policy server and keeps the headers it got."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from darl.gateway.calls.forwarding import Forwarder, RetrySettings
from darl.gateway.tracing import HandedOnContext, TokenTraceContext
from darl.workflows.rollout_token import TokenClaims, mint_token

AGENTS = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TOKENS = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[str, list[dict[str, str]]]]:
    """A policy server stand-in: its URL and the headers of every request it got."""
    seen: list[dict[str, str]] = []

    async def tokenize(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        return web.json_response({"tokens": [1, 2]})

    async def models(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        return web.json_response({"data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


async def serve_one(url: str, headers: list[tuple[bytes, bytes]]) -> None:
    """One request through the untraced gateway's wrappers to an app that asks the upstream
    what a call asks it (a model listing, a `/tokenize`)."""
    forwarder = Forwarder(RetrySettings(max_attempts=1), traced=False)
    await forwarder.start()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await forwarder.get_json(f"{url}/v1/models")
        deadline = time.monotonic() + 10
        reply = await forwarder.send(f"{url}/tokenize", {"prompt": "hi"}, deadline, stream=False)
        assert reply.status == 200
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    try:
        scope = {"type": "http", "method": "POST", "path": "/", "headers": headers}
        await TokenTraceContext(HandedOnContext(app))(scope, receive, send)
    finally:
        await forwarder.aclose()
    assert sent[0]["status"] == 204


async def test_the_agents_trace_context_reaches_the_policy_server_as_it_came(
    upstream: tuple[str, list[dict[str, str]]],
) -> None:
    url, seen = upstream
    headers = [
        (b"traceparent", AGENTS.encode()),
        (b"tracestate", b"vendor=opaque"),
        (b"baggage", b"user=7"),
    ]
    await serve_one(url, headers)
    assert len(seen) == 2
    for got in seen:
        assert got["traceparent"] == AGENTS
        assert got["tracestate"] == "vendor=opaque"
        assert got["baggage"] == "user=7"


async def test_an_agent_that_sent_no_traceparent_hands_on_its_tokens(
    upstream: tuple[str, list[dict[str, str]]],
) -> None:
    """And a `tracestate` the agent sent without its `traceparent` is not paired with the
    token's: it belongs to no trace."""
    url, seen = upstream
    claims = TokenClaims("r1", 1, "train", int(time.time()) + 600, traceparent=TOKENS)
    token = mint_token(b"secret", claims)
    headers = [
        (b"authorization", f"Bearer {token}".encode()),
        (b"tracestate", b"stray=1"),
    ]
    await serve_one(url, headers)
    assert len(seen) == 2
    for got in seen:
        assert got["traceparent"] == TOKENS
        assert "tracestate" not in got


async def test_a_request_with_no_trace_context_hands_on_none(
    upstream: tuple[str, list[dict[str, str]]],
) -> None:
    url, seen = upstream
    await serve_one(url, [])
    assert len(seen) == 2
    assert not [got for got in seen if "traceparent" in got]
