"""A fault is never training signal (rule 7, 8), against the real gateway, policy server, agent
service and worker processes on the dev server:

- an agent that failed because the gateway was killed under it gets a fresh attempt;
- a restarted gateway comes back with its version, upstreams and pause;
- SIGTERM lets a call in flight finish (recorded) and answers held calls 503;
- a restarted policy server serves the weights it had, under their version; one that came back
  on older weights has nothing recorded from it until it serves the run's version again;
- an agent service that lost an attempt in a restart makes it an infra failure (a fresh
  attempt), never the same attempt run twice;
- a rollout id started again returns its first result, and runs no second agent.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from pathlib import Path

import httpx
import pytest
from temporalio.common import WorkflowIDReusePolicy

from darl.workflows.contracts import (
    HttpAgentSpec,
    RewardSpec,
    RolloutResult,
    RolloutSpec,
    RolloutTimeouts,
    rollout_workflow_id,
)
from darl.workflows.rollout_status import RolloutStatus
from darl.workflows.rollout_workflow import RolloutWorkflow
from tests.integration.stack import Stack
from tests.integration.test_crashes import launches, slow_spec

pytestmark = pytest.mark.integration

RESULT_TIMEOUT = 120
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def chat(stack: Stack, rollout_id: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(
        f"{stack.gateway_url}/rollouts/{rollout_id}/v1/chat/completions",
        json=CHAT,
        headers={"Authorization": f"Bearer {stack.token(rollout_id)}"},
        timeout=timeout,
    )


def in_thread(work) -> tuple[threading.Thread, list]:
    """Run a blocking call beside the test; its result (or exception) lands in the list."""
    out: list = []

    def run() -> None:
        try:
            out.append(work())
        except httpx.HTTPError as err:
            out.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


async def wait_until(predicate, timeout: float = 30, what: str = "") -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.05)


def state(stack: Stack) -> dict:
    with stack.admin() as admin:
        return admin.get("/admin/state").json()


# --- the gateway -------------------------------------------------------------------------------


async def test_an_agent_cut_off_by_a_gateway_kill_gets_a_fresh_attempt(stack: Stack) -> None:
    """The agent retries nothing (MAX_RETRIES 0): the call that hits the dead gateway kills
    it. Its attempt overlapped the gateway's outage, so the attempt is DARL's failure."""
    spec = slow_spec(stack, calls=4, pause=1.5)
    agent = spec.agent.model_copy(update={"env": {**spec.agent.env, "MAX_RETRIES": "0"}})
    spec = spec.model_copy(
        update={
            "agent": agent,
            "timeouts": RolloutTimeouts(
                agent_seconds=120, heartbeat_seconds=2, retry_backoff_seconds=1
            ),
        }
    )
    handle = await stack.start_rollout(spec)
    await stack.wait_for_calls(handle, 1)
    stack.processes["gateway"].kill()
    await asyncio.sleep(3)  # the agent's next call finds nobody
    stack.restart_gateway()
    result: RolloutResult = await asyncio.wait_for(handle.result(), RESULT_TIMEOUT)

    assert result.status == RolloutStatus.SUCCEEDED, result.error
    assert result.attempts == 2
    assert [line.split()[2] for line in launches(stack, spec.rollout_id)] == ["1", "2"]
    # Attempt 2's calls, each of them received by attempt 2's agent, and nothing else.
    assert result.call_ids == result.metadata["received"] and result.calls == 4
    stored = stack.store().read_sync(spec.rollout_id, attempt=2)
    assert [r.call_id for r in stored] == result.call_ids


async def test_a_restarted_gateway_keeps_its_version_upstreams_and_pause(stack: Stack) -> None:
    rollout_id = await stack.start_idle_rollout("keep-state")
    with stack.admin() as admin:
        stack.load_policy_version(5)
        admin.put("/admin/upstreams", json={"upstreams": [stack.policy_url]})
        admin.post("/admin/resume", json={"policy_version": 5})
    stack.restart_gateway(kill=True)
    after_kill = state(stack)
    assert (after_kill["policy_version"], after_kill["paused"]) == (5, False)
    assert after_kill["upstreams"] == [stack.policy_url]

    with stack.admin() as admin:
        admin.post("/admin/pause", json={"mode": "hold"})
    stack.restart_gateway(kill=True)  # killed inside a weight sync
    assert state(stack)["paused"] is True
    thread, answers = in_thread(lambda: chat(stack, rollout_id))
    await wait_until(lambda: state(stack)["held"] == 1)
    assert answers == []
    with stack.admin() as admin:
        admin.post("/admin/resume", json={"policy_version": 5})
    thread.join(30)
    assert [a.status_code for a in answers] == [200]
    assert answers[0].headers["x-darl-policy-version"] == "5"
    await stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()


async def test_sigterm_finishes_calls_in_flight_and_answers_held_ones_503(stack: Stack) -> None:
    rollout_id = await stack.start_idle_rollout("sigterm")
    version = state(stack)["policy_version"]
    policy = httpx.Client(base_url=stack.policy_url, timeout=30)
    # A call frozen inside the policy server is in flight at the gateway.
    policy.post("/pause", params={"mode": "keep"})
    inflight, in_answers = in_thread(lambda: chat(stack, rollout_id))
    await wait_until(lambda: sum(state(stack)["inflight"].values()) == 1)
    with stack.admin() as admin:
        admin.post("/admin/pause", json={"mode": "hold"})
    held, held_answers = in_thread(lambda: chat(stack, rollout_id))
    await wait_until(lambda: state(stack)["held"] == 1)

    gateway = stack.processes.pop("gateway")
    stopping = threading.Thread(target=gateway.stop, kwargs={"grace": 30}, daemon=True)
    stopping.start()
    held.join(10)
    assert [a.status_code for a in held_answers] == [503]
    assert held_answers[0].json()["error"]["code"] == "gateway_restarting"
    assert in_answers == [] and gateway.running()  # still finishing the call in flight
    policy.post("/resume")
    inflight.join(30)
    stopping.join(30)
    assert [a.status_code for a in in_answers] == [200]
    assert gateway.proc is not None and gateway.proc.returncode == 0
    call_id = in_answers[0].headers["x-darl-call-id"]
    assert [r.call_id for r in stack.store().read_sync(rollout_id)] == [call_id]
    # The held call's 503 is an incident of its attempt; the journal has the stop.
    incidents = stack.store_dir / rollout_id / "attempt-1.incidents"
    assert "gateway_restarting" in incidents.read_text() or "restarting" in incidents.read_text()
    stack.start_gateway(port=int(stack.gateway_url.rsplit(":", 1)[1]))
    assert state(stack)["paused"] is True  # it stopped paused: it comes back paused
    with stack.admin() as admin:
        admin.post("/admin/resume", json={"policy_version": version})
    policy.close()
    await stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()


# --- the policy server ------------------------------------------------------------------------


async def test_a_restarted_policy_server_serves_the_weights_it_had(stack: Stack) -> None:
    rollout_id = await stack.start_idle_rollout("policy-restart")
    stack.load_policy_version(6)
    with stack.admin() as admin:
        admin.post("/admin/resume", json={"policy_version": 6})
    stack.restart_policy_server(kill=True)
    assert httpx.get(f"{stack.policy_url}/version").json()["policy_version"] == 6
    answer = chat(stack, rollout_id)
    assert answer.status_code == 200
    [record] = stack.store().read_sync(rollout_id)
    assert record.policy_version == 6
    logged = [r for r in stack.policy_responses() if r["call_id"] == record.call_id]
    assert [r["policy_version"] for r in logged] == [6]
    await stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()


async def test_a_policy_server_behind_the_run_has_no_call_recorded(stack: Stack) -> None:
    """It came back on its initial weights (its state file lost): it still answers, but the
    gateway neither records nor passes on an answer from weights older than the run's; the
    call waits until the server serves the run's version, then goes again."""
    rollout_id = await stack.start_idle_rollout("policy-behind")
    stack.load_policy_version(7)
    with stack.admin() as admin:
        admin.post("/admin/resume", json={"policy_version": 7})
    stack.restart_policy_server(kill=True, forget_weights=True)
    assert httpx.get(f"{stack.policy_url}/version").json()["policy_version"] == 0
    thread, answers = in_thread(lambda: chat(stack, rollout_id, timeout=90))
    await wait_until(lambda: state(stack)["stale_upstreams"] == [stack.policy_url])
    await asyncio.sleep(1.5)
    assert answers == []
    assert stack.store().read_sync(rollout_id) == []
    stack.load_policy_version(7)  # a weight sync puts the run's weights back
    thread.join(30)
    assert [a.status_code for a in answers] == [200]
    [record] = stack.store().read_sync(rollout_id)
    assert record.policy_version == 7
    served = [r for r in stack.policy_responses() if r["call_id"] == record.call_id]
    assert served[0]["policy_version"] == 0  # answered by the old weights, thrown away
    assert served[-1]["policy_version"] == 7
    assert served[-1]["token_ids"][0] == record.completion_token_ids()
    assert state(stack)["stale_upstreams"] == []
    await stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()


