"""A model call retried with its `Idempotency-Key` (a Temporal model activity retried after its
worker died mid-call, an HTTP client's own retry) is answered from the gateway's record of the
attempt, never generated twice, over HTTP with the real gateway and reference policy server:
after a received answer (the same call), after the first try's client dropped its connection
mid-generation (the answer, recorded unreceived, becomes the attempt's one call), while the
first try is still being generated (the retry waits). A key names a call of one attempt only;
the same key with another request, or a malformed key, is refused with a body saying why."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import httpx
import pytest

from tests.integration.stack import Stack
from tests.integration.test_unreceived_answers import (
    WAIT,
    answer_text,
    attempt_records,
    close,
    conversation,
    gateway_metric,
    gateway_state,
    generated,
    in_thread,
    policy_frozen,
    token,
    wait_until,
)

pytestmark = pytest.mark.integration

ANSWERS = "darl_gateway_idempotent_answers_total"


def post(
    stack: Stack,
    rollout_id: str,
    body: dict[str, Any],
    key: str | bytes | None,
    *,
    path: str = "chat/completions",
    bearer: str | None = None,
    first_try: bool = False,
) -> httpx.Response:
    """One call of attempt 1 (or the attempt of `bearer`) with `key`, read whole; with
    `first_try`, saying the key was never sent before (as DARL's plugin does on an activity's
    first try)."""
    headers: dict[str, str | bytes] = {"Authorization": f"Bearer {bearer or token(rollout_id, 1)}"}
    if key is not None:
        headers["Idempotency-Key"] = key
    if first_try:
        headers["X-Darl-First-Try"] = "1"
    with httpx.Client(timeout=WAIT) as http:
        return http.post(
            f"{stack.gateway_url}/rollouts/{rollout_id}/v1/{path}", json=body, headers=headers
        )


def chat(
    stack: Stack, rollout_id: str, body: dict[str, Any], key: str, stream: bool
) -> httpx.Response:
    response = post(stack, rollout_id, {**body, "stream": stream}, key)
    assert response.status_code == 200, response.text
    return response


def answers(stack: Stack, unreceived: bool) -> float:
    text = httpx.get(f"{stack.gateway_url}/metrics", timeout=WAIT).text
    label = f'{ANSWERS}{{unreceived="{str(unreceived).lower()}"}} '
    found = [line for line in text.splitlines() if line.startswith(label)]
    return float(found[0].split()[1]) if found else 0.0


async def dropped_mid_generation(
    stack: Stack, rollout_id: str, body: dict[str, Any], key: str, stream: bool
) -> None:
    """The call with `key` reaches the frozen policy server (a stream's headers come back),
    and its client goes away: its connection closed, as the kernel closes a killed worker's."""
    url = f"{stack.gateway_url}/rollouts/{rollout_id}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {token(rollout_id, 1)}", "Idempotency-Key": key}
    async with httpx.AsyncClient(timeout=WAIT) as http:
        if stream:
            async with http.stream("POST", url, json={**body, "stream": True}, headers=headers):
                pass  # the headers came; the connection closes unread
            return
        asking = asyncio.ensure_future(http.post(url, json=body, headers=headers))
        await wait_until(lambda: sum(gateway_state(stack)["inflight"].values()) == 1)
        asking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asking


def key_of(rollout_id: str) -> str:
    """A key as DARL's plugin writes it: <workflow run id>/<activity id>/<n>."""
    return f"{rollout_id}/{uuid.uuid4()}/1"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_retry_after_a_received_answer_is_the_same_call(stack: Stack, stream: bool) -> None:
    rollout_id = await stack.start_idle_rollout(f"idem-received-{uuid.uuid4().hex[:4]}")
    body, key = conversation(rollout_id), key_of(rollout_id)
    before = answers(stack, unreceived=False)
    first = chat(stack, rollout_id, body, key, stream)
    call_id = first.headers["x-darl-call-id"]
    assert "x-darl-idempotent-replay" not in first.headers
    # Retried whole and streamed: the answer in the mode each retry asks.
    retries = [
        chat(stack, rollout_id, body, key, retry_stream) for retry_stream in (stream, not stream)
    ]
    for retry in retries:
        assert retry.headers["x-darl-call-id"] == call_id
        assert retry.headers["x-darl-idempotent-replay"] == "1"
        assert answer_text(retry) == answer_text(first)
    assert (
        retries[1]
        .headers["content-type"]
        .startswith("text/event-stream" if not stream else "application/json")
    )
    assert answers(stack, unreceived=False) == before + 2
    [record] = attempt_records(stack, rollout_id, 1)
    assert record.call_id == call_id and record.idempotency_key == key
    assert generated(stack, list(record.prompt_token_ids)) == 1
    assert [e["call_id"] for e in close(stack, rollout_id, 1)["events"]] == [call_id]
    await stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()


