"""Weight sync (trainer/policy_control.py) against the real gateway and policy server: both
ways of treating the calls in flight end with the new weights and version everywhere, and a
call in flight across the sync finishes whole."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from darl.trainer.policy_control import GatewayControl, ReferencePolicyServer, sync_weights
from tests.integration.stack import ADMIN_KEY, Stack
from tests.integration.test_gateway_control import CHAT, call

pytestmark = pytest.mark.integration

LONG_CALL = {**CHAT, "max_tokens": 300, "ignore_eos": True}


@pytest.mark.parametrize(("inflight", "version"), [("drain", 21), ("keep", 22)])
async def test_a_sync_moves_every_server_to_the_new_version(
    stack: Stack, inflight: str, version: int
) -> None:
    rollout_id = await stack.start_idle_rollout("sync")
    answers: list[httpx.Response] = []
    caller = threading.Thread(target=lambda: answers.append(call(stack, rollout_id, LONG_CALL)))
    async with httpx.AsyncClient(timeout=60) as http:
        gateway = GatewayControl(stack.gateway_url, ADMIN_KEY, http)
        server = ReferencePolicyServer(stack.policy_url, http)
        caller.start()
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        async with asyncio.timeout(30):
            # Sync while the long call is in flight at the gateway.
            while not sum(
                (await http.get(f"{stack.gateway_url}/admin/state", headers=admin))
                .json()["inflight"]
                .values()
            ):
                await asyncio.sleep(0.01)
        outcome = await sync_weights(
            gateway,
            [server],
            str(stack.model_dir),
            version,
            inflight,
            drain_seconds=60,
            pause_mode="hold",
            register_upstreams=False,
        )
        served = (await http.get(f"{stack.policy_url}/version")).json()["policy_version"]
        paused = (await http.get(f"{stack.policy_url}/is_paused")).json()["is_paused"]
    await asyncio.to_thread(caller.join, 60)
    assert served == version and not paused
    assert outcome.paused_seconds > 0
    assert outcome.drained is (True if inflight == "drain" else None)
    # The call in flight finished whole, on either side of the sync.
    assert [a.status_code for a in answers] == [200]
    assert len(answers[0].json()["choices"][0]["token_ids"]) == 300
    after = call(stack, rollout_id)
    assert after.headers["x-darl-policy-version"] == str(version)
    await stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()


async def test_a_sync_registers_the_policy_servers_as_the_gateways_upstreams(stack: Stack):
    """The run's config is the one list of servers: the same server by another address (as a
    new replica would be) becomes the gateway's upstream list, and calls reach it."""
    rollout_id = await stack.start_idle_rollout("upstreams")
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    by_name = stack.policy_url.replace("127.0.0.1", "localhost")
    async with httpx.AsyncClient(timeout=60) as http:
        before = (await http.get(f"{stack.gateway_url}/admin/state", headers=admin)).json()
        assert before["upstreams"] == [stack.policy_url]
        gateway = GatewayControl(stack.gateway_url, ADMIN_KEY, http)
        server = ReferencePolicyServer(by_name, http)
        await sync_weights(
            gateway,
            [server],
            str(stack.model_dir),
            31,
            "drain",
            60,
            pause_mode="hold",
            register_upstreams=True,
        )
        after = (await http.get(f"{stack.gateway_url}/admin/state", headers=admin)).json()
        assert after["upstreams"] == [by_name] and not after["paused"]
        answer = await asyncio.to_thread(call, stack, rollout_id)
        # Back as it was, for the tests that follow on this stack.
        await gateway.set_upstreams([stack.policy_url])
    assert answer.status_code == 200
    assert answer.headers["x-darl-policy-version"] == "31"
    await stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()
