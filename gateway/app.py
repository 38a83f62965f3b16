"""The gateway's FastAPI app: its settings, the Gateway that owns its state, and `create_app`,
which serves the agents' routes (`agent_routes`) and the admin API, health and metrics
(`admin_routes`) over one Gateway."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from temporalio.client import Client

from darl.gateway import admin_routes, agent_routes
from darl.gateway.delivery import EventDelivery
from darl.gateway.errors import (
    install_error_handlers,
)
from darl.gateway.forwarding import Forwarder, RetrySettings
from darl.gateway.journal import (
    ALIVE_INTERVAL_SECONDS,
    SILENT_AFTER_SECONDS,
    AdminState,
    GatewayJournal,
    JournalStorage,
)
from darl.gateway.metrics import GatewayMetrics
from darl.gateway.proxy import ModelCallProxy, ProxySettings
from darl.gateway.replay import ReplayBook
from darl.gateway.rollouts import RolloutRegistry
from darl.gateway.store import TrajectoryStore
from darl.gateway.tracing import TokenTraceContext
from darl.gateway.traffic import PauseGate, UpstreamPool
from darl.gateway.versions import UpstreamVersions

log = logging.getLogger(__name__)

# How long a stopping gateway tries to signal the events it still holds.
FLUSH_ON_STOP_SECONDS = 5.0


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
    # The gateway's own durable state (admin state, outages): a directory or a storage such
    # as the S3 store's (`store_url.journal_storage`); None keeps it in memory only.
    journal_dir: Path | JournalStorage | None = None
    # This gateway's name among those sharing a journal (its outages are its own).
    instance: str = "gateway"
    # How long a call waits for a policy server that serves older weights than the run's.
    stale_wait_seconds: float = 120.0
    # How often this gateway tells the journal it is alive: a replica closing an attempt
    # waits for its siblings' next word (rule 7), so this is the latency a close may gain.
    # At most ALIVE_INTERVAL_SECONDS, which the siblings' silence is judged by.
    alive_interval_seconds: float = 0.25
    # How long "not closed" from the store's closed mark is believed: 0 looks on every call
    # (a stat on a directory store); a store where looking costs a request may set more.
    closed_recheck_seconds: float = 0.0


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
        self.registry = RolloutRegistry(
            temporal, store, closed_recheck_seconds=settings.closed_recheck_seconds
        )
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
            ReplayBook(store),
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
            await _hear_from_replicas(self.journal, time.time())
            now = time.time()
            outages = await asyncio.to_thread(self.journal.outages_overlapping, since, now, now)
            found += [o.describe() for o in outages]
        return found

    def follow_the_journal(self, saved: AdminState | None) -> None:
        """While paused: resume if the journal says the replicas were resumed at this
        version or a later one. A replica that (re)started during a weight sync came up paused
        and may have missed the trainer's resume, which went to the replicas it knew."""
        if not self.gate.paused or saved is None or saved.paused:
            return
        if saved.policy_version < self.gate.policy_version:
            return
        self.pool.set(self._upstreams_at_start(saved))
        self.gate.resume(saved.policy_version)
        log.info("resumed as the journal says, at policy version %d", saved.policy_version)

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
        """Tell the journal this gateway is alive, every `alive_interval_seconds`, until it
        begins to stop."""
        if self.journal is None:
            return
        while not self.stopping:
            await asyncio.to_thread(self.journal.alive)
            if self.gate.paused:
                self.follow_the_journal(await asyncio.to_thread(self.journal.load_admin_state))
            await asyncio.sleep(min(self.settings.alive_interval_seconds, ALIVE_INTERVAL_SECONDS))

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


async def _hear_from_replicas(journal: GatewayJournal, asked_at: float) -> None:
    """Wait (an alive interval at most, while the other replicas are well) until every other
    replica sharing the journal has said it is alive since `asked_at`, or has fallen silent:
    one killed a moment ago failed the calls it had in flight, and only its silence says so
    before it restarts. A lone gateway never waits."""
    deadline = asked_at + SILENT_AFTER_SECONDS + ALIVE_INTERVAL_SECONDS
    while time.time() < deadline:
        if not await asyncio.to_thread(journal.unconfirmed_siblings, asked_at):
            return
        await asyncio.sleep(0.05)


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

    app = FastAPI(title="DARL gateway", lifespan=lifespan)
    app.state.gateway = gateway
    install_error_handlers(app)

    app.include_router(agent_routes.router)
    app.include_router(admin_routes.router)
    app.add_middleware(RequestCounter, metrics=gateway.metrics)
    FastAPIInstrumentor.instrument_app(
        app, excluded_urls="healthz,metrics", exclude_spans=["receive", "send"]
    )
    return TokenTraceContext(app)


def unwrap(app: Any) -> FastAPI:
    """The FastAPI app inside the tracing wrapper (for tests and the server's lifespan)."""
    inner: FastAPI = app.app if isinstance(app, TokenTraceContext) else app
    return inner