async def test_a_first_try_is_recorded_with_its_key_for_its_retries(stack: Stack) -> None:
    """A first try (`X-Darl-First-Try: 1`) is not looked up among the attempt's calls (a
    read of all of them), but its record keeps the key: the retry, which says no such thing,
    is answered from it."""
    rollout_id = await stack.start_idle_rollout(f"idem-first-{uuid.uuid4().hex[:4]}")
    body, key = conversation(rollout_id), key_of(rollout_id)
    first = post(stack, rollout_id, body, key, first_try=True)
    assert first.status_code == 200, first.text
    retry = chat(stack, rollout_id, body, key, stream=False)
    assert retry.headers["x-darl-call-id"] == first.headers["x-darl-call-id"]
    assert retry.headers["x-darl-idempotent-replay"] == "1"
    [record] = attempt_records(stack, rollout_id, 1)
    assert record.idempotency_key == key
    assert generated(stack, list(record.prompt_token_ids)) == 1
    # A first try that stalled past its retry and wakes says its key is new: this replica
    # served the key, so it is looked up and answered from the record all the same.
    late = post(stack, rollout_id, body, key, first_try=True)
    assert late.headers["x-darl-call-id"] == first.headers["x-darl-call-id"]
    assert len(attempt_records(stack, rollout_id, 1)) == 1
    assert generated(stack, list(record.prompt_token_ids)) == 1
    await stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("retried", ["after-the-answer", "while-generated"])
async def test_a_retry_after_its_client_dropped_mid_generation_is_generated_once(
    stack: Stack, stream: bool, retried: str
) -> None:
    """The first try's client goes away while its call is frozen inside the policy server;
    its answer is recorded unreceived, and the retry, asked after it came or while it is
    still being generated (then it waits), gets it: the attempt's one call, generated once."""
    rollout_id = await stack.start_idle_rollout(f"idem-dropped-{uuid.uuid4().hex[:4]}")
    body, key = conversation(rollout_id), key_of(rollout_id)
    before = answers(stack, unreceived=True)
    with policy_frozen(stack):
        await dropped_mid_generation(stack, rollout_id, body, key, stream)
        if retried == "while-generated":
            asking, out = in_thread(lambda: chat(stack, rollout_id, body, key, stream))
            await wait_until(lambda: gateway_metric(stack, "darl_gateway_idempotent_waiting") == 1)
            # It waits: no second call reaches the policy server.
            assert sum(gateway_state(stack)["inflight"].values()) == 1
    if retried == "after-the-answer":
        await wait_until(lambda: len(attempt_records(stack, rollout_id, 1)) == 1)
        retry = chat(stack, rollout_id, body, key, stream)
    else:
        asking.join(WAIT)
        [retry] = out

    unreceived, received = attempt_records(stack, rollout_id, 1)
    assert unreceived.unreceived and unreceived.idempotency_key == key
    assert not received.unreceived and received.replayed_from == unreceived.call_id
    assert retry.headers["x-darl-call-id"] == received.call_id
    assert retry.headers["x-darl-replayed-from"] == unreceived.call_id
    assert retry.headers["x-darl-idempotent-replay"] == "1"
    assert answer_text(retry) == unreceived.response["choices"][0]["message"]["content"]
    assert generated(stack, list(unreceived.prompt_token_ids)) == 1
    assert answers(stack, unreceived=True) == before + 1
    # A further retry is that received call again, recorded no more.
    again = chat(stack, rollout_id, body, key, stream=False)
    assert again.headers["x-darl-call-id"] == received.call_id
    assert len(attempt_records(stack, rollout_id, 1)) == 2
    events = close(stack, rollout_id, 1)["events"]
    assert [(e["call_id"], e["replayed_from"]) for e in events] == [
        (received.call_id, unreceived.call_id)
    ]
    await stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()


