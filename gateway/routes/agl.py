"""Agent Lightning v1.0's routes, as its server answers them, for an agent written for it to run
unchanged: the OpenAI proxy (`AGL_OPENAI_BASE_URL`), the events (`AGL_EVENT_URL`: a reward, or
any event to keep) and the rollout (`GET /api/rollouts/{id}`: the task its `swe_smith` agent
reads). `AGL_KEY` is the rollout token, which opens its own rollout's routes only."""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.convertors import Convertor, register_url_convertor

from darl.gateway.calls.rollouts import StartedRollout
from darl.gateway.errors import InvalidEventError, describe_errors
from darl.gateway.protocols.chat.protocol import CHAT, COMPLETIONS
from darl.gateway.routes.agent import (
    CHAT_BODY,
    COMPLETION_BODY,
    models_listing,
    noting_incidents,
    proxy_call,
)
from darl.gateway.routes.bodies import documented, read_json_object
from darl.gateway.routes.dependencies import AglClaims, RolloutClaims, gateway_of
from darl.workflows.contracts import AgentReport, RolloutMode
from darl.workflows.rollout_token import TokenClaims

router = APIRouter()


class AglMode(Convertor[str]):
    """Agent Lightning's mode path segment: `train` or `val`; any other path is a 404, as
    Agent Lightning answers it."""

    regex = "train|val"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("agl_mode", AglMode())

AGL = "/proxy/rollout/{rollout_id}/attempt/{attempt}/mode/{mode:agl_mode}/openai/v1"
# The mode segment, which no parameter of the routes declares (the path's convertor reads it),
# as `/docs` shows it.
MODE_PARAMETER = {
    "name": "mode",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "enum": AglMode.regex.split("|"), "title": "Mode"},
}
AGL_EVENTS = "/api/rollouts/{rollout_id}/attempt/{attempt}/events"
AGL_ROLLOUT = "/api/rollouts/{rollout_id}"


class AglEvent(BaseModel):
    """Agent Lightning's `EventCreate`. A `reward` event's `data.value` is the attempt's
    reward and its other fields (`source`, `reason`, `message`, ...) go into the rollout's
    metadata; any other event is stored with the attempt (`TrajectoryStore.events`)."""

    model_config = ConfigDict(extra="allow")
    event_type: str
    data: dict[str, Any] = Field(default_factory=dict)

    def report(self, attempt: int) -> AgentReport:
        metadata = {k: v for k, v in self.data.items() if k != "value"}
        return AgentReport(attempt=attempt, reward=self.data.get("value"), metadata=metadata)


# --- Agent Lightning's rollout, as its `RolloutDetail` -----------------------------------


class AglRolloutConfig(BaseModel):
    """Agent Lightning's `RolloutConfig`: DARL's agent timeout; its runner settings are
    DARL's own (the spec's `agent`), not Agent Lightning's."""

    timeout_seconds: int
    local: dict[str, Any] | None = None
    k8s: dict[str, Any] | None = None


class AglRolloutMetadata(BaseModel):
    """Agent Lightning's `RolloutMetadata` (its batch fields; DARL has none) with DARL's run and
    group ids."""

    batch_idx: int | None = None
    sample_idx_in_batch: int | None = None
    run_id: str
    group_id: str


class AglRolloutStatus(BaseModel):
    """Agent Lightning's `RolloutLifecycleStatus`: a rollout whose agent may ask is running."""

    state: Literal["queuing", "running", "succeeded", "failed"] = "running"
    k8s_job_name: str | None = None
    last_attempt_id: str
    error_message: str | None = None
    version: int = 1
    created_at: float
    updated_at: float


class AglRollout(BaseModel):
    """Agent Lightning's `Rollout`: `input` is the task as the agent sees it, without the
    grader's hidden fields (`RolloutSpec.agent_task`)."""

    rollout_id: str
    input: Any
    is_train: bool
    config: AglRolloutConfig
    metadata: AglRolloutMetadata
    status: AglRolloutStatus


