"""The gateway's FastAPI app: the OpenAI-compatible rollout routes, Agent Lightning's proxy and
event routes, the agent's result route, the admin API, health and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from temporalio.client import Client

from darl.gateway.auth import require_admin, rollout_claims
from darl.gateway.capture import CHAT, COMPLETIONS, Endpoint
from darl.gateway.delivery import EventDelivery
from darl.gateway.errors import (
    GatewayError,
    bad_request,
    describe_errors,
    forbidden,
    install_error_handlers,
)
from darl.gateway.forwarding import Forwarder, RetrySettings
from darl.gateway.journal import ALIVE_INTERVAL_SECONDS, AdminState, GatewayJournal
from darl.gateway.metrics import GatewayMetrics
from darl.gateway.proxy import ModelCallProxy, ProxySettings
from darl.gateway.rollouts import RolloutRegistry
from darl.gateway.store import TrajectoryStore
from darl.gateway.tracing import TokenTraceContext
from darl.gateway.traffic import PauseGate, UpstreamPool
from darl.gateway.versions import UpstreamVersions
from darl.workflows.contracts import AgentReport
from darl.workflows.rollout_token import TokenClaims
from darl.workflows.training_config import PauseMode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewaySettings:
    token_secret: bytes
    admin_key: str
    upstreams: tuple[str, ...]
    proxy: ProxySettings = field(default_factory=ProxySettings)
    retry: RetrySettings = field(default_factory=RetrySettings)
    max_body_bytes: int = 8 * 1024 * 1024
    paused_retry_after_seconds: int = 1
    # How often a rollout's captured calls go to its workflow (one batched signal).
    signal_interval_seconds: float = 1.0
    upstream_api_key: str | None = None
    # The gateway's own durable state (admin state, outages); None keeps it in memory only.
    journal_dir: Path | None = None
    # This gateway's name among those sharing a journal (its outages are its own).
    instance: str = "gateway"
    # How long a call waits for a policy server that serves older weights than the run's.
    stale_wait_seconds: float = 120.0


async def read_json_object(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object, refusing bodies over `limit` bytes (413)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise GatewayError(413, f"request body over {limit} bytes", code="body_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise GatewayError(413, f"request body over {limit} bytes", code="body_too_large")
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise bad_request(f"request body is not valid JSON: {err}", "invalid_json") from err
    if not isinstance(value, dict):
        raise bad_request("request body must be a JSON object", "invalid_json")
    return value


Body = TypeVar("Body", bound=BaseModel)


async def read_model(request: Request, model: type[Body], limit: int) -> Body:
    """An admin body: JSON whatever the Content-Type says (curl -d sends a form type); an
    empty body means the model's defaults."""
    if not (await request.body()).strip():
        data: dict[str, Any] = {}
    else:
        data = await read_json_object(request, limit)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise bad_request(f"invalid request: {describe_errors(err.errors())}") from err


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: PauseMode = "hold"
    # Wait for in-flight calls to finish before answering, at most this long.
    drain_timeout_seconds: float | None = Field(default=None, ge=0, le=3600)


class ResumeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policy_version: int | None = None


class UpstreamsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    upstreams: list[str] = Field(min_length=1)


class CloseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # When the attempt's agent started (epoch seconds): outages since then touched it.
    started_at: float | None = None


class AglEvent(BaseModel):
    model_config = ConfigDict(extra="allow")
    event_type: str
    data: dict[str, Any] = Field(default_factory=dict)