async def test_the_same_key_with_another_request_is_refused(stack: Stack) -> None:
    rollout_id = await stack.start_idle_rollout(f"idem-reused-{uuid.uuid4().hex[:4]}")
    body, key = conversation(rollout_id), key_of(rollout_id)
    first = chat(stack, rollout_id, body, key, stream=False)
    other = conversation(rollout_id, "a different turn", "go on")
    refused = post(stack, rollout_id, other, key)
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert error["code"] == "idempotency_key_reused"
    assert "different request" in error["message"]
    assert first.headers["x-darl-call-id"] in error["message"]
    # Its sampling is part of the request too.
    assert post(stack, rollout_id, {**body, "max_tokens": 3}, key).status_code == 422
    assert len(attempt_records(stack, rollout_id, 1)) == 1
    await stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()


async def test_a_key_names_a_call_of_its_attempt_only(stack: Stack) -> None:
    rollout_id = await stack.start_idle_rollout(f"idem-attempts-{uuid.uuid4().hex[:4]}")
    body, key = conversation(rollout_id), key_of(rollout_id)
    first = chat(stack, rollout_id, body, key, stream=False)
    # Attempt 2 asks another request with it (attempt 1 would refuse that: 422), attempt 3
    # the same request: each a live call of its own.
    other = post(
        stack,
        rollout_id,
        conversation(rollout_id, "x", "y"),
        key,
        bearer=stack.token(rollout_id, 2),
    )
    same = post(stack, rollout_id, body, key, bearer=stack.token(rollout_id, 3))
    assert (other.status_code, same.status_code) == (200, 200), (other.text, same.text)
    assert "x-darl-idempotent-replay" not in same.headers
    assert same.headers["x-darl-call-id"] != first.headers["x-darl-call-id"]
    # While in its own attempt, it names that attempt's call.
    retry = chat(stack, rollout_id, body, key, stream=False)
    assert retry.headers["x-darl-call-id"] == first.headers["x-darl-call-id"]
    assert [len(attempt_records(stack, rollout_id, a)) for a in (1, 2, 3)] == [1, 1, 1]
    await stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("responses", {"model": "m", "input": "Say a word.", "max_output_tokens": 4}),
        (
            "messages",
            {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi."}]},
        ),
    ],
    ids=["responses", "messages"],
)
async def test_a_retry_in_another_protocol_gets_its_answer_in_that_protocol(
    stack: Stack, path: str, body: dict[str, Any]
) -> None:
    rollout_id = await stack.start_idle_rollout(f"idem-{path}-{uuid.uuid4().hex[:4]}")
    key = key_of(rollout_id)
    first, retry = (post(stack, rollout_id, body, key, path=path) for _ in range(2))
    assert (first.status_code, retry.status_code) == (200, 200), (first.text, retry.text)
    assert retry.headers["x-darl-idempotent-replay"] == "1"
    assert retry.headers["x-darl-call-id"] == first.headers["x-darl-call-id"]
    # The same answer (a Responses object's creation time is the answer's own).
    assert {**retry.json(), "created_at": 0} == {**first.json(), "created_at": 0}
    [record] = attempt_records(stack, rollout_id, 1)
    assert generated(stack, list(record.prompt_token_ids)) == 1
    await stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()


async def test_a_malformed_key_is_refused(stack: Stack) -> None:
    rollout_id = await stack.start_idle_rollout(f"idem-bad-{uuid.uuid4().hex[:4]}")
    for key in ["", "a" * 201, "two words", "tab\there", "caf\u00e9".encode()]:
        refused = post(stack, rollout_id, conversation(rollout_id), key)
        assert refused.status_code == 400, (key, refused.text)
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_idempotency_key", "Idempotency-Key")
        assert "1 to 200 visible ASCII characters" in error["message"]
    assert post(stack, rollout_id, conversation(rollout_id), "a" * 200).status_code == 200
    assert len(attempt_records(stack, rollout_id, 1)) == 1
    await stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()