class AglRolloutDetail(BaseModel):
    """Agent Lightning's answer to `GET /api/rollouts/{rollout_id}`: the rollout and the ids
    of its attempts so far (DARL's attempt numbers, as in `AGL_EVENT_URL`)."""

    rollout: AglRollout
    attempts: list[str]


def agl_rollout_detail(started: StartedRollout, claims: TokenClaims) -> AglRolloutDetail:
    spec = started.spec
    return AglRolloutDetail(
        rollout=AglRollout(
            rollout_id=spec.rollout_id,
            input=spec.agent_task(),
            is_train=spec.mode == RolloutMode.TRAIN,
            config=AglRolloutConfig(timeout_seconds=int(spec.timeouts.agent_seconds)),
            metadata=AglRolloutMetadata(run_id=spec.run_id, group_id=spec.group_id),
            status=AglRolloutStatus(
                last_attempt_id=str(claims.attempt),
                created_at=started.started_at,
                updated_at=started.started_at,
            ),
        ),
        attempts=[str(n) for n in range(1, claims.attempt + 1)],
    )


# --- the routes -----------------------------------------------------------------------


@router.post(AGL + "/chat/completions", openapi_extra={**CHAT_BODY, "parameters": [MODE_PARAMETER]})
async def agl_chat(request: Request, claims: AglClaims) -> Response:
    return await proxy_call(request, CHAT, claims)


@router.post(
    AGL + "/completions", openapi_extra={**COMPLETION_BODY, "parameters": [MODE_PARAMETER]}
)
async def agl_completions(request: Request, claims: AglClaims) -> Response:
    return await proxy_call(request, COMPLETIONS, claims)


@router.get(AGL + "/models", openapi_extra={"parameters": [MODE_PARAMETER]})
async def agl_models(request: Request, claims: AglClaims) -> dict[str, Any]:
    return await models_listing(gateway_of(request))


@router.post(AGL_EVENTS, openapi_extra=documented(AglEvent))
async def agl_events(request: Request, claims: AglClaims) -> Response:
    """Answered, as Agent Lightning does, with the event as recorded (and `accepted`) once
    it is durable: a reward in the rollout's workflow, any other event in the store."""
    gateway = gateway_of(request)
    body = await read_json_object(request, gateway.settings.max_body_bytes)
    try:
        event = AglEvent.model_validate(body)
        agent_report = event.report(claims.attempt) if event.event_type == "reward" else None
    except ValidationError as err:
        raise InvalidEventError(f"invalid event: {describe_errors(err.errors())}") from err

    async def record() -> Response:
        await gateway.registry.check_open(claims.rollout_id, claims.attempt)
        fields = {"event_type": event.event_type, "data": event.data}
        if agent_report is not None:
            await gateway.registry.signal_report(claims.rollout_id, agent_report)
            stored = {**fields, "timestamp": time.time()}
        else:
            stored = await gateway.store.record_event(claims.rollout_id, claims.attempt, fields)
        return JSONResponse(
            {
                "accepted": True,
                "rollout_id": claims.rollout_id,
                "attempt_id": str(claims.attempt),
                **stored,
            }
        )

    return await noting_incidents(gateway, claims, record())


@router.get(AGL_ROLLOUT, response_model=AglRolloutDetail)
async def agl_rollout(request: Request, claims: RolloutClaims) -> Response:
    """The rollout, as Agent Lightning's server answers it (its `swe_smith` agent reads the
    task here, the URL derived from `AGL_EVENT_URL`): to its own attempt's token, while the
    attempt is open; the spec read once from the start of the rollout's workflow."""
    gateway = gateway_of(request)

    async def read() -> Response:
        await gateway.registry.check_open(claims.rollout_id, claims.attempt)
        started = await gateway.registry.started(claims.rollout_id)
        return JSONResponse(agl_rollout_detail(started, claims).model_dump(mode="json"))

    return await noting_incidents(gateway, claims, read())