# --- the agent service ------------------------------------------------------------------------


async def test_an_agent_service_that_lost_an_attempt_gets_a_fresh_one(stack: Stack) -> None:
    if "agent-service" not in stack.processes:
        stack.start_agent_service("tests.agents.slow_service:app")
    spec = RolloutSpec(
        run_id="service-restart",
        rollout_id=f"service-restart-{uuid.uuid4().hex[:8]}",
        task={"calls": 3, "pause": 1.0},
        agent=HttpAgentSpec(url=f"{stack.agent_service_url}/rollouts"),
        timeouts=RolloutTimeouts(agent_seconds=60, heartbeat_seconds=2, retry_backoff_seconds=1),
    )
    handle = await stack.start_rollout(spec)
    await stack.wait_for_calls(handle, 1)
    stack.restart_agent_service()  # SIGKILL mid-attempt; its journal survives
    result = await asyncio.wait_for(handle.result(), RESULT_TIMEOUT)

    assert result.status == RolloutStatus.SUCCEEDED, result.error
    assert result.attempts == 2
    runs = [
        json.loads(line)
        for line in (stack.root / "agent-service" / "runs.jsonl").read_text().splitlines()
    ]
    mine = [r["attempt"] for r in runs if r["rollout_id"] == spec.rollout_id]
    assert mine == [1, 2]  # attempt 1 ran once, never again after the restart
    assert result.call_ids == result.metadata["received"] and result.calls == 3
    assert {
        r.attempt for r in stack.store().read_sync(spec.rollout_id, call_ids=result.call_ids)
    } == {2}