class Gateway:
    """Owns the gateway's state: settings, traffic control, the proxy and its clients."""

    def __init__(
        self,
        settings: GatewaySettings,
        store: TrajectoryStore,
        temporal: Client,
    ) -> None:
        self.settings = settings
        self.store = store
        self.journal = (
            GatewayJournal(settings.journal_dir, settings.instance)
            if settings.journal_dir is not None
            else None
        )
        saved = self.journal.load_admin_state() if self.journal is not None else None
        self.forwarder = Forwarder(settings.retry, settings.upstream_api_key)
        self.metrics = GatewayMetrics()
        restored = saved or AdminState()
        self.gate = PauseGate(
            settings.paused_retry_after_seconds,
            policy_version=restored.policy_version,
            paused=restored.paused,
            mode=restored.mode,
        )
        self.pool = UpstreamPool(self._upstreams_at_start(saved))
        self.versions = UpstreamVersions(self.forwarder)
        self.registry = RolloutRegistry(temporal, store)
        self.delivery = EventDelivery(
            self.registry, store, self.metrics, settings.signal_interval_seconds
        )
        self.proxy = ModelCallProxy(
            settings.proxy,
            self.pool,
            self.gate,
            self.forwarder,
            store,
            self.registry,
            self.delivery,
            self.metrics,
            self.versions,
            settings.stale_wait_seconds,
        )
        self.metrics.inflight.set_function(lambda: sum(self.gate.inflight().values()))
        self.metrics.paused.set_function(lambda: float(self.gate.paused))
        self.stopping = False
        if saved is not None:
            log.info(
                "restored from the journal: policy version %d, %s, upstreams %s",
                saved.policy_version,
                f"paused ({saved.mode})" if saved.paused else "running",
                self.pool.urls,
            )

    def _upstreams_at_start(self, saved: AdminState | None) -> list[str]:
        """The upstreams the trainer last registered, unless this gateway was started with
        other `--upstream`s than the ones they replaced (then the operator's flags win)."""
        configured = self._configured_upstreams()
        if saved is None or not saved.upstreams or saved.configured != configured:
            return list(configured)
        return list(saved.upstreams)

    def _configured_upstreams(self) -> tuple[str, ...]:
        return tuple(sorted(u.rstrip("/") for u in self.settings.upstreams))

    def save_state(self) -> None:
        """Write the admin state to the journal: called after every admin change, before the
        admin call is answered."""
        if self.journal is None:
            return
        self.journal.save_admin_state(
            AdminState(
                policy_version=self.gate.policy_version,
                paused=self.gate.paused,
                mode=self.gate.mode,
                upstreams=tuple(self.pool.urls),
                configured=self._configured_upstreams(),
            )
        )

    async def incidents(self, rollout_id: str, attempt: int, since: float | None) -> list[str]:
        found = await self.store.incidents(rollout_id, attempt)
        if self.journal is not None and since is not None:
            found += [o.describe() for o in self.journal.outages_overlapping(since, time.time())]
        return found

    def begin_shutdown(self) -> None:
        """SIGTERM: the server stops accepting; calls in flight finish (the server's grace);
        calls held for a weight sync get 503 now, since no resume can reach a process that
        no longer accepts connections. From now on agents cannot reach this gateway: the
        journal's outage starts here."""
        if self.gate.paused:
            log.info("stopping while paused: %d held call(s) answered 503", self.gate.held)
        self.gate.close_held()
        self.stopping = True
        if self.journal is not None:
            self.journal.went_down()

    async def keep_alive(self) -> None:
        """Tell the journal this gateway is alive, every second, until it begins to stop."""
        if self.journal is None:
            return
        while not self.stopping:
            await asyncio.to_thread(self.journal.alive)
            await asyncio.sleep(ALIVE_INTERVAL_SECONDS)

    def state(self) -> dict[str, Any]:
        return {
            "instance": self.settings.instance,
            "paused": self.gate.paused,
            "mode": self.gate.mode,
            "policy_version": self.gate.policy_version,
            "inflight": self.gate.inflight(),
            "held": self.gate.held,
            "upstreams": self.pool.urls,
            "stale_upstreams": sorted(self.versions.stale),
            "last_pause_seconds": self.gate.last_pause_seconds,
            "undelivered_events": self.delivery.pending(),
        }


# Dependencies are coroutines: FastAPI runs plain functions in a thread pool, a thread hop per
# request that costs more than the check itself.


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


async def _rollout_claims(request: Request, rollout_id: str) -> TokenClaims:
    return rollout_claims(request, rollout_id, _gateway(request).settings.token_secret)


async def _agl_claims(request: Request, rollout_id: str, attempt: int) -> TokenClaims:
    claims = await _rollout_claims(request, rollout_id)
    if claims.attempt != attempt:
        raise forbidden("this token belongs to another attempt")
    return claims


