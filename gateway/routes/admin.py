"""The routes the trainer and the rollout workers call (the admin key guards them): pause and
resume around a weight sync, the upstreams, an attempt's closed mark, its opening and its
close; and the operator's health and metrics."""

from __future__ import annotations

import importlib.metadata

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from darl.gateway.calls.replay import check_lineage, replay_outcome
from darl.gateway.routes.bodies import documented, read_model
from darl.gateway.routes.dependencies import admin, gateway_of
from darl.gateway.state import GatewayState
from darl.workflows.contracts import ModelCallEvent, PrefixSpec, ReplayOutcome
from darl.workflows.rollout_token import PrefixClaim
from darl.workflows.training_config import PauseMode

router = APIRouter()
ADMIN = [Depends(admin)]


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
    # Answer with the attempt's call events instead of signalling them, if it recorded no more
    # than this many (0, the default: signal them).
    return_events_up_to: int = Field(default=0, ge=0, le=4096)
    # The attempt resumed by replaying these earlier attempts' record (newest first): say
    # what it made of it.
    replay_from: list[int] = Field(default_factory=list, max_length=20)
    # The attempt's rollout starts from this prefix (RolloutSpec.prefix): say how much of it
    # the attempt reproduced.
    prefix: PrefixSpec | None = None


class PauseAnswer(GatewayState):
    # Whether the in-flight calls finished within drain_timeout_seconds (None: not asked).
    drained: bool | None


class AttemptState(BaseModel):
    closed: bool


class CloseAnswer(BaseModel):
    closed: bool
    # Call events signalled to the workflow by this close.
    delivered: int
    # The attempt's call events, when the close asked for them (`return_events_up_to`).
    events: list[ModelCallEvent] | None
    # What DARL did to the attempt: its 5xx answers and the gateway outages it lived through.
    infra_incidents: list[str]
    # The attempt's model calls that got no answer, one line each.
    failed_calls: list[str]
    # For an attempt that replayed earlier ones' record: what it made of it (rule 10).
    replay: ReplayOutcome | None


class Health(BaseModel):
    status: str
    paused: bool


class Index(BaseModel):
    name: str
    version: str
    instance: str
    policy_version: int
    paused: bool
    routes: dict[str, str]
    docs: str


@router.post("/admin/pause", dependencies=ADMIN, openapi_extra=documented(PauseRequest))
async def pause(request: Request) -> PauseAnswer:
    gateway = gateway_of(request)
    body = await read_model(request, PauseRequest, gateway.settings.max_body_bytes)
    gateway.gate.pause(body.mode)
    gateway.save_state()
    drained = None
    if body.drain_timeout_seconds is not None:
        drained = await gateway.gate.drain(body.drain_timeout_seconds)
    return PauseAnswer(**gateway.state().model_dump(), drained=drained)


@router.post("/admin/resume", dependencies=ADMIN, openapi_extra=documented(ResumeRequest))
async def resume(request: Request) -> GatewayState:
    gateway = gateway_of(request)
    body = await read_model(request, ResumeRequest, gateway.settings.max_body_bytes)
    was_paused = gateway.gate.paused
    gateway.gate.resume(body.policy_version)
    gateway.save_state()
    if was_paused:
        gateway.metrics.pause_seconds.observe(gateway.gate.last_pause_seconds)
    return gateway.state()


@router.get("/admin/state", dependencies=ADMIN)
async def state(request: Request) -> GatewayState:
    return gateway_of(request).state()


@router.put("/admin/upstreams", dependencies=ADMIN, openapi_extra=documented(UpstreamsRequest))
async def set_upstreams(request: Request) -> GatewayState:
    gateway = gateway_of(request)
    body = await read_model(request, UpstreamsRequest, gateway.settings.max_body_bytes)
    gateway.pool.set(body.upstreams)
    gateway.save_state()
    return gateway.state()


