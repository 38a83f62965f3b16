"""The gateway's admin API against the real gateway: pausing holds or refuses new calls, resume
sets the policy version that calls then record, drain waits for in-flight calls; and the agent
HTTP service runner, whose service is POSTed each rollout once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from deploy.serving import serve_app
from examples.arithmetic.agent_service import ArithmeticService, create_service_app
from tests.integration.stack import ADMIN_KEY, Stack
from workflows.contracts import (
    HttpAgentSpec,
    RewardSpec,
    RolloutSpec,
    RolloutTimeouts,
)
from workflows.rollout_status import RolloutStatus

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
            state = admin.post("/admin/resume", json={"policy_version": 7}).json()
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["x-darl-paused"] == "true"
        assert refused.json()["error"]["code"] == "gateway_paused"
        assert state == {**state, "paused": False, "policy_version": 7}
    answered = call(stack, rollout_id)
    assert answered.status_code == 200
    assert answered.headers["x-darl-policy-version"] == "7"
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


@contextlib.asynccontextmanager
async def agent_service(service: ArithmeticService, tmp: Path) -> AsyncIterator[str]:
    stop = asyncio.Event()
    ready = tmp / "agent-service.json"
    task = asyncio.create_task(
        serve_app(create_service_app(service), "127.0.0.1", 0, stop, ready, "agents")
    )
    async with asyncio.timeout(30):
        while not ready.exists():
            await asyncio.sleep(0.02)
    try:
        yield json.loads(ready.read_text())["url"]
    finally:
        stop.set()
        await task


async def test_http_agent_service_rollouts(stack: Stack, tmp_path: Path) -> None:
    service = ArithmeticService()
    async with agent_service(service, tmp_path) as url:
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
    async with agent_service(service, tmp_path) as url, httpx.AsyncClient(timeout=60) as http:
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


@pytest.mark.usefixtures("stack")
def test_admin_state_lists_upstreams(stack: Stack) -> None:
    with stack.admin() as admin:
        state = admin.get("/admin/state").json()
        assert state["upstreams"] == [stack.policy_url]
        moved = admin.put("/admin/upstreams", json={"upstreams": [stack.policy_url + "/"]})
        assert moved.json()["upstreams"] == [stack.policy_url]
        assert admin.put("/admin/upstreams", json={"upstreams": []}).status_code == 400
    assert ADMIN_KEY
