"""await_agent's cancellation, with Temporal's ActivityEnvironment and a real agent process:
only the rollout's own cancellation (the workflow asked: a timeout, a cancelled rollout)
kills the agent and closes its attempt. A try the server gave up on (its heartbeat timed out
while Temporal was unreachable) or a worker shutting down leaves the agent running, for the
retry to re-attach to (rule 3); killing it would turn a Temporal outage into a failed attempt."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import psutil
import pytest
from temporalio.activity import ActivityCancellationDetails
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from darl.activities.agent_contract import ContractIssuer
from darl.activities.rollout_activities import RolloutActivities, not_retried
from darl.activities.runners.local import LocalProcessRunner, stop_leftover_agents
from darl.workflows.contracts import (
    AwaitRequest,
    LaunchRequest,
    LocalAgentSpec,
    RolloutSpec,
    RolloutTimeouts,
)


class NoTemporal:
    """Stands in for the Temporal client, which await_agent of a local agent never uses."""


def spec() -> RolloutSpec:
    return RolloutSpec(
        run_id="cancel",
        rollout_id=f"cancel-{time.monotonic_ns()}",
        task={},
        agent=LocalAgentSpec(command=["sleep", "60"]),
        timeouts=RolloutTimeouts(agent_seconds=60, heartbeat_seconds=1),
    )


@pytest.mark.parametrize(
    ("details", "killed"),
    [
        (ActivityCancellationDetails(timed_out=True), False),
        (ActivityCancellationDetails(not_found=True), False),
        (ActivityCancellationDetails(cancel_requested=True), True),
    ],
    ids=["heartbeat-timed-out", "try-not-found", "rollout-cancelled"],
)
async def test_only_the_rollouts_own_cancellation_kills_its_agent(
    tmp_path: Path, details: ActivityCancellationDetails, killed: bool
) -> None:
    runner = LocalProcessRunner(tmp_path / "agents", kill_grace_seconds=1)
    issuer = ContractIssuer("http://127.0.0.1:9", b"secret")
    activities = RolloutActivities({"local": runner}, issuer, NoTemporal())  # type: ignore[arg-type]
    rollout = spec()
    contract = issuer.issue(rollout, 1, None, {})
    handle = await runner.launch(LaunchRequest(spec=rollout, attempt=1), contract)
    agent = psutil.Process(handle.data["pid"])
    env = ActivityEnvironment()
    try:
        waiting = asyncio.ensure_future(
            env.run(activities.await_agent, AwaitRequest(spec=rollout, attempt=1, handle=handle))
        )
        await asyncio.sleep(0.5)  # waiting on the agent, heartbeating
        env.cancel(details)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiting, 10)
        alive = agent.is_running() and agent.status() != psutil.STATUS_ZOMBIE
        assert alive is not killed
    finally:
        stop_leftover_agents(tmp_path / "agents", grace_seconds=1)


@pytest.mark.parametrize(
    ("attempt", "policy", "error", "expected"),
    [
        (1, RetryPolicy(maximum_attempts=3), RuntimeError("flaky"), False),
        (3, RetryPolicy(maximum_attempts=3), RuntimeError("flaky"), True),
        (9, RetryPolicy(maximum_attempts=0), RuntimeError("flaky"), False),  # retried forever
        (1, None, RuntimeError("flaky"), False),
        (1, None, ApplicationError("bad", non_retryable=True), True),
        (
            1,
            RetryPolicy(non_retryable_error_types=["Bad"]),
            ApplicationError("x", type="Bad"),
            True,
        ),
    ],
)
def test_an_attempt_is_closed_only_where_temporal_will_not_retry_the_activity(
    attempt: int, policy: RetryPolicy | None, error: Exception, expected: bool
) -> None:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, attempt=attempt, retry_policy=policy)
    assert env.run(not_retried, error) is expected
