"""httpx clients that send an agent's model requests to DARL's gateway for the running activity's
attempt: per request, the URL becomes the attempt's base_url plus the path after `/v1`, the
`Authorization` its token, and `Idempotency-Key` the activity's n-th request key. For LangChain's
`ChatOpenAI(http_client=..., http_async_client=...)` or any OpenAI client."""

from __future__ import annotations

import hashlib
from typing import Any

import httpx

from darl.temporal_agents.attempt import current_activity_attempt

IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"
# The OpenAI SDK numbers the tries of a request in this header (0: the first); it sends no
# Idempotency-Key of its own.
RETRY_COUNT_HEADER = "x-stainless-retry-count"
# Says the request's Idempotency-Key was never sent before (the activity's first try, not the
# client's retry): the gateway then records the key without looking it up among the attempt's
# calls, which would read them all.
FIRST_TRY_HEADER = "X-Darl-First-Try"


def to_gateway(request: httpx.Request) -> httpx.Request:
    """The request, aimed at the running activity's attempt (NoAgentAttemptError when there is
    none). Only the path after the client's `/v1` is kept: the model APIs' routes."""
    running = current_activity_attempt()
    base = httpx.URL(running.attempt.base_url)
    _, v1, tail = request.url.path.partition("/v1")
    route = tail if v1 else request.url.path
    request.url = base.copy_with(
        path=base.path.rstrip("/") + route, query=request.url.query or None
    )
    # The URL's host may have changed: the Host header follows it.
    request.headers["Host"] = request.url.netloc.decode("ascii")
    request.headers["Authorization"] = f"Bearer {running.attempt.token}"
    identity, retry = _identity(request)
    key, sent_before = running.idempotency_key(identity, retry=retry)
    request.headers[IDEMPOTENCY_KEY_HEADER] = key
    if not sent_before:
        request.headers[FIRST_TRY_HEADER] = "1"
    return request


def _identity(request: httpx.Request) -> tuple[str | None, bool]:
    """What names a request across the model client's tries of it, and whether this is a
    retry: the client's own Idempotency-Key (a retry when seen before), else the digest of
    the method, path and body (a retry when the OpenAI SDK counts one)."""
    client_key = request.headers.get(IDEMPOTENCY_KEY_HEADER)
    if client_key is not None:
        return f"client:{client_key}", True
    try:
        body = request.content
    except httpx.RequestNotRead:
        return None, False
    digest = hashlib.sha256(request.method.encode() + request.url.raw_path + b"\n" + body)
    return f"body:{digest.hexdigest()}", request.headers.get(RETRY_COUNT_HEADER, "0") != "0"


class AttemptTransport(httpx.BaseTransport):
    """Sends each request to the running attempt's gateway through `inner`."""

    def __init__(self, inner: httpx.BaseTransport | None = None) -> None:
        self._inner = inner if inner is not None else httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self._inner.handle_request(to_gateway(request))

    def close(self) -> None:
        self._inner.close()


class AsyncAttemptTransport(httpx.AsyncBaseTransport):
    """Sends each request to the running attempt's gateway through `inner`."""

    def __init__(self, inner: httpx.AsyncBaseTransport | None = None) -> None:
        self._inner = inner if inner is not None else httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._inner.handle_async_request(to_gateway(request))

    async def aclose(self) -> None:
        await self._inner.aclose()


def darl_httpx_client(**kwargs: Any) -> httpx.Client:
    """An httpx.Client (keyword arguments as httpx's, but `transport`) whose requests go to the
    running activity's attempt; made once per worker and shared, its connections pooled."""
    return httpx.Client(transport=AttemptTransport(), **kwargs)


def darl_async_httpx_client(**kwargs: Any) -> httpx.AsyncClient:
    """The httpx.AsyncClient counterpart of `darl_httpx_client`."""
    return httpx.AsyncClient(transport=AsyncAttemptTransport(), **kwargs)
