"""Which record an attempt replays (rule 10), on Temporal's time-skipping test server: the
workflow decides and tells the activities, whose token tells the gateway. Stub activities
stand in for the agents: each attempt's calls reach the workflow as the gateway sends them
(a `model_calls` signal before the attempt is lost, or the close's events in the result)."""

from __future__ import annotations

import asyncio
import uuid

from temporalio import activity
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from darl.activities.errors import agent_lost_error
from darl.workflows.contracts import (
    AgentExit,
    AgentHandle,
    AwaitRequest,
    LaunchRequest,
    ReplayOutcome,
    RewardSpec,
    RolloutTimeouts,
    rollout_workflow_id,
)
from darl.workflows.rollout_workflow import RolloutWorkflow
from tests.workflow.test_rollout_workflow import TIMEOUT, call_event, current_details, spec


class ScriptedAttempts:
    """Attempt n makes `calls[n]` calls (signalled, as the gateway does) and is lost, unless
    it is the last: that one exits 0 with its calls in the result, the first `replayed` of
    them replayed from the attempt its request named."""

    def __init__(self, client: Client, calls: dict[int, int], replayed: int) -> None:
        self.client = client
        self.calls = calls
        self.replayed = replayed
        self.replay_from: dict[int, list[int]] = {}
        # What the Web UI shows as the rollout's Current Details at its end.
        self.details = ""

    @activity.defn(name="launch_agent")
    async def launch_agent(self, request: LaunchRequest) -> AgentHandle:
        self.replay_from[request.attempt] = request.replay_from
        return AgentHandle(
            kind="stub", rollout_id=request.spec.rollout_id, attempt=request.attempt, started_at=0
        )

    @activity.defn(name="await_agent")
    async def await_agent(self, request: AwaitRequest) -> AgentExit:
        s, attempt = request.spec, request.attempt
        assert request.replay_from == self.replay_from[attempt]
        events = [call_event(s, f"{attempt}-{i}", i, attempt) for i in range(self.calls[attempt])]
        if attempt < max(self.calls):
            if events:
                handle = self.client.get_workflow_handle(rollout_workflow_id(s.rollout_id))
                await handle.signal(RolloutWorkflow.model_calls, events)
            raise agent_lost_error(f"attempt {attempt}'s pod was preempted")
        replayed = [
            e.model_copy(update={"replayed_from": f"{request.replay_from[0]}-{e.sequence}"})
            for e in events[: self.replayed]
        ]
        outcome = None
        if request.replay_from:
            outcome = ReplayOutcome(
                sources=request.replay_from,
                recorded=self.replayed + 1,
                replayed=self.replayed,
                diverged_at=self.replayed,
            )
        return AgentExit(exit_code=0, calls=replayed + events[self.replayed :], replay=outcome)

    @activity.defn(name="stop_agent")
    async def stop_agent(self, request: LaunchRequest) -> None:
        return None


async def run(env: WorkflowEnvironment, stubs: ScriptedAttempts, **overrides: object):
    s = spec(
        max_attempts=len(stubs.calls),
        reward=RewardSpec(missing_reward=0.0),
        timeouts=RolloutTimeouts(retry_backoff_seconds=1),
        **overrides,
    )
    queue = f"q-{uuid.uuid4().hex[:8]}"
    activities = [stubs.launch_agent, stubs.await_agent, stubs.stop_agent]
    async with Worker(
        env.client, task_queue=queue, workflows=[RolloutWorkflow], activities=activities
    ):
        handle = await env.client.start_workflow(
            RolloutWorkflow.run, s, id=rollout_workflow_id(s.rollout_id), task_queue=queue
        )
        result = await asyncio.wait_for(handle.result(), TIMEOUT)
        stubs.details = await current_details(handle)
        return result


async def test_each_attempt_replays_every_lost_attempt_newest_first(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    """Attempt 2 replays 1; attempt 2 is lost with no call the workflow heard of (it may
    hold answers its agent never received, which are never signalled), so attempt 3 replays
    2, then 1; attempt 4 replays 3, then what 3 had yet to replay of the lineage if it was
    lost mid-replay (the gateway reads that in the records)."""
    stubs = ScriptedAttempts(time_skipping_env.client, {1: 3, 2: 0, 3: 5, 4: 7}, replayed=5)
    result = await run(time_skipping_env, stubs)
    assert stubs.replay_from == {1: [], 2: [1], 3: [2, 1], 4: [3, 2, 1]}
    assert result.status == "succeeded" and result.attempts == 4
    assert result.calls == 7 and result.replayed_calls == 5
    assert result.replay_diverged_at == 5
    assert "attempt 4 of 4 · 7 calls · 5 replayed" in stubs.details


async def test_an_attempt_lost_before_any_call_reached_the_workflow_is_replayed(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    """Attempt 1 is lost with no call signalled (its agent died while its first calls were at
    the policy server: the gateway records those answers unreceived and sends no event):
    attempt 2 is still handed attempt 1's record, or it would generate them again."""
    stubs = ScriptedAttempts(time_skipping_env.client, {1: 0, 2: 2}, replayed=0)
    result = await run(time_skipping_env, stubs)
    assert stubs.replay_from == {1: [], 2: [1]}
    assert result.status == "succeeded" and result.attempts == 2


async def test_restart_never_replays(time_skipping_env: WorkflowEnvironment) -> None:
    stubs = ScriptedAttempts(time_skipping_env.client, {1: 3, 2: 4}, replayed=0)
    result = await run(time_skipping_env, stubs, resume="restart")
    assert stubs.replay_from == {1: [], 2: []}
    assert result.status == "succeeded" and result.replayed_calls == 0
    assert result.replay_diverged_at is None