async def _admin(request: Request) -> None:
    require_admin(request, _gateway(request).settings.admin_key)


RolloutClaims = Annotated[TokenClaims, Depends(_rollout_claims)]
AglClaims = Annotated[TokenClaims, Depends(_agl_claims)]


def _route_label(path: str) -> str:
    for marker, label in (
        ("/chat/completions", "chat"),
        ("/completions", "completions"),
        ("/models", "models"),
        ("/result", "result"),
        ("/events", "events"),
        ("/admin/", "admin"),
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
            await gateway.delivery.aclose()
        finally:
            alive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await alive
            if gateway.journal is not None and not gateway.stopping:
                # Stopped without begin_shutdown (an app embedded in a test, say).
                await asyncio.to_thread(gateway.journal.went_down)
            await gateway.forwarder.aclose()

    app = FastAPI(title="DARL gateway", lifespan=lifespan)
    app.state.gateway = gateway
    install_error_handlers(app)

    async def noting_incidents(claims: TokenClaims, work: Awaitable[Response]) -> Response:
        """An agent's request; a 5xx answer to it (of the gateway's or a policy server's
        making) is an incident of its attempt."""
        try:
            response = await work
        except GatewayError as err:
            if err.status >= 500:
                await gateway.proxy.note_incident(claims, f"{err.status} {err.message}")
            raise
        if response.status_code >= 500:
            await gateway.proxy.note_incident(
                claims,
                f"{response.status_code} from the policy server: "
                f"{getattr(response, 'body', b'')[:300]!r}",
            )
        return response

    async def proxy_call(request: Request, endpoint: Endpoint, claims: TokenClaims) -> Response:
        body = await read_json_object(request, settings.max_body_bytes)
        return await noting_incidents(claims, gateway.proxy.handle(request, endpoint, claims, body))

    async def report(claims: TokenClaims, agent_report: AgentReport) -> Response:
        await gateway.registry.check_open(claims.rollout_id, claims.attempt)
        await gateway.registry.signal_report(claims.rollout_id, agent_report)
        return JSONResponse({"accepted": True})

    async def models_listing() -> dict[str, Any]:
        names = await gateway.proxy.models()
        return {
            "object": "list",
            "data": [{"id": n, "object": "model", "owned_by": "darl"} for n in names],
        }

    # --- agent routes --------------------------------------------------------------------

    @app.post("/rollouts/{rollout_id}/v1/chat/completions")
    async def chat(request: Request, claims: RolloutClaims) -> Response:
        return await proxy_call(request, CHAT, claims)

    @app.post("/rollouts/{rollout_id}/v1/completions")
    async def completions(request: Request, claims: RolloutClaims) -> Response:
        return await proxy_call(request, COMPLETIONS, claims)

    @app.get("/rollouts/{rollout_id}/v1/models")
    async def models(claims: RolloutClaims) -> dict[str, Any]:
        return await models_listing()

    @app.post("/rollouts/{rollout_id}/result")
    async def result(request: Request, claims: RolloutClaims) -> Response:
        body = await read_json_object(request, settings.max_body_bytes)
        try:
            agent_report = AgentReport.model_validate({**body, "attempt": claims.attempt})
        except ValidationError as err:
            raise bad_request(
                f"invalid result: {describe_errors(err.errors())}", "invalid_result"
            ) from err
        return await noting_incidents(claims, report(claims, agent_report))

    # --- Agent Lightning v1.0 routes -----------------------------------------------------

    agl = "/proxy/rollout/{rollout_id}/attempt/{attempt}/mode/{mode}/openai/v1"

    @app.post(agl + "/chat/completions")
    async def agl_chat(request: Request, claims: AglClaims) -> Response:
        return await proxy_call(request, CHAT, claims)

    @app.post(agl + "/completions")
    async def agl_completions(request: Request, claims: AglClaims) -> Response:
        return await proxy_call(request, COMPLETIONS, claims)

    @app.get(agl + "/models")
    async def agl_models(claims: AglClaims) -> dict[str, Any]:
        return await models_listing()

    @app.post("/api/rollouts/{rollout_id}/attempt/{attempt}/events")
    async def agl_events(request: Request, claims: AglClaims) -> Response:
        body = await read_json_object(request, settings.max_body_bytes)
        try:
            event = AglEvent.model_validate(body)
            if event.event_type != "reward":
                # Agent Lightning's other events (spans, logs) carry nothing DARL trains on.
                return JSONResponse(
                    {"accepted": False, "reason": f"event type {event.event_type!r} ignored"}
                )
            agent_report = AgentReport(attempt=claims.attempt, reward=event.data.get("value"))
        except ValidationError as err:
            raise bad_request(
                f"invalid event: {describe_errors(err.errors())}", "invalid_event"
            ) from err
        return await noting_incidents(claims, report(claims, agent_report))

    # --- admin ---------------------------------------------------------------------------

    @app.post("/admin/pause", dependencies=[Depends(_admin)])
    async def pause(request: Request) -> dict[str, Any]:
        body = await read_model(request, PauseRequest, settings.max_body_bytes)
        gateway.gate.pause(body.mode)
        gateway.save_state()
        drained = None
        if body.drain_timeout_seconds is not None:
            drained = await gateway.gate.drain(body.drain_timeout_seconds)
        return {**gateway.state(), "drained": drained}

    @app.post("/admin/resume", dependencies=[Depends(_admin)])
    async def resume(request: Request) -> dict[str, Any]:
        body = await read_model(request, ResumeRequest, settings.max_body_bytes)
        was_paused = gateway.gate.paused
        gateway.gate.resume(body.policy_version)
        gateway.save_state()
        if was_paused:
            gateway.metrics.pause_seconds.observe(gateway.gate.last_pause_seconds)
        return gateway.state()

    @app.get("/admin/state", dependencies=[Depends(_admin)])
    async def state() -> dict[str, Any]:
        return gateway.state()

    @app.put("/admin/upstreams", dependencies=[Depends(_admin)])
    async def set_upstreams(request: Request) -> dict[str, Any]:
        body = await read_model(request, UpstreamsRequest, settings.max_body_bytes)
        gateway.pool.set(body.upstreams)
        gateway.save_state()
        return gateway.state()

    @app.get("/admin/rollouts/{rollout_id}/attempts/{attempt}", dependencies=[Depends(_admin)])
    async def attempt_state(rollout_id: str, attempt: int) -> dict[str, Any]:
        """Whether the attempt was closed (its agent ended), by this gateway or an earlier one."""
        closed = gateway.registry.is_closed(rollout_id, attempt) or await gateway.store.is_closed(
            rollout_id, attempt
        )
        return {"closed": closed}

    @app.post(
        "/admin/rollouts/{rollout_id}/attempts/{attempt}/close", dependencies=[Depends(_admin)]
    )
    async def close_attempt(request: Request, rollout_id: str, attempt: int) -> dict[str, Any]:
        """The worker's word that the attempt's agent ended: refuse its calls from now on and
        deliver its pending call events (503 if Temporal is unreachable: retry). The answer
        says what DARL did to the attempt: its 5xx answers and the gateway's outages since
        the agent started."""
        body = await read_model(request, CloseRequest, settings.max_body_bytes)
        delivered = await gateway.delivery.close_attempt(rollout_id, attempt)
        incidents = await gateway.incidents(rollout_id, attempt, body.started_at)
        return {"closed": True, "delivered": delivered, "infra_incidents": incidents}

    # --- operations ----------------------------------------------------------------------

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "paused": gateway.gate.paused}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(RequestCounter, metrics=gateway.metrics)
    FastAPIInstrumentor.instrument_app(
        app, excluded_urls="healthz,metrics", exclude_spans=["receive", "send"]
    )
    return TokenTraceContext(app)


def unwrap(app: Any) -> FastAPI:
    """The FastAPI app inside the tracing wrapper (for tests and the server's lifespan)."""
    inner: FastAPI = app.app if isinstance(app, TokenTraceContext) else app
    return inner
