"""The routes agents call: the OpenAI-compatible rollout routes and the result route, and
Agent Lightning v1.0's proxy and event routes. A 5xx answer to an agent (of the gateway's or a
policy server's making) is an incident of its attempt (rule 7 of docs/architecture.md)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from darl.gateway.bodies import read_json_object
from darl.gateway.capture import CHAT, COMPLETIONS, Endpoint
from darl.gateway.dependencies import AglClaims, RolloutClaims, gateway_of
from darl.gateway.errors import GatewayError, bad_request, describe_errors
from darl.workflows.contracts import AgentReport
from darl.workflows.rollout_token import TokenClaims

if TYPE_CHECKING:
    from darl.gateway.app import Gateway

router = APIRouter()

AGL = "/proxy/rollout/{rollout_id}/attempt/{attempt}/mode/{mode}/openai/v1"


class AglEvent(BaseModel):
    model_config = ConfigDict(extra="allow")
    event_type: str
    data: dict[str, Any] = Field(default_factory=dict)


async def noting_incidents(
    gateway: Gateway, claims: TokenClaims, work: Awaitable[Response]
) -> Response:
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
    gateway = gateway_of(request)
    body = await read_json_object(request, gateway.settings.max_body_bytes)
    work = gateway.proxy.handle(request, endpoint, claims, body)
    return await noting_incidents(gateway, claims, work)


async def report(gateway: Gateway, claims: TokenClaims, agent_report: AgentReport) -> Response:
    await gateway.registry.check_open(claims.rollout_id, claims.attempt)
    await gateway.registry.signal_report(claims.rollout_id, agent_report)
    return JSONResponse({"accepted": True})


async def models_listing(gateway: Gateway) -> dict[str, Any]:
    names = await gateway.proxy.models()
    return {
        "object": "list",
        "data": [{"id": n, "object": "model", "owned_by": "darl"} for n in names],
    }


# --- the rollout routes (OPENAI_BASE_URL) -------------------------------------------------


@router.post("/rollouts/{rollout_id}/v1/chat/completions")
async def chat(request: Request, claims: RolloutClaims) -> Response:
    return await proxy_call(request, CHAT, claims)


@router.post("/rollouts/{rollout_id}/v1/completions")
async def completions(request: Request, claims: RolloutClaims) -> Response:
    return await proxy_call(request, COMPLETIONS, claims)


@router.get("/rollouts/{rollout_id}/v1/models")
async def models(request: Request, claims: RolloutClaims) -> dict[str, Any]:
    return await models_listing(gateway_of(request))


@router.post("/rollouts/{rollout_id}/result")
async def result(request: Request, claims: RolloutClaims) -> Response:
    gateway = gateway_of(request)
    body = await read_json_object(request, gateway.settings.max_body_bytes)
    try:
        agent_report = AgentReport.model_validate({**body, "attempt": claims.attempt})
    except ValidationError as err:
        raise bad_request(
            f"invalid result: {describe_errors(err.errors())}", "invalid_result"
        ) from err
    return await noting_incidents(gateway, claims, report(gateway, claims, agent_report))


# --- Agent Lightning v1.0 routes ----------------------------------------------------------


@router.post(AGL + "/chat/completions")
async def agl_chat(request: Request, claims: AglClaims) -> Response:
    return await proxy_call(request, CHAT, claims)


@router.post(AGL + "/completions")
async def agl_completions(request: Request, claims: AglClaims) -> Response:
    return await proxy_call(request, COMPLETIONS, claims)


@router.get(AGL + "/models")
async def agl_models(request: Request, claims: AglClaims) -> dict[str, Any]:
    return await models_listing(gateway_of(request))


@router.post("/api/rollouts/{rollout_id}/attempt/{attempt}/events")
async def agl_events(request: Request, claims: AglClaims) -> Response:
    gateway = gateway_of(request)
    body = await read_json_object(request, gateway.settings.max_body_bytes)
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
    return await noting_incidents(gateway, claims, report(gateway, claims, agent_report))
