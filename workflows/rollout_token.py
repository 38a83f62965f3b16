"""Per-rollout agent tokens: HMAC-signed claims scoped to one rollout attempt, with an expiry.

The worker mints a token when it launches an agent; the gateway verifies it on every call
without shared state. A token cannot act on another rollout, and it is never an admin key.
Pure functions (stdlib hmac), so the contract lives beside the other contracts.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from dataclasses import dataclass

from darl.workflows.errors import WorkflowsError

TOKEN_PREFIX = "darl1"


class TokenError(WorkflowsError, ValueError):
    """The token is missing, malformed, forged or expired; `reason` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class TokenExpiredError(TokenError):
    pass


@dataclass(frozen=True)
class PrefixClaim:
    """The first `calls` calls of attempt `attempt` of rollout `rollout_id`: the recorded
    prefix a rollout starts from (`RolloutSpec.prefix`)."""

    rollout_id: str
    attempt: int
    calls: int


@dataclass(frozen=True)
class ReplayClaim:
    """The attempt replays the calls its earlier attempts recorded (rule 10): `sources`, newest
    first, is the lineage of its record (the last attempt that recorded calls, then the one
    that attempt replayed, ...), and `prefix` the other rollout's calls the lineage starts
    from (a branch's; its first attempt has no sources); requests are matched with the
    rollout's normalizers (`RolloutSpec.replay`)."""

    sources: tuple[int, ...]
    normalize: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    prefix: PrefixClaim | None = None


@dataclass(frozen=True)
class TokenClaims:
    rollout_id: str
    attempt: int
    mode: str
    expires_at: int
    # The rollout's trace context, so the gateway joins the agent's calls to the rollout's
    # trace even when the agent sends no traceparent header.
    traceparent: str | None = None
    # Set on an attempt that resumes by replay: the workflow decides, the gateway obeys.
    replay: ReplayClaim | None = None


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _sign(secret: bytes, payload: str) -> str:
    return _b64(hmac.new(secret, payload.encode("ascii"), hashlib.sha256).digest())


def mint_token(secret: bytes, claims: TokenClaims) -> str:
    body: dict[str, object] = {
        "r": claims.rollout_id,
        "a": claims.attempt,
        "m": claims.mode,
        "e": claims.expires_at,
    }
    if claims.traceparent:
        body["tp"] = claims.traceparent
    if claims.replay is not None:
        replay: dict[str, object] = {"a": list(claims.replay.sources)}
        if claims.replay.normalize:
            replay["n"] = list(claims.replay.normalize)
        if claims.replay.patterns:
            replay["p"] = list(claims.replay.patterns)
        prefix = claims.replay.prefix
        if prefix is not None:
            replay["x"] = [prefix.rollout_id, prefix.attempt, prefix.calls]
        body["rp"] = replay
    payload = _b64(json.dumps(body, separators=(",", ":")).encode("utf-8"))
    return f"{TOKEN_PREFIX}.{payload}.{_sign(secret, payload)}"


def decode_claims(token: str) -> TokenClaims:
    """Parse without checking the signature (for trace context only; never for access)."""
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
        raise TokenError("malformed rollout token")
    try:
        body = json.loads(_unb64(parts[1]))
        return TokenClaims(
            rollout_id=str(body["r"]),
            attempt=int(body["a"]),
            mode=str(body["m"]),
            expires_at=int(body["e"]),
            traceparent=body.get("tp"),
            replay=_replay_claim(body.get("rp")),
        )
    except (ValueError, KeyError, TypeError, binascii.Error) as err:
        raise TokenError("malformed rollout token") from err


def _replay_claim(value: object) -> ReplayClaim | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError("replay claim is not an object")
    prefix = value.get("x")
    return ReplayClaim(
        sources=tuple(int(a) for a in value["a"]),
        normalize=tuple(str(n) for n in value.get("n") or ()),
        patterns=tuple(str(p) for p in value.get("p") or ()),
        prefix=None
        if prefix is None
        else PrefixClaim(rollout_id=str(prefix[0]), attempt=int(prefix[1]), calls=int(prefix[2])),
    )


def verify_token(secret: bytes, token: str, now: float) -> TokenClaims:
    """Return the claims of a genuine, unexpired token; raise TokenError otherwise."""
    claims = decode_claims(token)
    _, payload, signature = token.split(".")
    if not hmac.compare_digest(_sign(secret, payload), signature):
        raise TokenError("rollout token signature is invalid")
    if now >= claims.expires_at:
        raise TokenExpiredError("rollout token has expired")
    return claims
