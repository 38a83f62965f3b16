import pytest

from darl.workflows.rollout_token import (
    TokenClaims,
    TokenError,
    TokenExpiredError,
    decode_claims,
    mint_token,
    verify_token,
)

SECRET = b"s3cret"


def claims(**overrides: object) -> TokenClaims:
    values = {"rollout_id": "r-1", "attempt": 2, "mode": "train", "expires_at": 1000}
    values.update(overrides)
    return TokenClaims(**values)  # type: ignore[arg-type]


def test_a_genuine_token_verifies_to_its_claims() -> None:
    token = mint_token(SECRET, claims(traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01"))
    assert verify_token(SECRET, token, now=999) == claims(
        traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    )


def test_an_expired_token_is_refused() -> None:
    with pytest.raises(TokenExpiredError):
        verify_token(SECRET, mint_token(SECRET, claims()), now=1000)


def test_a_token_signed_with_another_secret_is_refused() -> None:
    with pytest.raises(TokenError, match="signature"):
        verify_token(SECRET, mint_token(b"other", claims()), now=0)


def test_changing_the_claims_breaks_the_signature() -> None:
    genuine = mint_token(SECRET, claims())
    forged_payload = mint_token(SECRET, claims(rollout_id="r-2")).split(".")[1]
    prefix, _, signature = genuine.split(".")
    with pytest.raises(TokenError, match="signature"):
        verify_token(SECRET, f"{prefix}.{forged_payload}.{signature}", now=0)


@pytest.mark.parametrize("garbage", ["", "abc", "darl1.x.y", "darl1..", "Bearer x.y.z"])
def test_garbage_is_malformed(garbage: str) -> None:
    with pytest.raises(TokenError, match="malformed"):
        decode_claims(garbage)
