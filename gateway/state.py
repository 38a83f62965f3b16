"""The gateway's settings and the `Gateway` that owns its state: traffic control, the proxy
and the peers it is handed, which the routes reach too (the recorder, the replayer and its
replay book, the upstream models, the calls in flight), its clients, the journal. It sits
below the routes and the app that serve it: the routes reach it through
`routes/dependencies.py`, nothing here imports a route."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel
from temporalio.client import Client

from darl.gateway.calls.delivery import EventDelivery
from darl.gateway.calls.forwarding import Forwarder, RetrySettings
from darl.gateway.calls.idempotency import IdempotentCalls
from darl.gateway.calls.in_flight import CallsInFlight
from darl.gateway.calls.proxy import ModelCallProxy, ProxySettings
from darl.gateway.calls.recording import CallRecorder
from darl.gateway.calls.replay import ReplayBook
from darl.gateway.calls.replayer import Replayer
from darl.gateway.calls.rollouts import RolloutRegistry
from darl.gateway.calls.traffic import PauseGate, UpstreamPool
from darl.gateway.calls.upstream_models import UpstreamModels
from darl.gateway.calls.versions import UpstreamVersions
from darl.gateway.defaults import (
    INSTANCE,
    MAX_BODY_BYTES,
    SIGNAL_INTERVAL_SECONDS,
    STALE_WAIT_SECONDS,
)
from darl.gateway.journal.base import (
    ALIVE_INTERVAL_SECONDS,
    SILENT_AFTER_SECONDS,
    AdminState,
    GatewayJournal,
    JournalStorage,
)
from darl.gateway.metrics import GatewayMetrics
from darl.gateway.store.base import TrajectoryStore
from darl.workflows.training_config import PauseMode

log = logging.getLogger(__name__)


class GatewayState(BaseModel):
    """Where the gateway stands (`GET /admin/state`, and the answer to pause, resume and a
    change of upstreams)."""

    instance: str
    paused: bool
    mode: PauseMode
    policy_version: int
    # Calls in flight per policy server.
    inflight: dict[str, int]
    # Calls held by a pause right now.
    held: int
    upstreams: list[str]
    # Policy servers seen serving weights older than the run's.
    stale_upstreams: list[str]
    last_pause_seconds: float
    # Call events captured and not yet signalled to their workflows.
    undelivered_events: int


@dataclass(frozen=True)
class GatewaySettings:
    token_secret: bytes
    admin_key: str
    upstreams: tuple[str, ...]
    proxy: ProxySettings = field(default_factory=ProxySettings)
    retry: RetrySettings = field(default_factory=RetrySettings)
    max_body_bytes: int = MAX_BODY_BYTES
    paused_retry_after_seconds: int = 1
    # How often a rollout's captured calls go to its workflow (one batched signal).
    signal_interval_seconds: float = SIGNAL_INTERVAL_SECONDS
    upstream_api_key: str | None = None
    # The gateway's own durable state (admin state, outages): a directory or a storage such
    # as the S3 store's (`store_url.journal_storage`); None keeps it in memory only.
    journal_dir: Path | JournalStorage | None = None
    # This gateway's name among those sharing a journal (its outages are its own).
    instance: str = INSTANCE
    # How long a call waits for a policy server that serves older weights than the run's.
    stale_wait_seconds: float = STALE_WAIT_SECONDS
    # How often this gateway tells the journal it is alive: a replica closing an attempt
    # waits for its siblings' next word (rule 7), so this is the latency a close may gain.
    # At most ALIVE_INTERVAL_SECONDS, which the siblings' silence is judged by.
    alive_interval_seconds: float = 0.25
    # How long "not closed" from the store's closed mark is believed: 0 looks on every call
    # (a stat on a directory store); a store where looking costs a request may set more.
    closed_recheck_seconds: float = 0.0
    # Whether the gateway makes spans of its own (a server span per request, a client span
    # per call to a policy server). Off where the process exports no traces: the spans would
    # be dropped, and making them cost a fifth of the gateway's CPU per call; the policy
    # server is then handed the trace context the agent's call came with, as it came.
    traced: bool = True


class Gateway:
    """Owns the gateway's state: settings, traffic control, the proxy and its peers, and its
    clients."""

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
        self.forwarder = Forwarder(
            settings.retry, settings.upstream_api_key, traced=settings.traced
        )
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
        self.upstream_models = UpstreamModels(
            forwarder=self.forwarder,
            pool=self.pool,
            model=settings.proxy.model,
            call_deadline_seconds=settings.proxy.call_deadline_seconds,
        )
        # The replay sessions of the attempts this gateway serves: the proxy's replayer
        # reads them, a recorded live call ends one, an attempt's close forgets it.
        self.replays = ReplayBook(store)
        self.in_flight = CallsInFlight()
        self.recorder = CallRecorder(
            store=store,
            registry=self.registry,
            delivery=self.delivery,
            metrics=self.metrics,
            replays=self.replays,
        )
        self.replayer = Replayer(
            self.replays,
            store,
            self.registry,
            self.delivery,
            self.metrics,
            self.upstream_models.prompt_ids,
            in_flight=self.in_flight,
            wait_seconds=settings.proxy.call_deadline_seconds,
        )
        self.idempotent = IdempotentCalls(
            store=store,
            registry=self.registry,
            delivery=self.delivery,
            metrics=self.metrics,
            replays=self.replays,
            in_flight=self.in_flight,
            wait_seconds=settings.proxy.call_deadline_seconds,
        )
        self.proxy = ModelCallProxy(
            settings=settings.proxy,
            pool=self.pool,
            gate=self.gate,
            forwarder=self.forwarder,
            store=store,
            registry=self.registry,
            metrics=self.metrics,
            versions=self.versions,
            upstream_models=self.upstream_models,
            recorder=self.recorder,
            replayer=self.replayer,
            in_flight=self.in_flight,
            idempotent=self.idempotent,
            stale_wait_seconds=settings.stale_wait_seconds,
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

    def state(self) -> GatewayState:
        return GatewayState(
            instance=self.settings.instance,
            paused=self.gate.paused,
            mode=self.gate.mode,
            policy_version=self.gate.policy_version,
            inflight=self.gate.inflight(),
            held=self.gate.held,
            upstreams=list(self.pool.urls),
            stale_upstreams=sorted(self.versions.stale),
            last_pause_seconds=self.gate.last_pause_seconds,
            undelivered_events=self.delivery.pending(),
        )


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
