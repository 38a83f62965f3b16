"""The routes agents call: the OpenAI-compatible rollout routes and the result route (Agent
Lightning v1.0's are in `agl.py`). A 5xx answer to an agent (of the gateway's or a policy
server's making) is an incident of its attempt (rule 7 of docs/architecture.md)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from darl.gateway.errors import APIError, InvalidResultError, describe_errors
from darl.gateway.protocols.chat.protocol import (
    CHAT,
    COMPLETIONS,
    ChatCompletionRequest,
    CompletionRequest,
    Endpoint,
)
from darl.gateway.protocols.chat.sent_messages import read_chat
from darl.gateway.protocols.messages.protocol import CountTokensRequest, MessagesRequest
from darl.gateway.protocols.messages.translation import (
    MessagesTranslation,
    chat_messages,
    chat_tools,
)
from darl.gateway.protocols.responses.protocol import ResponsesRequest
from darl.gateway.protocols.responses.translation import ResponsesTranslation
from darl.gateway.protocols.translation import Translation, parse_request
from darl.gateway.routes.bodies import documented, json_object, read_body, read_json_object
from darl.gateway.routes.dependencies import (
    ROLLOUT_ID_PARAMETER,
    RolloutClaims,
    claims_of,
    gateway_of,
)
from darl.gateway.state import Gateway
from darl.workflows.contracts import AgentReport
from darl.workflows.rollout_token import TokenClaims

router = APIRouter()


# The bodies the routes read themselves, as the OpenAPI schema at /docs shows them.
CHAT_BODY = documented(ChatCompletionRequest)
COMPLETION_BODY = documented(CompletionRequest)


def model_route(*models: type[BaseModel]) -> dict[str, Any]:
    """A model route's `openapi_extra`: its body, and the rollout id in its path. The model
    routes, every call's, read their claims themselves (`claims_of`), without a dependency."""
    return {**documented(*models), "parameters": [ROLLOUT_ID_PARAMETER]}


async def noting_incidents(
    gateway: Gateway, claims: TokenClaims, work: Awaitable[Response]
) -> Response:
    """An agent's request; a 5xx answer to it (of the gateway's or a policy server's
    making) is an incident of its attempt."""
    try:
        response = await work
    except APIError as err:
        if err.status >= 500:
            await gateway.recorder.incident(claims, f"{err.status} {err.message}")
        raise
    if response.status_code >= 500:
        await gateway.recorder.incident(
            claims,
            f"{response.status_code} from the policy server: "
            f"{getattr(response, 'body', b'')[:300]!r}",
        )
    return response


async def proxy_call(
    request: Request,
    endpoint: Endpoint,
    claims: TokenClaims,
    agent_protocol: type[Translation] | None = None,
) -> Response:
    """An agent's model call: in the endpoint's own shape, or in `agent_protocol` (its
    `Translation` turns it into a chat call)."""
    gateway = gateway_of(request)
    sent = await read_body(request, gateway.settings.max_body_bytes)
    # A chat call's messages pass through as sent, unread (see `sent_messages`).
    body = read_chat(sent) if endpoint == CHAT and agent_protocol is None else None
    work = gateway.proxy.handle(
        request, endpoint, claims, json_object(sent) if body is None else body, agent_protocol
    )
    return await noting_incidents(gateway, claims, work)


async def report(gateway: Gateway, claims: TokenClaims, agent_report: AgentReport) -> Response:
    await gateway.registry.check_open(claims.rollout_id, claims.attempt)
    await gateway.registry.signal_report(claims.rollout_id, agent_report)
    return JSONResponse({"accepted": True})


async def models_listing(gateway: Gateway) -> dict[str, Any]:
    names = await gateway.upstream_models.models()
    return {
        "object": "list",
        "data": [{"id": n, "object": "model", "owned_by": "darl"} for n in names],
    }


# --- the rollout routes (OPENAI_BASE_URL) -------------------------------------------------


@router.post(
    "/rollouts/{rollout_id}/v1/chat/completions", openapi_extra=model_route(ChatCompletionRequest)
)
async def chat(request: Request) -> Response:
    return await proxy_call(request, CHAT, claims_of(request))


@router.post("/rollouts/{rollout_id}/v1/completions", openapi_extra=model_route(CompletionRequest))
async def completions(request: Request) -> Response:
    return await proxy_call(request, COMPLETIONS, claims_of(request))


@router.post("/rollouts/{rollout_id}/v1/responses", openapi_extra=model_route(ResponsesRequest))
async def responses(request: Request) -> Response:
    """The OpenAI Responses API (the OpenAI Agents SDK's default model)."""
    return await proxy_call(request, CHAT, claims_of(request), ResponsesTranslation)


@router.post("/rollouts/{rollout_id}/v1/messages", openapi_extra=model_route(MessagesRequest))
async def messages(request: Request) -> Response:
    """The Anthropic Messages API (ANTHROPIC_BASE_URL is /rollouts/{rollout_id})."""
    return await proxy_call(request, CHAT, claims_of(request), MessagesTranslation)


@router.post(
    "/rollouts/{rollout_id}/v1/messages/count_tokens",
    openapi_extra=documented(CountTokensRequest),
)
async def count_tokens(request: Request, claims: RolloutClaims) -> dict[str, int]:
    gateway = gateway_of(request)
    body = await read_json_object(request, gateway.settings.max_body_bytes)
    counted = parse_request(CountTokensRequest, body, "count_tokens")
    chat = {"messages": chat_messages(counted), **chat_tools(counted)}
    return {"input_tokens": await gateway.upstream_models.count_prompt_tokens(claims, chat)}


@router.get("/rollouts/{rollout_id}/v1/models")
async def models(request: Request, claims: RolloutClaims) -> dict[str, Any]:
    return await models_listing(gateway_of(request))


@router.post("/rollouts/{rollout_id}/result", openapi_extra=documented(AgentReport))
async def result(request: Request, claims: RolloutClaims) -> Response:
    gateway = gateway_of(request)
    body = await read_json_object(request, gateway.settings.max_body_bytes)
    try:
        agent_report = AgentReport.model_validate({**body, "attempt": claims.attempt})
    except ValidationError as err:
        raise InvalidResultError(f"invalid result: {describe_errors(err.errors())}") from err
    return await noting_incidents(gateway, claims, report(gateway, claims, agent_report))
