"""Nothing generated twice, even at the kill point (issue 45, part 4; rule 10), over HTTP with
the real gateway and reference policy server. An agent's connection drops while its call is
frozen inside the policy server (`/pause?mode=keep`); its attempt is closed, as the worker
closes the attempt of an agent that died. The answer still comes, and the store keeps it
marked unreceived, out of the attempt's close events and its committed calls; the next
attempt's identical request is answered from it, whether it asks after the answer came or
while it is still being generated (then it waits), and by the policy server's own log that
prompt was generated once."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from darl.activities.policy_steps import committed_calls
from darl.gateway.store.record import CallRecord
from darl.workflows.rollout_token import ReplayClaim, TokenClaims, mint_token
from tests.integration.replay_checks import (
    Scenario,
    check_resumed,
    local_spec,
    sigkill_local_agent,
    wait_for_marker,
)
from tests.integration.stack import TOKEN_SECRET, Stack

pytestmark = pytest.mark.integration

WAIT = 60


def conversation(rollout_id: str, *turns: str) -> dict[str, Any]:
    """A chat request of its own rollout (no other test's prompt is one of its prompts)."""
    messages = [{"role": "user", "content": f"Rollout {rollout_id}: count the letters."}]
    messages += [
        {"role": "assistant" if i % 2 == 0 else "user", "content": turn}
        for i, turn in enumerate(turns)
    ]
    return {"model": "m", "messages": messages, "max_tokens": 4}


def token(rollout_id: str, attempt: int) -> str:
    """Attempt 1's token, or a later attempt's that replays attempt 1 (as the workflow names
    its lineage)."""
    replay = ReplayClaim(sources=(1,)) if attempt > 1 else None
    claims = TokenClaims(rollout_id, attempt, "train", int(time.time()) + 600, replay=replay)
    return mint_token(TOKEN_SECRET.encode(), claims)


def chat(
    stack: Stack, rollout_id: str, attempt: int, body: dict[str, Any], stream: bool
) -> httpx.Response:
    """One call, its answer read whole (a stream to its end)."""
    with httpx.Client(timeout=WAIT) as http:
        response = http.post(
            f"{stack.gateway_url}/rollouts/{rollout_id}/v1/chat/completions",
            json={**body, "stream": stream},
            headers={"Authorization": f"Bearer {token(rollout_id, attempt)}"},
        )
    assert response.status_code == 200, response.text
    return response


def answer_text(response: httpx.Response) -> str:
    if not response.headers["content-type"].startswith("text/event-stream"):
        return str(response.json()["choices"][0]["message"]["content"])
    text = ""
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text += choice.get("delta", {}).get("content") or ""
    return text


class DroppedAgent:
    """An agent whose call goes out on a socket of its own, which `drop` closes (as the
    kernel closes a killed process's)."""

    def __init__(self, stack: Stack, rollout_id: str, body: dict[str, Any]) -> None:
        url = urlparse(stack.gateway_url)
        payload = json.dumps(body).encode()
        head = (
            f"POST /rollouts/{rollout_id}/v1/chat/completions HTTP/1.1\r\n"
            f"Host: {url.netloc}\r\nAuthorization: Bearer {token(rollout_id, 1)}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        self.socket = socket.create_connection((url.hostname, url.port), timeout=WAIT)
        self.socket.sendall(head.encode() + payload)

    def first_bytes(self) -> bytes:
        """Waits for the answer to start (a stream's headers and first chunk)."""
        return self.socket.recv(65536)

    def drop(self) -> None:
        self.socket.close()


def gateway_state(stack: Stack) -> dict[str, Any]:
    with stack.admin() as admin:
        return dict(admin.get("/admin/state").json())


def gateway_metric(stack: Stack, name: str) -> float:
    text = httpx.get(f"{stack.gateway_url}/metrics", timeout=WAIT).text
    for line in text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise KeyError(f"the gateway has no metric {name}")


def close(stack: Stack, rollout_id: str, attempt: int) -> dict[str, Any]:
    """The worker's close of the attempt, asking for its events."""
    body: dict[str, Any] = {"return_events_up_to": 100}
    if attempt > 1:
        body["replay_from"] = [1]
    with stack.admin() as admin:
        response = admin.post(f"/admin/rollouts/{rollout_id}/attempts/{attempt}/close", json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())


@contextmanager
def policy_frozen(stack: Stack) -> Iterator[None]:
    """Every generation stands still inside the policy server until the block ends."""
    with httpx.Client(base_url=stack.policy_url, timeout=WAIT) as policy:
        policy.post("/pause", params={"mode": "keep"}).raise_for_status()
        try:
            yield
        finally:
            policy.post("/resume").raise_for_status()


async def wait_until(predicate: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT):
        while not predicate():
            await asyncio.sleep(0.05)


def in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(work()), daemon=True)
    thread.start()
    return thread, out


def attempt_records(stack: Stack, rollout_id: str, attempt: int) -> list[CallRecord]:
    return stack.store().read_sync(rollout_id, attempt)


def generated(stack: Stack, prompt: list[int]) -> int:
    """How many times the policy server generated an answer to `prompt` (its own log)."""
    return [line["prompt_token_ids"] for line in stack.policy_responses()].count(prompt)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("asked", ["after-the-answer", "while-generated"])
async def test_an_answer_its_agent_never_received_is_replayed_not_generated_again(
    stack: Stack, stream: bool, asked: str
) -> None:
    rollout_id = await stack.start_idle_rollout(f"unreceived-{uuid.uuid4().hex[:4]}")
    first = conversation(rollout_id)
    received = chat(stack, rollout_id, 1, first, stream)
    second = conversation(rollout_id, answer_text(received), "count: go on")
    unreceived_before = gateway_metric(stack, "darl_gateway_unreceived_calls_total")
    replies: list[httpx.Response] = []
    with policy_frozen(stack):
        agent = DroppedAgent(stack, rollout_id, {**second, "stream": stream})
        await wait_until(lambda: sum(gateway_state(stack)["inflight"].values()) == 1)
        if stream:
            assert b"200 OK" in await asyncio.to_thread(agent.first_bytes)
        agent.drop()
        closed = close(stack, rollout_id, 1)  # the worker's, once the agent died
        assert [e["call_id"] for e in closed["events"]] == [received.headers["x-darl-call-id"]]
        if asked == "while-generated":
            asking, out = in_thread(
                lambda: [chat(stack, rollout_id, 2, body, stream) for body in (first, second)]
            )
            await wait_until(lambda: gateway_metric(stack, "darl_gateway_replay_waiting") == 1)
    if asked == "after-the-answer":
        await wait_until(lambda: len(attempt_records(stack, rollout_id, 1)) == 2)
        replies = [chat(stack, rollout_id, 2, body, stream) for body in (first, second)]
    else:
        asking.join(WAIT)
        [replies] = out

    kept, unreceived = attempt_records(stack, rollout_id, 1)
    assert (kept.unreceived, unreceived.unreceived) == (False, True)
    assert unreceived.request["messages"] == second["messages"]
    assert gateway_metric(stack, "darl_gateway_unreceived_calls_total") == unreceived_before + 1
    # The agent got nothing; what it never received is no call of its attempt's trajectory.
    failed = await stack.store().failed_calls(rollout_id, 1)
    assert [f.status for f in failed] == [499]
    again = close(stack, rollout_id, 1)  # a retried close answers the same
    assert [e["call_id"] for e in again["events"]] == [kept.call_id]
    digest = hashlib.sha256(kept.call_id.encode()).hexdigest()
    records = attempt_records(stack, rollout_id, 1)
    assert committed_calls(records, rollout_id, 1, digest) == [kept]
    # The next attempt's identical requests are answered from the record, the unreceived
    # answer included: the agent gets the text the policy generated for the lost agent.
    assert [r.headers["x-darl-replayed-from"] for r in replies] == [
        kept.call_id,
        unreceived.call_id,
    ]
    assert answer_text(replies[1]) == unreceived.response["choices"][0]["message"]["content"]
    assert generated(stack, list(unreceived.prompt_token_ids)) == 1
    assert generated(stack, list(kept.prompt_token_ids)) == 1
    trajectory = close(stack, rollout_id, 2)
    assert [e["replayed_from"] for e in trajectory["events"]] == [
        kept.call_id,
        unreceived.call_id,
    ]
    assert trajectory["replay"]["replayed"] == 2 and trajectory["replay"]["diverged_at"] is None
    assert not any(r.unreceived for r in attempt_records(stack, rollout_id, 2))
    await stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()


async def test_an_answer_for_an_attempt_that_ended_meanwhile_is_kept_for_the_next(
    stack: Stack,
) -> None:
    """The agent is still there, but its attempt was closed while the call was at the policy
    server (the agent service lost it, say): the agent is refused as before (409), and the
    answer is kept unreceived for the next attempt."""
    rollout_id = await stack.start_idle_rollout("unreceived-ended")
    body = conversation(rollout_id)
    with policy_frozen(stack):
        asking, answers = in_thread(
            lambda: httpx.post(
                f"{stack.gateway_url}/rollouts/{rollout_id}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {token(rollout_id, 1)}"},
                timeout=WAIT,
            )
        )
        await wait_until(lambda: sum(gateway_state(stack)["inflight"].values()) == 1)
        assert close(stack, rollout_id, 1)["events"] == []
    asking.join(WAIT)
    assert answers[0].status_code == 409, answers[0].text
    assert answers[0].json()["error"]["code"] == "rollout_finished"
    [unreceived] = attempt_records(stack, rollout_id, 1)
    assert unreceived.unreceived
    replayed = chat(stack, rollout_id, 2, body, stream=False)
    assert replayed.headers["x-darl-replayed-from"] == unreceived.call_id
    assert generated(stack, list(unreceived.prompt_token_ids)) == 1
    await stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()


