"""Gateway replicas behind a real load balancer (HAProxy on 127.0.0.1, round-robin, checking
each replica's /healthz), sharing one directory store and journal:

- one attempt's calls alternate between the replicas and are recorded once each, in order;
  closed through one replica, the attempt is refused by the other (409);
- the trainer's pause (`GatewayReplicas`, the `gateway_admin_urls` form) is acknowledged by
  every replica before it returns, and its resume reaches every one, at the new version;
- an attempt that resumes by replay (rule 10), its calls concurrent and round-robin, one
  replica's replay session evicted and the other replica SIGKILLed and restarted mid-replay:
  counting from the store, every recorded call is served at most once and none after the
  attempt's first live call, though each replica's session lags what the other served;
- a training run survives one replica SIGKILLed with calls in flight on it and again while
  paused for a sync (an agent's call and its attempt's close reach different replicas): no
  rollout fails, every trained rollout's calls are its final attempt's records in the store,
  once each, every call's version is the one that served it (the chaos tier's checks,
  tests/chaos/checks.py).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from temporalio.testing import WorkflowEnvironment

from darl.gateway.calls.replay import REPLAY_SESSIONS
from darl.trainer.gateway_replicas import GatewayReplicas
from darl.workflows.rollout_token import ReplayClaim, TokenClaims, mint_token
from tests.chaos.harness import ChaosRun
from tests.chaos.report import COLUMNS, rows, summary
from tests.chaos.scenarios import REPLICA_KILLS, in_sequence
from tests.integration.replicas_stack import ReplicatedStack
from tests.integration.stack import ADMIN_KEY, TOKEN_SECRET

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


def replaying_token(rollout_id: str, attempt: int) -> str:
    claims = TokenClaims(rollout_id, attempt, "train", 2**31, replay=ReplayClaim(sources=(1,)))
    return mint_token(TOKEN_SECRET.encode(), claims)


async def ask(
    http: httpx.AsyncClient, url: str, token: str, prompt: str, ok: int = 200
) -> str | None:
    """One completion call; the recorded call it was served from (None: it went live)."""
    body = {**PROMPT, "prompt": prompt}
    answer = await http.post(url, json=body, headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code == ok, answer.text
    return answer.headers.get("x-darl-replayed-from")


async def evict_replay_sessions(replicas: ReplicatedStack, instance: str, rollout_id: str) -> None:
    """Fill the replica's replay sessions with other attempts' (paused, so no call of theirs
    reaches the policy server: each is refused 429 once its session is built)."""
    url = f"{replicas.replica_urls[instance]}/rollouts/{rollout_id}/v1/completions"
    limit = asyncio.Semaphore(8)

    async def filler(http: httpx.AsyncClient, attempt: int) -> None:
        async with limit:
            await ask(http, url, replaying_token(rollout_id, attempt), "filler", ok=429)

    with replicas.replica_admin(instance) as admin:
        assert admin.post("/admin/pause", json={"mode": "reject"}).status_code == 200
        try:
            async with httpx.AsyncClient(timeout=60) as http:
                attempts = range(100, 100 + REPLAY_SESSIONS)
                await asyncio.gather(*(filler(http, attempt) for attempt in attempts))
        finally:
            assert admin.post("/admin/resume", json={}).status_code == 200


async def test_a_replay_across_replicas_serves_each_record_once_and_none_after_a_live_call(
    replicas: ReplicatedStack,
) -> None:
    rollout_id = await replicas.start_idle_rollout("replicas-replay")
    assert replicas.balancer is not None
    url = f"{replicas.gateway_url}/rollouts/{rollout_id}/v1/completions"
    recorded = ["same"] * 6 + [f"p{i}" for i in range(6)]
    replay = replaying_token(rollout_id, 2)
    a, b = replicas.instances
    # The policy server serves the version the replicas are at (earlier tests move it).
    with replicas.replica_admin(a) as admin:
        version = admin.get("/admin/state").json()["policy_version"]
    await asyncio.to_thread(replicas.load_policy_version, version)
    async with httpx.AsyncClient(timeout=60) as http:
        for prompt in recorded:
            assert await ask(http, url, replicas.token(rollout_id), prompt) is None

        async def concurrently(*prompts: str) -> list[str | None]:
            return list(await asyncio.gather(*(ask(http, url, replay, p) for p in prompts)))

        # Round-robin: each replica builds its session, then serves a "same" the other's
        # session does not know was served.
        assert None not in [await ask(http, url, replay, p) for p in ("p0", "p1", "same", "same")]
        assert None not in await concurrently("same", "same")
        await evict_replay_sessions(replicas, a, rollout_id)
        assert None not in await concurrently("same", "same")
        # Both replicas served from the record, each without knowing what the other served.
        for instance in replicas.instances:
            with replicas.replica_admin(instance) as admin:
                metrics = admin.get("/metrics").text
            replayed = sum(
                float(line.rsplit(" ", 1)[1])
                for line in metrics.splitlines()
                if line.startswith("darl_gateway_replayed_calls_total{")
            )
            assert replayed >= 1, instance
        await asyncio.to_thread(replicas.restart_replica, b, 1.0, True)
        await asyncio.to_thread(replicas.balancer.wait_all_up)
        assert None not in await concurrently("p2", "p3")
        # A request the record lacks goes live; after it, on either replica, nothing more is
        # served from the record, though one replica's session has not heard of it.
        assert await ask(http, url, replay, "new") is None
        after_live = [await ask(http, url, replay, p) for p in ("p4", "p5")]
    log = (replicas.root / "logs" / f"{a}.log").read_text()
    assert log.count(f"{rollout_id} attempt 2 replays") >= 2  # built, evicted, rebuilt

    # Counting from the store: no recorded call served twice, none after the first live call.
    records = await replicas.store().read(rollout_id, 2)
    originals = {r.call_id for r in await replicas.store().read(rollout_id, 1)}
    reproduced = Counter(r.replayed_from for r in records if r.replayed_from is not None)
    assert [call for call, n in reproduced.items() if n > 1] == []
    assert set(reproduced) <= originals
    first_live = min(r.sequence for r in records if r.replayed_from is None)
    assert [r.sequence for r in records if r.replayed_from and r.sequence > first_live] == []
    assert after_live == [None, None]
    assert (len(reproduced), len(records)) == (10, 13)
    await replicas.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()


@pytest.mark.timeout(600)
async def test_a_training_run_survives_a_replica_killed_mid_run(tmp_path: Path) -> None:
    kills, steps = in_sequence(REPLICA_KILLS)
    report = await ChaosRun(tmp_path, kills, steps, replicas=2).run(timeout=540)
    table = "\n".join([COLUMNS, *rows(report), summary(report)])
    print(table)
    assert report.clean, table
    assert report.rollouts_failed == 0 and report.trajectories_not_stored == 0, table
    assert len(report.kills) == len(REPLICA_KILLS)
