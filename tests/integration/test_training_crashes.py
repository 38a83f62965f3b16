"""Crashes mid-training lose no step and apply none twice: a trainer worker killed with SIGKILL
inside train_step is replaced and the step retried from the last checkpoint; a Temporal dev
server killed mid-run and restarted on its database lets the run finish where it was."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from darl.deploy.devstack import connect_when_ready, register_search_attributes
from darl.deploy.temporal_connection import connect
from darl.workflows.contracts import RolloutResult
from darl.workflows.names import TRAIN_STEP
from darl.workflows.rollout_status import RolloutStatus
from darl.workflows.training_messages import TrainingPhase, TrainingSummary
from tests.integration.dev_server import DevServer
from tests.integration.stack import Stack
from tests.integration.test_crashes import launches, slow_spec
from tests.integration.training_stack import (
    activity_attempts,
    check_finished_run,
    start_training,
    start_training_stack,
    training_config,
    training_result,
    wait_for_progress,
)

pytestmark = pytest.mark.integration

RUN_TIMEOUT = 150


async def test_a_trainer_killed_in_train_step_loses_and_repeats_no_step(
    training_stack: Stack,
) -> None:
    stack = training_stack
    steps = 3
    # Enough PPO epochs that a step takes seconds on one CPU thread: wide enough to hit.
    config = training_config(
        stack, f"crash-{uuid.uuid4().hex[:8]}", steps, backend_settings={"ppo_epochs": 600}
    )
    handle = await start_training(stack.client, config, stack.trainer_queue)
    await wait_for_progress(
        stack, handle, lambda p: p.phase == TrainingPhase.TRAINING and p.step == 1, timeout=90
    )
    stack.processes["trainer"].kill()  # SIGKILL mid-step: no checkpoint, no goodbye
    await asyncio.to_thread(stack.start_trainer_worker, "trainer-2")
    summary = await training_result(stack, handle, RUN_TIMEOUT)

    check_finished_run(summary, config)
    # Step 2 was trained twice: its first attempt died with the worker (its heartbeat
    # stopped) and the retry trained it again from step 1's checkpoint.
    attempts = await activity_attempts(handle, TRAIN_STEP)
    assert len(attempts) == steps
    assert attempts[1] > 1, attempts
    log = (stack.root / "logs" / "trainer-2.log").read_text()
    assert "Traceback" not in log, log[-3000:]


# --- a Temporal dev server of the test's own, killed and restarted on its database ---------


@pytest.fixture
def dev_server(tmp_path: Path) -> Iterator[DevServer]:
    server = DevServer(tmp_path)
    server.start()
    yield server
    server.stop()


async def test_a_restarted_temporal_server_resumes_the_run(
    dev_server: DevServer, tmp_path: Path
) -> None:
    await register_search_attributes(dev_server.settings)
    client = await connect(dev_server.settings)
    stack = await asyncio.to_thread(start_training_stack, tmp_path / "stack", client)
    try:
        steps = 4
        config = training_config(stack, f"restart-{uuid.uuid4().hex[:8]}", steps)
        handle = await start_training(client, config, stack.trainer_queue)
        await wait_for_progress(
            stack, handle, lambda p: p.step >= 1 and p.inflight_rollouts > 0, timeout=90
        )
        dev_server.kill()  # SIGKILL: whatever reached the database is all there is
        await asyncio.sleep(3)
        dev_server.start()
        client = await connect_when_ready(dev_server.settings)
        handle = client.get_workflow_handle(handle.id, result_type=TrainingSummary)
        summary = await training_result(stack, handle, RUN_TIMEOUT)

        check_finished_run(summary, config)
        # Every component rode out the outage (none exited and was missed).
        for process in stack.processes.values():
            assert process.running(), f"{process.name}: {process.log_tail()}"
    finally:
        await asyncio.to_thread(stack.stop)


async def test_a_temporal_outage_longer_than_the_heartbeat_timeout_keeps_the_agent(
    dev_server: DevServer, tmp_path: Path
) -> None:
    """Temporal is down three times longer than await_agent's heartbeat timeout: the rollout
    completes with its one agent and one attempt, every call it made in its result. (Whether
    the server then times the try out depends on who comes back first; that the worker then
    leaves the agent running is tests/unit/test_rollout_activities.py.)"""
    await register_search_attributes(dev_server.settings)
    client = await connect(dev_server.settings)
    stack = Stack(tmp_path / "stack", client)
    await asyncio.to_thread(stack.start)
    try:
        spec = slow_spec(stack, calls=3, pause=3.0)
        handle = await stack.start_rollout(spec)
        await stack.wait_for_calls(handle, 1)
        dev_server.kill()
        await asyncio.sleep(6)  # three heartbeat timeouts (heartbeat_seconds 2)
        dev_server.start()
        client = await connect_when_ready(dev_server.settings)
        handle = client.get_workflow_handle(handle.id, result_type=RolloutResult)
        result = await asyncio.wait_for(handle.result(), 120)
    finally:
        await asyncio.to_thread(stack.stop)
    assert result.status == RolloutStatus.SUCCEEDED, result.error
    assert result.attempts == 1
    assert len(launches(stack, spec.rollout_id)) == 1
    assert result.calls == 3 and result.call_ids == result.metadata["received"]