# --- one rollout id, one result ----------------------------------------------------------------


async def test_a_rollout_id_started_again_returns_its_first_result(stack: Stack) -> None:
    spec = slow_spec(stack, calls=1, pause=0)
    first = await asyncio.wait_for((await stack.start_rollout(spec)).result(), RESULT_TIMEOUT)
    assert first.status == RolloutStatus.SUCCEEDED and first.calls == 1

    # What `temporal workflow start` does by default: a new execution of the closed id.
    again = await stack.client.start_workflow(
        RolloutWorkflow.run,
        spec,
        id=rollout_workflow_id(spec.rollout_id),
        task_queue=stack.task_queue,
        id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
    )
    second = await asyncio.wait_for(again.result(), RESULT_TIMEOUT)
    assert second == first
    assert len(launches(stack, spec.rollout_id)) == 1  # no second agent

    spec_file = stack.root / f"{spec.rollout_id}.json"
    spec_file.write_text(spec.model_dump_json())
    cli = await asyncio.to_thread(
        stack.darl, "rollout", str(spec_file), "--task-queue", stack.task_queue
    )
    assert cli.returncode == 0, cli.stderr
    assert "already ran" in cli.stdout
    assert RolloutResult.model_validate_json(cli.stdout.split("its result:", 1)[1]) == first
    assert len(launches(stack, spec.rollout_id)) == 1


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (json.dumps({"run_id": "x", "task": {}, "agent": {"kind": "local"}}), "rollout_id: Field"),
        ("{not json", "Invalid JSON"),
        (None, "No such file"),
    ],
    ids=["invalid-spec", "not-json", "missing"],
)
def test_a_bad_rollout_file_is_one_line(
    stack: Stack, tmp_path: Path, content: str | None, says: str
) -> None:
    path = tmp_path / "rollout.json"
    if content is not None:
        path.write_text(content)
    cli = stack.darl("rollout", str(path))
    assert cli.returncode == 2
    assert cli.stderr.count("\n") == 1 and "Traceback" not in cli.stderr, cli.stderr
    assert says in cli.stderr


@pytest.mark.parametrize(
    ("reward", "says"),
    [
        (RewardSpec(function="darl.examples.digits.task:nope"), "has no attribute 'nope'"),
        (RewardSpec(function="exact_match", answer_key="gold"), "no reference answer field 'gold'"),
    ],
    ids=["no-such-function", "task-lacks-the-answer"],
)
async def test_a_reward_that_cannot_work_fails_the_rollout_before_its_agent_runs(
    stack: Stack, reward: RewardSpec, says: str
) -> None:
    """Bad input (rule 9): the workflow fails at once with the reason, no agent was started,
    and `darl rollout` says it in one line and exits non-zero."""
    spec = slow_spec(stack, calls=1, pause=0).model_copy(update={"reward": reward})
    spec_file = stack.root / f"{spec.rollout_id}.json"
    spec_file.write_text(spec.model_dump_json())
    cli = await asyncio.to_thread(
        stack.darl, "rollout", str(spec_file), "--task-queue", stack.task_queue
    )
    assert cli.returncode == 1, cli.stdout + cli.stderr
    [line] = [line for line in cli.stderr.splitlines() if line.strip()]
    assert line.startswith("error: the workflow failed:") and "the reward cannot work" in line
    assert says in line and line.count(says) == 1, line
    assert not (stack.agents_dir / spec.rollout_id).exists()  # no agent was launched
