"""A training run whose input cannot work ends Failed within seconds, saying why (rule 9),
against the real trainer worker, gateway, policy server and agent service on the dev server:
data that is missing, empty or lacks what the reward or the agent reads, a reward function
that does not load, an agent service or policy server that does not answer (retried about
half a minute), a run id that already trained. `darl train --follow` and `darl status` show
the reason in one line."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from temporalio.client import WorkflowFailureError
from temporalio.common import WorkflowIDReusePolicy
from temporalio.testing import WorkflowEnvironment

from darl.deploy.cli.support import failure_text
from darl.workflows.training_config import TrainingConfig, training_workflow_id
from tests.integration.stack import Stack
from tests.integration.training_stack import (
    TRAINING_WORKFLOW,
    start_training,
    start_training_stack,
    training_config,
    training_result,
)

pytestmark = pytest.mark.integration

# A config error fails the run at its first activity; "does not answer" is retried ~30 s.
FAILS_WITHIN = {"config": 20.0, "unreachable": 75.0}


@pytest.fixture(scope="module")
def stack(
    dev_env: WorkflowEnvironment, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    running = start_training_stack(tmp_path_factory.mktemp("bad-input"), dev_env.client)
    yield running
    running.stop()


class Whole(dict):  # type: ignore[type-arg]
    """A value of a change that replaces its key's value whole (not merged into it)."""


def broken(stack: Stack, change: dict[str, Any]) -> TrainingConfig:
    """The small digits config with `change` merged in (nested dicts merge, but `Whole`)."""
    data = training_config(stack, f"bad-{uuid.uuid4().hex[:8]}", 2).model_dump(mode="json")

    def merge(into: dict, update: dict) -> None:
        for key, value in update.items():
            if (
                isinstance(value, dict)
                and not isinstance(value, Whole)
                and isinstance(into.get(key), dict)
            ):
                merge(into[key], value)
            else:
                into[key] = value

    merge(data, change)
    return TrainingConfig.model_validate(data)


async def failure_of(stack: Stack, config: TrainingConfig, within: float) -> str:
    started = time.monotonic()
    handle = await start_training(stack.client, config, stack.trainer_queue)
    with pytest.raises(WorkflowFailureError) as failure:
        await training_result(stack, handle, within)
    assert time.monotonic() - started < within
    return failure_text(failure.value.cause)


def rows_file(stack: Stack, name: str, text: str) -> str:
    path = stack.root / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"dataset": {"path": "/nowhere/tasks.jsonl"}}, "does not exist"),
        ("empty", "has no rows"),
        (
            {"rollout": {"reward": {"function": "numeric_match", "answer_key": "solution"}}},
            "rows have no field 'solution' (the reference answer numeric_match reads)",
        ),
        (
            {"rollout": {"reward": {"function": "no_such_module:score"}}},
            "cannot load reward function 'no_such_module:score'",
        ),
        (
            {"rollout": {"agent": {"env_map": {"QUESTION": "input.question"}}}},
            "have no field 'input.question' (env_map QUESTION)",
        ),
        (
            "workflow-agent",
            "have no field 'question_text' (the agent workflow's input)",
        ),
        (
            "huge",
            "1 of 1 rows are too large for the agent's environment; the first is row 0: "
            "env_map STATEMENT: the task's 'input.statement' is 200,010 bytes",
        ),
        (
            "too-large",
            "1 of 1 rows are too large to be a task; the first is row 0: the task is 900,0",
        ),
    ],
    ids=[
        "missing-dataset",
        "empty-dataset",
        "no-answer-key",
        "unknown-reward",
        "bad-env-map",
        "workflow-agent-input",
        "env-map-too-large",
        "task-too-large",
    ],
)
async def test_a_run_whose_data_or_reward_cannot_work_fails_at_once(
    stack: Stack, change: dict | str, says: str
) -> None:
    if change == "empty":
        change = {"dataset": {"path": rows_file(stack, "empty.jsonl", "")}}
    elif change == "workflow-agent":
        change = {"rollout": {"agent": workflow_agent(input_field="question_text")}}
    elif change == "huge":
        # A row whose field an env_map puts in an environment variable Linux would refuse.
        dataset = broken(stack, {}).dataset.path
        row = json.loads(Path(dataset).read_text().splitlines()[0])
        row["statement"] = "x" * 200_000
        change = {
            "dataset": {"path": rows_file(stack, "huge.jsonl", json.dumps(row) + "\n")},
            "rollout": {"agent": {"env_map": {"STATEMENT": "input.statement"}}},
        }
    elif change == "too-large":
        # A row over a task's budget (TASK_MAX_BYTES): named with its largest field.
        dataset = broken(stack, {}).dataset.path
        row = json.loads(Path(dataset).read_text().splitlines()[0])
        row["repository_snapshot"] = "x" * 900_000
        change = {"dataset": {"path": rows_file(stack, "large.jsonl", json.dumps(row) + "\n")}}
    message = await failure_of(stack, broken(stack, change), FAILS_WITHIN["config"])
    assert says in message, message
    if change and "large.jsonl" in json.dumps(change):
        assert "the largest field, 'repository_snapshot', is 900,002" in message, message