@pytest.mark.parametrize("stream", ["0", "1"], ids=["whole", "streamed"])
async def test_an_agent_killed_with_a_call_in_flight_resumes_without_a_second_generation(
    stack: Stack, stream: str
) -> None:
    """The replay agent on the SDK, SIGKILLed while its third call is frozen inside the policy
    server: the worker closes its attempt, the workflow hands its record on, and the next
    attempt, replaying it, asks the third call's request while its answer is still being
    generated; it waits, and gets that answer, recorded unreceived for the lost agent."""
    scenario = Scenario(
        f"in-flight-{stream}",
        kill_after=2,
        turns=5,
        settings={"KILL_IN_FLIGHT": "1", "STREAM": stream},
    )
    spec = local_spec(stack, scenario)
    handle = await stack.start_rollout(spec)
    await wait_for_marker(stack, spec.rollout_id)
    with policy_frozen(stack):
        (stack.root / "replay-markers" / f"{spec.rollout_id}.1.go").write_text("")
        await wait_until(lambda: sum(gateway_state(stack)["inflight"].values()) == 1)
        sigkill_local_agent(stack, spec.rollout_id)
        await wait_until(lambda: gateway_metric(stack, "darl_gateway_replay_waiting") == 1)
    result = await asyncio.wait_for(handle.result(), WAIT)
    # Every check of a resumed rollout, the answer its agent never received counted among
    # the calls attempt 1 recorded: each generated once, replayed in order, trained as if the
    # agent had never been killed.
    final = check_resumed(stack, result, kill_after=3)
    first = attempt_records(stack, spec.rollout_id, 1)
    assert [r.unreceived for r in first] == [False, False, True]
    assert final[2].replayed_from == first[2].call_id and not final[2].unreceived
    assert first[2].call_id not in result.call_ids


async def test_an_agent_killed_during_its_first_call_resumes_without_a_second_generation(
    stack: Stack,
) -> None:
    """The replay agent SIGKILLed while its first call is frozen inside the policy server:
    the workflow never heard of a call of attempt 1 (an unreceived answer sends no event),
    yet attempt 2 is handed attempt 1's record, waits for that answer and gets it, and the
    policy server generated the first prompt once."""
    spec = local_spec(stack, Scenario("first-call", kill_after=0, turns=3))
    with policy_frozen(stack):
        handle = await stack.start_rollout(spec)
        await wait_until(lambda: sum(gateway_state(stack)["inflight"].values()) == 1)
        sigkill_local_agent(stack, spec.rollout_id)
        await wait_until(lambda: gateway_metric(stack, "darl_gateway_replay_waiting") == 1)
    result = await asyncio.wait_for(handle.result(), WAIT)
    final = check_resumed(stack, result, kill_after=1)
    [unreceived] = attempt_records(stack, spec.rollout_id, 1)
    assert unreceived.unreceived
    assert final[0].replayed_from == unreceived.call_id
