"""Gateway replicas behind a real load balancer (HAProxy on 127.0.0.1, round-robin, checking
each replica's /healthz), sharing one directory store and journal:

- one attempt's calls alternate between the replicas and are recorded once each, in order;
  closed through one replica, the attempt is refused by the other (409);
- the trainer's pause (`GatewayReplicas`, the `gateway_admin_urls` form) is acknowledged by
  every replica before it returns, and its resume reaches every one, at the new version;
- a training run survives one replica SIGKILLed with calls in flight on it and again while
  paused for a sync (an agent's call and its attempt's close reach different replicas): no
  rollout fails, every trained rollout's calls are its final attempt's records in the store,
  once each, every call's version is the one that served it (the chaos tier's checks,
  tests/chaos/checks.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from temporalio.testing import WorkflowEnvironment

from darl.trainer.gateway_replicas import GatewayReplicas
from tests.chaos.harness import ChaosRun
from tests.chaos.report import COLUMNS, rows, summary
from tests.chaos.scenarios import REPLICA_KILLS, in_sequence
from tests.integration.replicas_stack import ReplicatedStack
from tests.integration.stack import ADMIN_KEY

pytestmark = pytest.mark.integration

PROMPT = {"model": "m", "prompt": "1+1=", "max_tokens": 2}


@pytest.fixture(scope="module")
def replicas(
    dev_env: WorkflowEnvironment, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ReplicatedStack]:
    stack = ReplicatedStack(Path(tmp_path_factory.mktemp("replicas")), dev_env.client)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


async def complete(
    http: httpx.AsyncClient, stack: ReplicatedStack, rollout_id: str
) -> httpx.Response:
    return await http.post(
        f"{stack.gateway_url}/rollouts/{rollout_id}/v1/completions",
        json=PROMPT,
        headers={"Authorization": f"Bearer {stack.token(rollout_id)}"},
    )


async def test_an_attempt_alternates_replicas_and_a_close_on_one_is_kept_by_the_other(
    replicas: ReplicatedStack,
) -> None:
    rollout_id = await replicas.start_idle_rollout("replicas")
    store = replicas.store()
    # Round-robin: HAProxy balances each request, so consecutive calls alternate replicas.
    async with httpx.AsyncClient(timeout=60) as http:
        answers = [await complete(http, replicas, rollout_id) for _ in range(6)]
    assert [a.status_code for a in answers] == [200] * 6
    call_ids = [a.headers["x-darl-call-id"] for a in answers]
    records = await store.read(rollout_id, 1)
    assert [r.call_id for r in records] == call_ids
    first = records[0].sequence
    assert [r.sequence for r in records] == list(range(first, first + len(call_ids)))
    # Both replicas served some of them (each counts the calls it captured).
    served = {}
    for instance in replicas.instances:
        with replicas.replica_admin(instance) as admin:
            metrics = admin.get("/metrics").text
        served[instance] = sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("darl_gateway_captured_calls_total{")
        )
    assert all(n >= 1 for n in served.values()), served

    a, b = replicas.instances
    with replicas.replica_admin(a) as admin:
        closed = admin.post(f"/admin/rollouts/{rollout_id}/attempts/1/close", json={})
    assert closed.status_code == 200, closed.text
    async with httpx.AsyncClient(timeout=60) as http:
        refused = await http.post(
            f"{replicas.replica_urls[b]}/rollouts/{rollout_id}/v1/completions",
            json=PROMPT,
            headers={"Authorization": f"Bearer {replicas.token(rollout_id)}"},
        )
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["code"] == "rollout_finished"
    assert [r.call_id for r in await store.read(rollout_id, 1)] == call_ids
    await replicas.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()


async def test_the_trainers_pause_and_resume_reach_every_replica(
    replicas: ReplicatedStack,
) -> None:
    rollout_id = await replicas.start_idle_rollout("replicas-pause")
    async with httpx.AsyncClient(timeout=60) as http:
        gateway = GatewayReplicas(replicas.admin_urls(), ADMIN_KEY, http)
        assert await gateway.pause("reject", 5.0) is True
        try:
            for instance in replicas.instances:
                with replicas.replica_admin(instance) as admin:
                    assert admin.get("/admin/state").json()["paused"] is True, instance
            # Whichever replica the balancer picks, the call is refused for the sync.
            for _ in range(4):
                assert (await complete(http, replicas, rollout_id)).status_code == 429
        finally:
            replicas.load_policy_version(3)
            await gateway.resume(3)
        for instance in replicas.instances:
            with replicas.replica_admin(instance) as admin:
                state = admin.get("/admin/state").json()
            assert (state["paused"], state["policy_version"]) == (False, 3), instance
        answered = await complete(http, replicas, rollout_id)
    assert answered.status_code == 200
    assert answered.headers["x-darl-policy-version"] == "3"
    await replicas.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()


async def test_a_replica_that_restarts_paused_follows_the_resume_it_missed(
    replicas: ReplicatedStack,
) -> None:
    """A replica (re)started during a sync comes up paused from the journal; the trainer's
    resume went to the replicas it knew; the journal's resumed state resumes it."""
    a, b = replicas.instances
    async with httpx.AsyncClient(timeout=60) as http:
        gateway = GatewayReplicas(replicas.admin_urls(), ADMIN_KEY, http)
        await gateway.pause("hold", None)
        await asyncio.to_thread(replicas.restart_replica, b, 1.0, True)
        with replicas.replica_admin(b) as admin:
            assert admin.get("/admin/state").json()["paused"] is True
        # The resume reaches only a (as if b had not been found yet).
        await GatewayReplicas([replicas.replica_urls[a]], ADMIN_KEY, http).resume(4)
        async with asyncio.timeout(10):
            while True:
                with replicas.replica_admin(b) as admin:
                    state = admin.get("/admin/state").json()
                if not state["paused"]:
                    break
                await asyncio.sleep(0.2)
    assert state["policy_version"] == 4


@pytest.mark.timeout(600)
async def test_a_training_run_survives_a_replica_killed_mid_run(tmp_path: Path) -> None:
    kills, steps = in_sequence(REPLICA_KILLS)
    report = await ChaosRun(tmp_path, kills, steps, replicas=2).run(timeout=540)
    table = "\n".join([COLUMNS, *rows(report), summary(report)])
    print(table)
    assert report.clean, table
    assert report.rollouts_failed == 0 and report.trajectories_not_stored == 0, table
    assert len(report.kills) == len(REPLICA_KILLS)
