"""The gateway's FastAPI app: `create_app` serves the agents' routes (`routes/agent.py`, and
Agent Lightning's in `routes/agl.py`) and the admin API, health and metrics (`routes/admin.py`)
over one `Gateway` (`state.py`), the state those routes share."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from temporalio.client import Client

from darl.gateway.errors import (
    install_error_handlers,
)
from darl.gateway.metrics import GatewayMetrics
from darl.gateway.routes import admin, agent, agl
from darl.gateway.routes.bodies import with_body_schemas
from darl.gateway.state import Gateway, GatewaySettings
from darl.gateway.store.base import TrajectoryStore
from darl.gateway.tracing import HandedOnContext, TokenTraceContext

log = logging.getLogger(__name__)

# How long a stopping gateway tries to signal the events it still holds.
FLUSH_ON_STOP_SECONDS = 5.0


def _route_label(path: str) -> str:
    for marker, label in (
        ("/chat/completions", "chat"),
        ("/completions", "completions"),
        ("/responses", "responses"),
        ("/messages/count_tokens", "count_tokens"),
        ("/messages", "messages"),
        ("/models", "models"),
        ("/result", "result"),
        ("/events", "events"),
        ("/api/rollouts/", "rollout"),
        ("/admin/", "admin"),
        ("/metrics", "metrics"),
        ("/healthz", "health"),
    ):
        if marker in path:
            return label
    return "other"


class RequestCounter:
    """Counts answered requests by route and status (plain ASGI: no per-request task)."""

    def __init__(self, app: Any, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        label = _route_label(scope["path"])

        async def counting_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(label, message["status"]).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(settings: GatewaySettings, store: TrajectoryStore, temporal: Client) -> Any:
    """The ASGI app. The caller owns `temporal`; the app owns its upstream connections."""
    gateway = Gateway(settings, store, temporal)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.forwarder.start()
        if gateway.journal is not None:
            await asyncio.to_thread(gateway.journal.came_up)
        alive = asyncio.create_task(gateway.keep_alive())
        try:
            yield
            try:
                async with asyncio.timeout(FLUSH_ON_STOP_SECONDS):
                    await gateway.delivery.aclose()
            except TimeoutError:
                # Temporal is not answering: the events stay in the store, where the close
                # of each attempt (by whichever gateway serves it next) finds them (rule 1).
                log.warning(
                    "Temporal took no signal within %gs of stopping; undelivered events stay "
                    "in the store for the attempts' closes",
                    FLUSH_ON_STOP_SECONDS,
                )
        finally:
            alive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await alive
            if gateway.journal is not None and not gateway.stopping:
                # Stopped without begin_shutdown (an app embedded in a test, say).
                await asyncio.to_thread(gateway.journal.went_down)
            await gateway.forwarder.aclose()

    # Untraced, FastAPI's own OpenTelemetry (which traces whenever a provider is installed)
    # is off too; traced, the instrumentation below makes the spans, and FastAPI's stands by.
    app = FastAPI(
        title="DARL gateway",
        lifespan=lifespan,
        telemetry=None if settings.traced else {"tracing": False},
    )
    app.state.gateway = gateway
    install_error_handlers(app)
    with_body_schemas(app)

    # The routers' routes go straight into the app's: FastAPI (0.165) serves an included
    # router through layers of its own, which check its routes' version, match the path again
    # and keep their own bookkeeping in the scope at every request (7-27 us a call, in
    # docs/benchmarks.md). Routes added so inherit nothing from the app or the routers: none
    # of them sets a prefix, dependencies, responses, a default response class or operation
    # ids, and the app's `dependency_overrides` would not reach them (nothing sets any).
    for module in (agent, agl, admin):
        app.router.routes.extend(module.router.routes)
    app.add_middleware(RequestCounter, metrics=gateway.metrics)
    if not settings.traced:
        return TokenTraceContext(HandedOnContext(app))
    FastAPIInstrumentor.instrument_app(
        app, excluded_urls="healthz,metrics", exclude_spans=["receive", "send"]
    )
    return TokenTraceContext(app)


def unwrap(app: Any) -> FastAPI:
    """The FastAPI app inside the tracing wrappers (for tests and the server's lifespan)."""
    while isinstance(app, TokenTraceContext | HandedOnContext):
        app = app.app
    inner: FastAPI = app
    return inner