def workflow_agent(**fields: str) -> Whole:
    """An agent that is a Temporal workflow, on a task queue no worker polls."""
    return Whole(
        kind="workflow",
        workflow="NoSuchAgent",
        task_queue=f"nobody-{uuid.uuid4().hex[:6]}",
        **fields,
    )


@pytest.mark.parametrize("what", ["agent service", "policy server", "agent worker"])
async def test_a_service_that_does_not_answer_fails_the_run_after_a_while(
    stack: Stack, what: str
) -> None:
    nobody = "http://127.0.0.1:9"  # the discard port: nothing listens there
    if what == "agent service":
        change: dict = {"rollout": {"agent": {"url": f"{nobody}/rollouts"}}}
    elif what == "agent worker":
        agent = workflow_agent()
        change = {"rollout": {"agent": agent}}
    else:
        change = {"weight_sync": {"policy_servers": [nobody]}}
    message = await failure_of(stack, broken(stack, change), FAILS_WITHIN["unreachable"])
    if what == "agent worker":
        assert f"no worker polls the task queue {agent['task_queue']!r}" in message, message
    else:
        assert f"the {what} at {nobody}" in message and "does not answer" in message, message


async def test_a_run_id_that_trained_is_not_trained_again(stack: Stack) -> None:
    config = training_config(stack, f"once-{uuid.uuid4().hex[:8]}", 1)
    summary = await training_result(
        stack, await start_training(stack.client, config, stack.trainer_queue), 120
    )
    assert summary.steps == 1
    # The temporal CLI's default reuse policy starts the closed id again: the run refuses.
    again = await stack.client.start_workflow(
        TRAINING_WORKFLOW,
        config,
        id=training_workflow_id(config.run_id),
        task_queue=stack.trainer_queue,
        id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
    )
    with pytest.raises(WorkflowFailureError) as failure:
        await asyncio.wait_for(again.result(), FAILS_WITHIN["config"])
    message = failure_text(failure.value.cause)
    assert f"run {config.run_id!r} already ran" in message and "trains once" in message

    # darl train refuses a completed run id before it starts anything.
    config_file = stack.root / f"{config.run_id}.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    cli = await darl(stack, "train", str(config_file), "--task-queue", stack.trainer_queue)
    assert cli.returncode == 1
    assert "already completed" in cli.stderr and cli.stderr.count("\n") == 1, cli.stderr


async def test_the_cli_says_why_a_run_failed_in_one_line(stack: Stack) -> None:
    config = broken(stack, {"dataset": {"path": "/nowhere/tasks.jsonl"}})
    config_file = stack.root / f"{config.run_id}.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    follow = await darl(
        stack, "train", str(config_file), "--follow", "--task-queue", stack.trainer_queue
    )
    assert follow.returncode == 1
    [line] = [line for line in follow.stderr.splitlines() if line.startswith("error:")]
    assert "dataset /nowhere/tasks.jsonl does not exist" in line
    assert "Traceback" not in follow.stderr
    status = await darl(stack, "status", config.run_id)
    assert status.returncode == 1
    assert "failed" in status.stderr and "does not exist" in status.stderr, status.stderr
    assert status.stderr.count("\n") == 1


async def darl(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(stack.darl, *args)


def test_a_config_file_that_is_not_a_config_is_one_line(stack: Stack, tmp_path: Path) -> None:
    bad = tmp_path / "train.yaml"
    bad.write_text(yaml.safe_dump({"run_id": "x", "group_size": 0}))
    cli = stack.darl("train", str(bad))
    assert cli.returncode == 2
    assert "dataset: Field required" in cli.stderr and "group_size" in cli.stderr, cli.stderr
    assert "Traceback" not in cli.stderr
