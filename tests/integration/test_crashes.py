"""Crashes mid-rollout lose nothing: a rollout worker killed with SIGKILL is replaced and the
rollout completes with its one agent (re-attached, never launched twice); a gateway killed with
SIGKILL and restarted loses no call and records none twice."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from pathlib import Path

from darl.workflows.contracts import LocalAgentSpec, RolloutSpec, RolloutTimeouts
from darl.workflows.rollout_status import RolloutStatus
from darl.workflows.rollout_workflow import RolloutWorkflow
from tests.integration.stack import Stack

SLOW_AGENT = str(Path(__file__).resolve().parents[1] / "agents" / "slow_agent.py")


def slow_spec(stack: Stack, calls: int, pause: float) -> RolloutSpec:
    return RolloutSpec(
        run_id="crash",
        rollout_id=f"crash-{uuid.uuid4().hex[:8]}",
        task={"question": "What is 2 + 2?"},
        agent=LocalAgentSpec(
            command=["{python}", SLOW_AGENT],
            env={
                "CALLS": str(calls),
                "PAUSE": str(pause),
                "LAUNCH_LOG": str(stack.root / "launches.log"),
            },
        ),
        timeouts=RolloutTimeouts(agent_seconds=120, heartbeat_seconds=2),
    )


def launches(stack: Stack, rollout_id: str) -> list[str]:
    log = stack.root / "launches.log"
    return [line for line in log.read_text().splitlines() if line.startswith(rollout_id + " ")]


async def test_a_killed_worker_is_replaced_and_the_agent_reattached(stack: Stack) -> None:
    spec = slow_spec(stack, calls=3, pause=2.0)
    handle = await stack.start_rollout(spec)
    await stack.wait_for_calls(handle, 1)
    stack.processes["worker"].kill()  # SIGKILL: no cleanup, no goodbye to Temporal
    stack.start_worker("worker-2")
    result = await asyncio.wait_for(handle.result(), 120)

    assert result.status == RolloutStatus.SUCCEEDED, result.error
    assert result.calls == 3
    assert result.attempts == 1
    assert len(launches(stack, spec.rollout_id)) == 1  # one agent, re-attached, never twice
    # The rollout's history shows the await_agent activity retried after the lost heartbeat.
    history = await handle.fetch_history()
    timeouts = [e for e in history.events if e.HasField("activity_task_timed_out_event_attributes")]
    retried = [
        e
        for e in history.events
        if e.HasField("activity_task_started_event_attributes")
        and e.activity_task_started_event_attributes.attempt > 1
    ]
    assert timeouts or retried


async def test_a_restarted_gateway_loses_and_duplicates_no_call(stack: Stack) -> None:
    """Events still waiting for their batched signal when the gateway dies live on in the
    trajectory store; the restarted gateway delivers them when the worker closes the attempt."""
    stack.restart_gateway(signal_interval=600)  # nothing is delivered before the close
    try:
        spec = slow_spec(stack, calls=6, pause=0.7)
        handle = await stack.start_rollout(spec)
        calls_file = stack.store_dir / spec.rollout_id / "attempt-1.jsonl"
        async with asyncio.timeout(60):
            while not calls_file.exists() or len(calls_file.read_text().splitlines()) < 2:
                await asyncio.sleep(0.05)
        assert (await handle.query(RolloutWorkflow.status)).calls == 0  # all still pending
        stack.restart_gateway(signal_interval=600, kill=True)
        result = await asyncio.wait_for(handle.result(), 120)
    finally:
        stack.restart_gateway()

    assert result.status == RolloutStatus.SUCCEEDED, result.error
    assert result.metadata["calls"] == 6  # the answers the agent received
    assert result.calls == 6
    assert len(set(result.call_ids)) == 6
    assert result.duplicate_signals == 0
    records = stack.store().read_sync(spec.rollout_id, call_ids=result.call_ids)
    # Each turn's prompt extends the previous one: the trajectory is whole and in order.
    for before, after in itertools.pairwise(records):
        assert after.prompt_token_ids[: len(before.prompt_token_ids)] == before.prompt_token_ids
    assert len(launches(stack, spec.rollout_id)) == 1
