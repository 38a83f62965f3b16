"""What the gateway's routes depend on: the app's Gateway, an agent's token claims (on the
rollout routes, read by the model routes themselves, and, tied to its attempt, on Agent
Lightning's), the admin key."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from darl.gateway.auth import require_admin, rollout_claims
from darl.gateway.errors import ForbiddenError
from darl.gateway.state import Gateway
from darl.workflows.rollout_token import TokenClaims

# Dependencies are coroutines: FastAPI runs plain functions in a thread pool, a thread hop per
# request that costs more than the check itself.


def gateway_of(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


def claims_of(request: Request) -> TokenClaims:
    """An agent's token claims on a rollout route (`{rollout_id}` in its path), for a route
    that reads them itself: the model routes do, as FastAPI's solving of a dependency cost
    15-35 us a call (docs/benchmarks.md), against ~0.6 ms of the gateway's CPU on a short
    call. Such a route declares the path parameter for `/docs` with `ROLLOUT_ID_PARAMETER`."""
    return rollout_claims(
        request, request.path_params["rollout_id"], gateway_of(request).settings.token_secret
    )


async def agent_claims(request: Request, rollout_id: str) -> TokenClaims:
    # `rollout_id` declares the path parameter (FastAPI documents it); `claims_of` reads it.
    return claims_of(request)


async def agl_claims(request: Request, rollout_id: str, attempt: int) -> TokenClaims:
    claims = await agent_claims(request, rollout_id)
    if claims.attempt != attempt:
        raise ForbiddenError("this token belongs to another attempt")
    return claims


async def admin(request: Request) -> None:
    require_admin(request, gateway_of(request).settings.admin_key)


# The rollout id in a rollout route's path, as FastAPI declares a path parameter, for a
# route that reads its claims with `claims_of` rather than through RolloutClaims.
ROLLOUT_ID_PARAMETER = {
    "name": "rollout_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "title": "Rollout Id"},
}

RolloutClaims = Annotated[TokenClaims, Depends(agent_claims)]
AglClaims = Annotated[TokenClaims, Depends(agl_claims)]
