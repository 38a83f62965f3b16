"""Who may call what: rollout tokens for the agent routes, the admin key for the admin API.

A rollout token only opens its own rollout (and attempt); the admin key is a separate secret
that no agent ever receives.
"""

from __future__ import annotations

import hmac
import re
import time
from collections.abc import Mapping

from fastapi import Request

from darl.gateway.errors import ForbiddenError, UnauthorizedError, UnknownRolloutError
from darl.workflows.contracts import ROLLOUT_ID_PATTERN
from darl.workflows.rollout_token import TokenClaims, TokenError, verify_token

_ROLLOUT_ID = re.compile(ROLLOUT_ID_PATTERN)


def presented_key_from_headers(headers: Mapping[str, str]) -> str | None:
    """`Authorization: Bearer <key>`, else the `x-api-key` header (the Anthropic SDK's, and
    Agent Lightning's second way), `api-key` or `X-AGL-Key`. Header names are lower case
    (ASGI's and Starlette's spelling)."""
    auth = headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    return headers.get("x-api-key") or headers.get("api-key") or headers.get("x-agl-key")


def presented_key(request: Request) -> str | None:
    return presented_key_from_headers(request.headers)


def check_rollout_id(rollout_id: str) -> None:
    if not _ROLLOUT_ID.match(rollout_id):
        raise UnknownRolloutError(f"unknown rollout {rollout_id[:80]!r}")


def rollout_claims(request: Request, rollout_id: str, secret: bytes) -> TokenClaims:
    check_rollout_id(rollout_id)
    token = presented_key(request)
    if token is None:
        raise UnauthorizedError(
            "missing rollout token (send it as 'Authorization: Bearer <token>' or 'x-api-key')"
        )
    try:
        claims = verify_token(secret, token, time.time())
    except TokenError as err:
        raise UnauthorizedError(err.reason) from err
    if claims.rollout_id != rollout_id:
        raise ForbiddenError("this token belongs to another rollout")
    return claims


def require_admin(request: Request, admin_key: str) -> None:
    key = presented_key(request)
    if key is None:
        raise UnauthorizedError("missing admin key")
    if not hmac.compare_digest(key.encode(), admin_key.encode()):
        raise ForbiddenError("not an admin key")
