"""TrainingWorkflow on Temporal's time-skipping server when its input or its rollouts cannot
work (rule 9): it ends Failed, with the reason, instead of waiting for what can never come: a
config that does not validate, a start check that fails, a feeder whose reads fail, rollouts
that keep failing. Stub activities and rollouts (tests/workflow/training_stubs.py)."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from darl.workflows.names import TRAINING_WORKFLOW
from tests.workflow.failures import validation_failure
from tests.workflow.test_training_workflow import TIMEOUT, harness, tasks


def cause_message(failure: pytest.ExceptionInfo[WorkflowFailureError]) -> str:
    """The failure's causes joined, as the CLI shows them."""
    parts, cause = [], failure.value.cause
    while cause is not None:
        parts.append(str(cause))
        cause = cause.__cause__
    return " <- ".join(parts)


async def test_a_config_that_does_not_validate_fails_at_once(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    async with harness(time_skipping_env, tasks(4)) as h:
        config = h.config().model_dump(mode="json")
        config["group_size"] = 0
        del config["dataset"]
        handle = await time_skipping_env.client.start_workflow(
            TRAINING_WORKFLOW, config, id="train/not-a-config", task_queue=h.trainer_queue
        )
        cause = await validation_failure(handle, TIMEOUT)
    assert "dataset" in cause.message and "group_size" in cause.message
    assert h.stubs.started == []


async def test_a_failed_start_check_fails_the_run_before_any_rollout(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    async with harness(time_skipping_env, tasks(4)) as h:
        h.stubs.check_run_error = "dataset /nowhere.jsonl does not exist"
        handle = await h.start(h.config(total_steps=2))
        with pytest.raises(WorkflowFailureError) as failure:
            await asyncio.wait_for(handle.result(), TIMEOUT)
    assert "dataset /nowhere.jsonl does not exist" in cause_message(failure)
    assert h.stubs.started == [] and h.stubs.syncs == []


async def test_a_feeder_that_cannot_read_fails_the_run(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    """Before: the feeder task died silently and the run waited forever ("starting")."""
    async with harness(time_skipping_env, tasks(20)) as h:
        h.stubs.reads_fail_at = 2
        handle = await h.start(h.config(total_steps=5))
        with pytest.raises(WorkflowFailureError) as failure:
            await asyncio.wait_for(handle.result(), TIMEOUT)
    assert "row 7 is not a task" in cause_message(failure)


async def test_rollouts_that_keep_failing_fail_the_run(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    """Every rollout fails (its agent cannot start, say): the run stops after
    `max_failed_rollouts_in_a_row`, cancels what is out, and fails with the last error."""
    async with harness(time_skipping_env, tasks(50, fail_members=[0, 1, 2, 3])) as h:
        config = h.config(total_steps=5, max_failed_rollouts_in_a_row=12)
        handle = await h.start(config)
        with pytest.raises(WorkflowFailureError) as failure:
            await asyncio.wait_for(handle.result(), TIMEOUT)
        final = await h.status(handle)
    message = cause_message(failure)
    assert "12 rollouts in a row failed" in message and "failed_agent" in message
    assert h.stubs.steps == []
    assert final.counters.rollouts_failed >= 12
    assert final.inflight_rollouts == 0  # the ones still out were cancelled


async def test_a_success_resets_the_count_of_failures_in_a_row(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    """The control: three of four members fail in every group, the fourth succeeds; no run of
    12 failures in a row ever happens, so the run trains (min_group_size 1 keeps the groups)."""
    async with harness(time_skipping_env, tasks(50, fail_members=[1, 2, 3])) as h:
        config = h.config(
            total_steps=4,
            max_failed_rollouts_in_a_row=12,
            min_group_size=1,
            equal_reward_groups="train",
        )
        summary = await asyncio.wait_for((await h.start(config)).result(), TIMEOUT)
    assert summary.steps == 4
    assert summary.counters.rollouts_failed == 24  # more than 12, never 12 in a row
