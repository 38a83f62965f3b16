"""DARL's httpx transports, in an activity's context (Temporal's ActivityEnvironment): the URL,
token and Idempotency-Key each request gets, and the attempt's own checks."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from temporalio.testing import ActivityEnvironment

from darl.temporal_agents import AgentAttempt, NoAgentAttemptError, darl_async_httpx_client
from darl.temporal_agents.attempt import enter_activity, leave_activity
from darl.temporal_agents.transport import AsyncAttemptTransport, AttemptTransport
from tests.temporal_agents.stub_gateway import StubGateway

ATTEMPT = AgentAttempt(
    base_url="http://127.0.0.1:9/rollouts/r1/v1", token="darl1.tok", rollout_id="r1", attempt=3
)


def recording() -> tuple[list[httpx.Request], httpx.MockTransport]:
    sent: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json={})

    return sent, httpx.MockTransport(answer)


async def test_each_request_goes_to_the_attempt_with_its_key() -> None:
    sent, inner = recording()

    async def in_activity() -> None:
        token = enter_activity(ATTEMPT)
        try:
            async with httpx.AsyncClient(transport=AsyncAttemptTransport(inner)) as client:
                await client.post("http://api.openai.com/v1/chat/completions", json={})
                await client.get("https://elsewhere/openai/v1/models?limit=2")
                # A client's retries of a request: with its own key, or counted by the
                # OpenAI SDK (the same body again); the same body sent anew is a new request.
                for _ in range(2):
                    await client.post(
                        "http://x/v1/responses", headers={"Idempotency-Key": "stainless-1"}
                    )
                for retries in ("0", "1", "2", "0"):
                    await client.post(
                        "http://x/v1/chat/completions",
                        json={"messages": []},
                        headers={"x-stainless-retry-count": retries},
                    )
        finally:
            leave_activity(token)

    env = ActivityEnvironment()
    await env.run(in_activity)
    prefix = f"{env.info.workflow_run_id}/{env.info.activity_id}"
    assert [str(r.url) for r in sent] == [
        "http://127.0.0.1:9/rollouts/r1/v1/chat/completions",
        "http://127.0.0.1:9/rollouts/r1/v1/models?limit=2",
        "http://127.0.0.1:9/rollouts/r1/v1/responses",
        "http://127.0.0.1:9/rollouts/r1/v1/responses",
        *["http://127.0.0.1:9/rollouts/r1/v1/chat/completions"] * 4,
    ]
    assert {r.headers["Authorization"] for r in sent} == {"Bearer darl1.tok"}
    assert {r.headers["Host"] for r in sent} == {"127.0.0.1:9"}
    assert [r.headers["Idempotency-Key"] for r in sent] == [
        f"{prefix}/1",
        f"{prefix}/2",
        f"{prefix}/3",
        f"{prefix}/3",
        f"{prefix}/4",
        f"{prefix}/4",
        f"{prefix}/4",
        f"{prefix}/5",
    ]
    # The activity's first try: a request no client retried says its key is new.
    assert [r.headers.get("X-Darl-First-Try") for r in sent] == [
        "1", "1", "1", None, "1", None, None, "1"
    ]  # fmt: skip


async def one_request(**info: Any) -> httpx.Request:
    """The request one chat call of an activity sends, its `activity.Info` changed by `info`."""
    sent, inner = recording()

    async def in_activity() -> None:
        token = enter_activity(ATTEMPT)
        try:
            async with httpx.AsyncClient(transport=AsyncAttemptTransport(inner)) as client:
                await client.post("http://x/v1/chat/completions", json={})
        finally:
            leave_activity(token)

    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, **info)
    await env.run(in_activity)
    [request] = sent
    return request


async def test_a_retried_activitys_requests_never_say_first_try() -> None:
    """Temporal's retry of the activity repeats its keys: the gateway must look each up."""
    request = await one_request(attempt=2)
    assert request.headers["Idempotency-Key"].endswith("/1")
    assert "X-Darl-First-Try" not in request.headers


def test_a_request_outside_an_attempt_is_refused() -> None:
    sent, inner = recording()
    with (
        httpx.Client(transport=AttemptTransport(inner)) as client,
        pytest.raises(NoAgentAttemptError, match="DarlPlugin"),
    ):
        client.post("http://x/v1/chat/completions", json={})
    assert sent == []


@pytest.mark.parametrize(
    ("value", "wrong"),
    [
        ("darl1.tok", "a DARL attempt is a JSON object, got str"),
        ({"base_url": "http://x/v1", "token": "t", "rollout_id": "r"}, "attempt (int)"),
        (
            {"base_url": "http://x/v1", "token": 1, "rollout_id": "r", "attempt": True},
            "attempt (int), token (str)",
        ),
    ],
)
def test_a_malformed_attempt_says_what_is_wrong(value: object, wrong: str) -> None:
    with pytest.raises(ValueError, match=re.escape(wrong)):
        AgentAttempt.from_value(value)


async def test_the_openai_clients_own_retry_keeps_its_key(gateway: StubGateway) -> None:
    attempt = AgentAttempt(
        base_url=gateway.base_url("r2"), token="darl1.r2", rollout_id="r2", attempt=1
    )
    gateway.fail_next(1)

    async def in_activity() -> None:
        token = enter_activity(attempt)
        try:
            async with AsyncOpenAI(
                api_key="unused", max_retries=1, http_client=darl_async_httpx_client()
            ) as client:
                for _ in range(2):
                    await client.chat.completions.create(
                        model="policy", messages=[{"role": "user", "content": "hi"}]
                    )
        finally:
            leave_activity(token)

    env = ActivityEnvironment()
    await env.run(in_activity)
    prefix = f"{env.info.workflow_run_id}/{env.info.activity_id}"
    assert [(r.status, r.idempotency_key) for r in gateway.seen] == [
        (500, f"{prefix}/1"),
        (200, f"{prefix}/1"),
        (200, f"{prefix}/2"),
    ]


@pytest.mark.parametrize(
    "info", [{"activity_id": "model call " * 20}, {"activity_id": "call-é"}], ids=["long", "utf8"]
)
async def test_an_activity_id_no_key_may_hold_is_digested(info: dict[str, str]) -> None:
    """A key is 1 to 200 visible ASCII characters at the gateway: an activity id the user
    chose (spaces, accents, length) is replaced by its digest, the same on every try."""
    keys = [(await one_request(attempt=a, **info)).headers["Idempotency-Key"] for a in (1, 2)]
    assert keys[0] == keys[1] and keys[0].startswith("sha256:") and keys[0].endswith("/1")
    assert re.fullmatch(r"[!-~]{1,200}", keys[0])


async def test_a_local_activitys_requests_never_say_first_try() -> None:
    """A local activity its worker lost restarts at try 1 when the workflow task is retried:
    its keys may have been sent before."""
    request = await one_request(is_local=True)
    assert "X-Darl-First-Try" not in request.headers
