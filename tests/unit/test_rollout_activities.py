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
from darl.activities.errors import agent_service_unavailable
from darl.activities.rollout_activities import RolloutActivities, not_retried
from darl.activities.runners.local import LocalProcessRunner, stop_leftover_agents
from darl.workflows.contracts import (
    AgentHandle,
    AwaitRequest,
    LaunchRequest,
    LocalAgentSpec,
    RolloutSpec,
    RolloutTimeouts,
)
from darl.workflows.rollout_activity_options import AWAIT_RETRY, LAUNCH_RETRY


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
        (1, RetryPolicy(non_retryable_error_types=["ValueError"]), ValueError("x"), True),
    ],
)
def test_an_attempt_is_closed_only_where_temporal_will_not_retry_the_activity(
    attempt: int, policy: RetryPolicy | None, error: Exception, expected: bool
) -> None:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, attempt=attempt, retry_policy=policy)
    assert env.run(not_retried, error) is expected


class DownRunner:
    """A runner whose agent cannot be launched or waited on: a failure Temporal retries."""

    kind = "local"

    async def launch(self, request: LaunchRequest, contract: object) -> None:
        raise RuntimeError("the node is full")

    async def wait(self, request: AwaitRequest, contract: object, heartbeat: object) -> None:
        raise agent_service_unavailable("agent service answered 503")


class RecordingNotifier:
    def __init__(self) -> None:
        self.opened: list[tuple[str, int]] = []
        self.closed: list[tuple[str, int]] = []

    async def open_attempt(self, rollout_id: str, attempt: int) -> bool:
        self.opened.append((rollout_id, attempt))
        return False

    async def close_attempt(self, rollout_id: str, attempt: int, give_up_after: float) -> None:
        self.closed.append((rollout_id, attempt))


@pytest.mark.parametrize("last", [False, True], ids=["retried", "last-try"])
async def test_an_opened_attempt_is_closed_when_its_activity_is_not_retried(last: bool) -> None:
    """The gateway takes an opened attempt as running: a launch or a wait that fails for good
    (past its retry policy's last try) closes it there; one Temporal retries does not."""
    notifier = RecordingNotifier()
    issuer = ContractIssuer("http://127.0.0.1:9", b"secret")
    activities = RolloutActivities(
        {"local": DownRunner()},  # type: ignore[dict-item]
        issuer,
        NoTemporal(),  # type: ignore[arg-type]
        notifier,  # type: ignore[arg-type]
    )
    rollout = spec()
    env = ActivityEnvironment()
    env.info = dataclasses.replace(
        env.info,
        attempt=LAUNCH_RETRY.maximum_attempts - (0 if last else 1),
        retry_policy=LAUNCH_RETRY,
    )
    with pytest.raises(RuntimeError):
        await env.run(activities.launch_agent, LaunchRequest(spec=rollout, attempt=1))
    assert notifier.opened == [(rollout.rollout_id, 1)]
    assert notifier.closed == ([(rollout.rollout_id, 1)] if last else [])

    notifier.closed.clear()
    env.info = dataclasses.replace(
        env.info,
        attempt=AWAIT_RETRY.maximum_attempts - (0 if last else 1),
        retry_policy=AWAIT_RETRY,
    )
    handle = AgentHandle(kind="local", rollout_id=rollout.rollout_id, attempt=2, started_at=0.0)
    with pytest.raises(ApplicationError, match="503"):
        await env.run(activities.await_agent, AwaitRequest(spec=rollout, attempt=2, handle=handle))
    assert notifier.closed == ([(rollout.rollout_id, 2)] if last else [])