@router.get("/admin/rollouts/{rollout_id}/attempts/{attempt}", dependencies=ADMIN)
async def attempt_state(request: Request, rollout_id: str, attempt: int) -> AttemptState:
    """Whether the attempt was closed (its agent ended), by this gateway or an earlier one."""
    closed = await gateway_of(request).registry.was_closed(rollout_id, attempt)
    return AttemptState(closed=closed)


@router.post("/admin/rollouts/{rollout_id}/attempts/{attempt}/open", dependencies=ADMIN)
async def open_attempt(request: Request, rollout_id: str, attempt: int) -> AttemptState:
    """The worker's word that the rollout's workflow runs and the attempt's agent is about to
    start: the attempt's calls need not ask Temporal whether it runs. Answers whether the
    attempt was closed already (by this gateway or an earlier one), as the GET does; a closed
    attempt stays closed."""
    closed = await gateway_of(request).registry.opened(rollout_id, attempt)
    return AttemptState(closed=closed)


@router.post(
    "/admin/rollouts/{rollout_id}/attempts/{attempt}/close",
    dependencies=ADMIN,
    openapi_extra=documented(CloseRequest),
)
async def close_attempt(request: Request, rollout_id: str, attempt: int) -> CloseAnswer:
    """The worker's word that the attempt's agent ended: refuse its calls from now on and
    hand over its call events: in the answer (`events`, every one the store holds, when the
    worker asked and there are no more than it said; idempotent: a retried close answers
    them again), or else signalled to the workflow (503 if Temporal is unreachable: retry).
    The answer also says what DARL did to the attempt (its 5xx answers and the gateway's
    outages since the agent started), which of its model calls got no answer and, for an
    attempt that replayed an earlier one's record, what it made of it (rule 10)."""
    gateway = gateway_of(request)
    body = await read_model(request, CloseRequest, gateway.settings.max_body_bytes)
    closed = await gateway.delivery.close_attempt(
        rollout_id, attempt, return_up_to=body.return_events_up_to
    )
    gateway.replays.forget(rollout_id, attempt)
    incidents = await gateway.incidents(rollout_id, attempt, body.started_at)
    failed = await gateway.store.failed_calls(rollout_id, attempt)
    replay = None
    if body.replay_from or body.prefix is not None:
        prefix = None
        if body.prefix is not None:
            prefix = PrefixClaim(body.prefix.rollout_id, body.prefix.attempt, body.prefix.calls)
        check_lineage(body.replay_from, attempt, prefix)
        replay = await replay_outcome(
            gateway.store, rollout_id, body.replay_from, closed.records, prefix
        )
    return CloseAnswer(
        closed=True,
        delivered=closed.delivered,
        events=closed.events,
        infra_incidents=incidents,
        failed_calls=[f.summary() for f in failed],
        replay=replay,
    )


# --- operations ---------------------------------------------------------------------------


@router.get("/")
async def index(request: Request) -> Index:
    """What a person who opens the gateway's address finds: what it is, where it stands, and
    the routes that matter (agents use `/rollouts/<rollout id>/v1` as their base URL)."""
    gateway = gateway_of(request)
    return Index(
        name="DARL gateway",
        version=importlib.metadata.version("darl"),
        instance=gateway.settings.instance,
        policy_version=gateway.gate.policy_version,
        paused=gateway.gate.paused,
        routes={
            "OpenAI chat, completions, Responses (an agent's base URL)": (
                "/rollouts/{rollout_id}/v1"
            ),
            "Anthropic Messages": "/rollouts/{rollout_id}/v1/messages",
            "the agent's result": "/rollouts/{rollout_id}/result",
            "Agent Lightning": (
                "/proxy/rollout/{rollout_id}/attempt/{attempt}/mode/{mode}/openai/v1"
            ),
            "Agent Lightning's rollout (its task)": "/api/rollouts/{rollout_id}",
            "admin (the admin key)": "/admin/state",
            "health": "/healthz",
            "metrics": "/metrics",
        },
        docs="/docs",
    )


@router.get("/healthz")
async def healthz(request: Request) -> Health:
    return Health(status="ok", paused=gateway_of(request).gate.paused)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    registry = gateway_of(request).metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
