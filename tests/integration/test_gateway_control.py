"""The gateway's admin API against the real gateway: pausing holds or refuses new calls, resume
sets the policy version that calls then record, drain waits for in-flight calls; and the agent
HTTP service runner, whose service is POSTed each rollout once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import uuid
from pathlib import Path

import httpx
import pytest

from darl.examples.arithmetic.agent_service import ArithmeticService, create_service_app
from darl.workflows.contracts import (
    HttpAgentSpec,
    RewardSpec,
    RolloutSpec,
    RolloutTimeouts,
)
from darl.workflows.rollout_status import RolloutStatus
from tests.integration.stack import ADMIN_KEY, Stack
from tests.serving import served

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def call(stack: Stack, rollout_id: str, body: dict = CHAT) -> httpx.Response:
    return httpx.post(
        f"{stack.gateway_url}/rollouts/{rollout_id}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {stack.token(rollout_id)}"},
        timeout=60,
    )


async def test_reject_mode_answers_429_and_resume_sets_the_version(stack: Stack) -> None:
    rollout_id = await stack.start_idle_rollout("ctl")
    with stack.admin() as admin:
        assert admin.post("/admin/pause", json={"mode": "reject"}).json()["paused"]
        try:
            refused = call(stack, rollout_id)
        finally:
            stack.load_policy_version(7)
            state = admin.post("/admin/resume", json={"policy_version": 7}).json()
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["x-darl-paused"] == "true"
        assert refused.json()["error"]["code"] == "gateway_paused"
        assert state == {**state, "paused": False, "policy_version": 7}
    answered = call(stack, rollout_id)
    assert answered.status_code == 200
    assert answered.headers["x-darl-policy-version"] == "7"
    # A paused gateway's 429 is flow control, not a failed call.
    assert await stack.store().failed_calls(rollout_id, 1) == []
    handle = stack.client.get_workflow_handle(f"rollout/{rollout_id}")
    assert await stack.wait_for_calls(handle, 1) == 1
    await handle.cancel()


async def test_hold_mode_holds_calls_until_resume(stack: Stack) -> None:
    rollout_id = await stack.start_idle_rollout("ctl")
    with stack.admin() as admin:
        admin.post("/admin/pause", json={"mode": "hold"})
        answers: list[httpx.Response] = []
        caller = threading.Thread(target=lambda: answers.append(call(stack, rollout_id)))
        caller.start()
        try:
            await asyncio.sleep(1.0)
            assert not answers  # held, not refused
            assert admin.get("/admin/state").json()["held"] == 1
        finally:
            stack.load_policy_version(8)
            admin.post("/admin/resume", json={"policy_version": 8})
        caller.join(timeout=30)
    assert [a.status_code for a in answers] == [200]
    assert answers[0].headers["x-darl-policy-version"] == "8"
    await stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()


async def test_drain_waits_for_calls_in_flight(stack: Stack) -> None:
    rollout_id = await stack.start_idle_rollout("ctl")
    long_call = {**CHAT, "max_tokens": 400, "ignore_eos": True}
    answers: list[httpx.Response] = []
    caller = threading.Thread(target=lambda: answers.append(call(stack, rollout_id, long_call)))
    with stack.admin() as admin:
        caller.start()
        async with asyncio.timeout(30):
            while not sum(admin.get("/admin/state").json()["inflight"].values()):
                await asyncio.sleep(0.01)
        try:
            drained = admin.post(
                "/admin/pause", json={"mode": "hold", "drain_timeout_seconds": 60}
            ).json()
        finally:
            admin.post("/admin/resume", json={})
    caller.join(timeout=30)
    # Drain answered once the policy server had no call of ours left: the long call was whole.
    assert drained["drained"] is True
    assert drained["inflight"] == {}
    assert [a.status_code for a in answers] == [200]
    assert len(answers[0].json()["choices"][0]["token_ids"]) == 400
    await stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()


async def test_http_agent_service_rollouts(stack: Stack, tmp_path: Path) -> None:
    service = ArithmeticService()
    async with served(create_service_app(service), tmp_path, "agents") as url:
        specs = [
            RolloutSpec(
                run_id="http-agents",
                rollout_id=f"http-{uuid.uuid4().hex[:8]}",
                task={"question": f"What is {i} + 1?", "answer": str(i + 1)},
                agent=HttpAgentSpec(url=f"{url}/rollouts"),
                reward=RewardSpec(function="numeric_match"),
                timeouts=RolloutTimeouts(agent_seconds=60, heartbeat_seconds=5),
            )
            for i in range(4)
        ]
        handles = [await stack.start_rollout(s) for s in specs]
        results = [await asyncio.wait_for(h.result(), 120) for h in handles]
    assert [r.status for r in results] == [RolloutStatus.SUCCEEDED] * 4, [r.error for r in results]
    assert [r.calls for r in results] == [1] * 4
    assert all(r.metadata["calls"] == 1 for r in results)
    assert service.started == 4


async def test_the_agent_service_runs_an_attempt_once(stack: Stack, tmp_path: Path) -> None:
    rollout_id = await stack.start_idle_rollout("ctl")
    service = ArithmeticService()
    body = {
        "rollout_id": rollout_id,
        "attempt": 1,
        "task": {"question": "What is 2 + 2?"},
        "openai_base_url": f"{stack.gateway_url}/rollouts/{rollout_id}/v1",
        "api_key": stack.token(rollout_id),
    }
    async with (
        served(create_service_app(service), tmp_path, "agents") as url,
        httpx.AsyncClient(timeout=60) as http,
    ):
        headers = {"Idempotency-Key": f"{rollout_id}/1"}
        first, again = await asyncio.gather(
            http.post(f"{url}/rollouts", json=body, headers=headers),
            http.post(f"{url}/rollouts", json=body, headers=headers),
        )
    assert first.json() == again.json()
    assert service.started == 1
    handle = stack.client.get_workflow_handle(f"rollout/{rollout_id}")
    assert await stack.wait_for_calls(handle, 1) == 1
    await handle.cancel()


async def test_models_are_listed_for_the_rollouts_token(stack: Stack) -> None:
    rollout_id = await stack.start_idle_rollout("ctl")
    url = f"{stack.gateway_url}/rollouts/{rollout_id}/v1/models"
    listing = httpx.get(url, headers={"Authorization": f"Bearer {stack.token(rollout_id)}"})
    assert [m["id"] for m in listing.json()["data"]] == ["darl-tiny"]  # asked of the upstream
    assert httpx.get(url).status_code == 401
    await stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()


async def test_an_attempt_opened_by_the_worker_asks_temporal_nothing(stack: Stack) -> None:
    # A rollout without a workflow: its calls are 404 (the gateway asks Temporal), unless the
    # admin API was told it runs, as the worker tells it before the agent starts.
    ghost = f"ghost-{uuid.uuid4().hex[:8]}"
    assert call(stack, ghost).status_code == 404
    opened = f"opened-{uuid.uuid4().hex[:8]}"
    with stack.admin() as admin:
        assert admin.post(f"/admin/rollouts/{opened}/attempts/1/open").json() == {"closed": False}
    assert httpx.post(f"{stack.gateway_url}/admin/rollouts/x/attempts/1/open").status_code == 401
    assert call(stack, opened).status_code == 200
    # A closed attempt stays closed: the open answers so, and its calls are refused.
    rollout_id = await stack.start_idle_rollout("ctl")
    with stack.admin() as admin:
        assert admin.post(f"/admin/rollouts/{rollout_id}/attempts/1/close", json={}).is_success
        assert admin.post(f"/admin/rollouts/{rollout_id}/attempts/1/open").json() == {
            "closed": True
        }
    assert call(stack, rollout_id).status_code == 409
    await stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()


def test_admin_state_lists_upstreams(stack: Stack) -> None:
    with stack.admin() as admin:
        state = admin.get("/admin/state").json()
        assert state["upstreams"] == [stack.policy_url]
        moved = admin.put("/admin/upstreams", json={"upstreams": [stack.policy_url + "/"]})
        assert moved.json()["upstreams"] == [stack.policy_url]
        assert admin.put("/admin/upstreams", json={"upstreams": []}).status_code == 400


def stored_call(stack: Stack, rollout_id: str, call_id: str):
    records = stack.store().read_sync(rollout_id)
    return next((r for r in records if r.call_id == call_id), None)


async def test_a_streamed_answer_is_recorded_before_it_ends(stack: Stack) -> None:
    """The stream reaches the agent as it comes, but its last chunk only once the call is in
    the store: an agent never holds a whole answer that was not recorded."""
    rollout_id = await stack.start_idle_rollout("ctl")
    body = {**CHAT, "max_tokens": 30, "stream": True, "logprobs": True}
    headers = {"Authorization": f"Bearer {stack.token(rollout_id)}"}
    url = f"{stack.gateway_url}/rollouts/{rollout_id}/v1/chat/completions"
    token_ids: list[int] = []
    text = ""
    recorded_at_finish = None
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        call_id = response.headers["x-darl-call-id"]
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                token_ids += choice.get("token_ids", [])
                text += choice["delta"].get("content", "")
                if choice["finish_reason"] is not None:
                    recorded_at_finish = stored_call(stack, rollout_id, call_id)
    assert recorded_at_finish is not None
    assert recorded_at_finish.streamed
    assert recorded_at_finish.completion_token_ids() == token_ids
    assert recorded_at_finish.response["choices"][0]["message"]["content"] == text
    logprobs = recorded_at_finish.completion_logprobs()
    assert logprobs is not None and len(logprobs) == len(token_ids)
    await stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()


async def test_text_completions_are_captured_whole_and_streamed(stack: Stack) -> None:
    rollout_id = await stack.start_idle_rollout("ctl")
    headers = {"Authorization": f"Bearer {stack.token(rollout_id)}"}
    url = f"{stack.gateway_url}/rollouts/{rollout_id}/v1/completions"
    asked = {"model": "m", "prompt": "2 + 2 =", "max_tokens": 6, "return_token_ids": True}
    whole = httpx.post(url, json=asked, headers=headers, timeout=60)
    assert whole.status_code == 200, whole.text
    record = stored_call(stack, rollout_id, whole.headers["x-darl-call-id"])
    answer = whole.json()["choices"][0]
    assert record is not None
    assert record.prompt_token_ids == answer["prompt_token_ids"]
    assert record.completion_token_ids() == answer["token_ids"]
    assert len(record.completion_logprobs() or []) == len(answer["token_ids"])

    streamed_ids: list[int] = []
    prompt_ids = None
    with httpx.stream(
        "POST",
        url,
        json={**asked, "prompt": record.prompt_token_ids, "stream": True},
        headers=headers,
        timeout=60,
    ) as response:
        call_id = response.headers["x-darl-call-id"]
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed_ids += choice.get("token_ids", [])
                    prompt_ids = choice.get("prompt_token_ids") or prompt_ids
    streamed = stored_call(stack, rollout_id, call_id)
    assert streamed is not None and streamed.streamed
    assert streamed.prompt_token_ids == prompt_ids == record.prompt_token_ids
    assert streamed.completion_token_ids() == streamed_ids
    handle = stack.client.get_workflow_handle(f"rollout/{rollout_id}")
    assert await stack.wait_for_calls(handle, 2) == 2
    await handle.cancel()


async def test_the_prompt_ids_go_back_only_to_an_agent_that_asks_for_them(stack: Stack) -> None:
    """DARL forces `return_token_ids` for the store; an agent that did not ask gets the
    prompt's ids null, as vLLM answers it (chat and completions, whole and streamed), and
    every other field as the policy server wrote it."""
    rollout_id = await stack.start_idle_rollout("ctl")
    headers = {"Authorization": f"Bearer {stack.token(rollout_id)}"}
    base = f"{stack.gateway_url}/rollouts/{rollout_id}/v1"
    cases = [
        ("chat/completions", CHAT, lambda answer: answer["prompt_token_ids"]),
        (
            "completions",
            {"model": "m", "prompt": "2 + 2 =", "max_tokens": 3},
            lambda answer: answer["choices"][0]["prompt_token_ids"],
        ),
    ]
    calls = 0
    for path, body, prompt_ids in cases:
        for asked in (False, True):
            flagged = {**body, "return_token_ids": True} if asked else body
            whole = httpx.post(f"{base}/{path}", json=flagged, headers=headers, timeout=60)
            assert whole.status_code == 200, whole.text
            record = stored_call(stack, rollout_id, whole.headers["x-darl-call-id"])
            assert record is not None and len(record.prompt_token_ids) > 1
            expected = record.prompt_token_ids if asked else None
            assert prompt_ids(whole.json()) == expected
            if asked:
                assert whole.json() == record.response
            elif path == "chat/completions":
                assert whole.json() == {**record.response, "prompt_token_ids": None}
            with httpx.stream(
                "POST",
                f"{base}/{path}",
                json={**flagged, "stream": True},
                headers=headers,
                timeout=60,
            ) as response:
                assert response.status_code == 200
                chunks = [
                    json.loads(line[6:])
                    for line in response.iter_lines()
                    if line.startswith("data: {")
                ]
            streamed = stored_call(stack, rollout_id, response.headers["x-darl-call-id"])
            assert streamed is not None and streamed.prompt_token_ids == record.prompt_token_ids
            assert prompt_ids(chunks[0]) == expected
            calls += 2
    handle = stack.client.get_workflow_handle(f"rollout/{rollout_id}")
    assert await stack.wait_for_calls(handle, calls) == calls
    await handle.cancel()


def test_admin_bodies_are_json_whatever_the_content_type(stack: Stack) -> None:
    """`curl -d '{...}'` sends a form content type; the admin API reads JSON anyway."""
    headers = {
        "Authorization": f"Bearer {ADMIN_KEY}",
        "Content-Type": "application/x-www-form-urlencoded",
    }
    url = stack.gateway_url
    try:
        paused = httpx.post(f"{url}/admin/pause", content=b'{"mode": "reject"}', headers=headers)
        assert paused.status_code == 200 and paused.json()["mode"] == "reject"
    finally:
        resumed = httpx.post(f"{url}/admin/resume", content=b"", headers=headers)
    assert resumed.status_code == 200 and resumed.json()["paused"] is False
    assert httpx.post(f"{url}/admin/resume", content=b"{nope", headers=headers).status_code == 400


@pytest.mark.parametrize("stream", [False, True])
async def test_an_agent_that_hangs_up_leaves_its_answer_recorded_unreceived(
    stack: Stack, stream: bool
) -> None:
    """An agent that went away mid-call (mid-stream too) leaves the policy server's call to
    finish: the answer is recorded marked unreceived (no part of the attempt's trajectory; a
    next attempt would replay it instead of generating it again), a failed call (499) says
    the agent left, and the call holds its slot until the answer is in."""
    rollout_id = await stack.start_idle_rollout("ctl")
    records_before = len(stack.store().read_sync(rollout_id))
    long_call = {**CHAT, "max_tokens": 1500, "ignore_eos": True, "stream": stream}
    url = f"{stack.gateway_url}/rollouts/{rollout_id}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {stack.token(rollout_id)}"}
    with stack.admin() as admin:
        async with httpx.AsyncClient(timeout=60) as client:
            hanging_up = asyncio.create_task(client.post(url, json=long_call, headers=headers))
            async with asyncio.timeout(30):
                while not sum(admin.get("/admin/state").json()["inflight"].values()):
                    await asyncio.sleep(0.01)
            hanging_up.cancel()  # the agent closes its connection mid-call
            with contextlib.suppress(asyncio.CancelledError):
                await hanging_up
        async with asyncio.timeout(120):  # the policy server's answer, to its end
            while sum(admin.get("/admin/state").json()["inflight"].values()):
                await asyncio.sleep(0.05)
    if not stream:  # a stream has begun with 200 when the agent leaves
        metrics = httpx.get(f"{stack.gateway_url}/metrics").text
        assert 'darl_gateway_requests_total{route="chat",status="499"}' in metrics
    async with asyncio.timeout(10):
        while not (failed := await stack.store().failed_calls(rollout_id, 1)):
            await asyncio.sleep(0.05)
    assert [(f.status, f.protocol) for f in failed] == [(499, "chat.completions")]
    records = stack.store().read_sync(rollout_id)
    assert len(records) == records_before + 1
    assert records[-1].unreceived and len(records[-1].completion_token_ids()) == 1500
    await stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()


def test_the_gateways_address_answers_an_index(stack: Stack) -> None:
    index = httpx.get(stack.gateway_url, timeout=10).json()
    assert index["name"] == "DARL gateway"
    assert index["routes"]["OpenAI chat, completions, Responses (an agent's base URL)"] == (
        "/rollouts/{rollout_id}/v1"
    )
    assert httpx.get(stack.gateway_url + index["docs"], timeout=10).status_code == 200
