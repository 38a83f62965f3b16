"""The rollout worker's HTTP client: one pooled aiohttp session per use (the agent services'
POSTs, the gateway's admin API), whose requests carry the rollout's trace context."""

from __future__ import annotations

import aiohttp

from darl.gateway.tracing import client_tracing


def http_session(
    max_connections: int, keep_alive_seconds: float, traced: bool = True
) -> aiohttp.ClientSession:
    """A pooled HTTP session for the worker's calls (agent services, the gateway's admin API).
    Traced, each request is a client span in the rollout's trace. Untraced (the worker exports
    no spans: `RolloutWorkerSettings.traced`), it makes none and sends the current trace
    context as it is, so what the request reaches still joins the rollout's trace. aiohttp,
    not httpx: a request costs the worker about a quarter of httpx's CPU
    (docs/benchmarks.md)."""
    connector = aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=keep_alive_seconds)
    return aiohttp.ClientSession(connector=connector, **client_tracing(traced))
