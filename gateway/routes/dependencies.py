"""What the gateway's routes depend on: the app's Gateway, an agent's token claims (on the
rollout routes and, tied to its attempt, on Agent Lightning's), the admin key."""

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


async def agent_claims(request: Request, rollout_id: str) -> TokenClaims:
    return rollout_claims(request, rollout_id, gateway_of(request).settings.token_secret)


async def agl_claims(request: Request, rollout_id: str, attempt: int) -> TokenClaims:
    claims = await agent_claims(request, rollout_id)
    if claims.attempt != attempt:
        raise ForbiddenError("this token belongs to another attempt")
    return claims


async def admin(request: Request) -> None:
    require_admin(request, gateway_of(request).settings.admin_key)


RolloutClaims = Annotated[TokenClaims, Depends(agent_claims)]
AglClaims = Annotated[TokenClaims, Depends(agl_claims)]
