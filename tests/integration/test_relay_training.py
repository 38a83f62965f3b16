"""A short smoke of the relay example's training (examples/relay) in branching groups, through
the real gateway, policy server, rollout worker, relay agent service and trainer worker: its
groups branch, their prefixes are masked, and the trainer computes each group's shared prefix
once. How fast it learns is `make bench-learning`'s, not a test's."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

import darl.examples.relay
from darl.trainer.run_files import read_metrics
from darl.workflows.training_config import TrainingConfig
from tests.integration.stack import Stack
from tests.integration.training_stack import (
    check_finished_run,
    start_training,
    training_config,
    training_result,
)

pytestmark = pytest.mark.integration

EXAMPLE = Path(darl.examples.relay.__file__).parent


@pytest.fixture
def relay_stack(dev_env: WorkflowEnvironment, tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(tmp_path, dev_env.client)
    stack.model = "digits"
    try:
        stack.start()
        stack.start_agent_service("darl.examples.relay.agent_service:app")
        stack.start_trainer_worker("trainer")
    except BaseException:
        stack.stop()
        raise
    yield stack
    stack.stop()


def relay_config(stack: Stack, steps: int) -> TrainingConfig:
    """The integration tests' small on-policy config with the relay's tasks, reward and row
    lengths, in branching groups, the shared prefix computed once from 2 tokens."""
    config = training_config(
        stack,
        f"relay-{uuid.uuid4().hex[:8]}",
        steps,
        groups={"mode": "branch", "branch_at": "uniform"},
        equal_reward_groups="train",
        backend_settings={"shared_prefix_min_tokens": 2},
    )
    data = config.model_dump(mode="json")
    data["dataset"]["path"] = str(EXAMPLE / "tasks.jsonl")
    data["rollout"]["reward"]["function"] = "darl.examples.relay.task:relay_reward"
    data["aggregation"] = {"mode": "trajectory", "max_prompt_length": 24, "max_response_length": 16}
    return TrainingConfig.model_validate(data)


async def test_the_relay_trains_in_branching_groups(relay_stack: Stack) -> None:
    config = relay_config(relay_stack, steps=2)
    handle = await start_training(relay_stack.client, config, relay_stack.trainer_queue)
    summary = await training_result(relay_stack, handle, 120)
    check_finished_run(summary, config)
    assert summary.counters.rollouts_failed == 0
    assert summary.counters.groups_branched > 0
    steps = read_metrics(Path(config.run_dir or ""))
    assert len(steps) == 2
    # Every branch's replayed calls were kept out of training, in every step.
    assert all(s["trainer"]["aggregation/prefix_masked_calls"] > 0 for s in steps)
