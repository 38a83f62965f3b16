"""The coding-agent pipeline trains on the CPU: examples/swe/train.yaml, as shipped but aimed
at this test's stack, runs DARL's minimal coding agent on the shipped SWE-smith-style tasks
with the real reference policy (the tiny model, which cannot fix a bug), one bubblewrap
sandbox per attempt, the hidden-test grader, groups and GRPO steps of the reference trainer.
It proves the plumbing, not learning: every rollout is graded, and the steps train."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from darl.deploy.config_file import load_config
from darl.workflows.contracts import LocalAgentSpec, RolloutResult
from darl.workflows.rollout_status import RolloutStatus
from darl.workflows.training_config import TrainingConfig
from tests.integration.stack import Stack
from tests.integration.training_stack import check_finished_run, start_training, training_result

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "swe" / "train.yaml"
STEPS = 2


@pytest.fixture(scope="module")
def swe_training_stack(
    dev_env: WorkflowEnvironment, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    stack = Stack(Path(tmp_path_factory.mktemp("swe-training")), dev_env.client)
    try:
        stack.start()
        stack.start_trainer_worker("trainer")
    except BaseException:
        stack.stop()
        raise
    yield stack
    stack.stop()


def swe_config(stack: Stack, run_id: str) -> TrainingConfig:
    """The shipped config with the stack's endpoints, task queue, run directory and mirrors
    (built as a user builds them) and a few tasks; everything else as shipped."""
    mirrors = stack.root / "swe-repos"
    build = [sys.executable, "-m", "darl.examples.swe.make_tasks", "mirrors", "--out", str(mirrors)]
    subprocess.run(build, check=True, capture_output=True, timeout=120)
    tasks = stack.root / f"{run_id}-tasks.jsonl"
    rows = (ROOT / "examples" / "swe" / "tasks.jsonl").read_text().splitlines()
    tasks.write_text("\n".join(rows[:8]) + "\n")
    data = load_config(CONFIG, run_id).model_dump(mode="json")
    data["rollout"]["agent"]["sandbox"]["repos_dir"] = str(mirrors)
    data["rollout"]["task_queue"] = stack.task_queue
    data["backend"]["model_dir"] = str(stack.model_dir)
    data["weight_sync"] |= {
        "gateway_admin_url": None,
        "gateway_admin_urls": stack.admin_urls(),
        "policy_servers": [stack.policy_url],
    }
    data["dataset"]["path"] = str(tasks)
    data |= {"run_dir": str(stack.runs_dir / run_id), "total_steps": STEPS}
    return TrainingConfig.model_validate(data)


async def rollout_results(client: Client, run_id: str) -> list[RolloutResult]:
    results = []
    async for execution in client.list_workflows(f'WorkflowId STARTS_WITH "rollout/{run_id}"'):
        handle = client.get_workflow_handle(execution.id, result_type=RolloutResult)
        results.append(await handle.result())
    return results


async def test_a_coding_agent_run_grades_every_rollout_and_trains(swe_training_stack: Stack):
    stack = swe_training_stack
    config = swe_config(stack, f"swe-{uuid.uuid4().hex[:8]}")
    assert isinstance(config.rollout.agent, LocalAgentSpec)
    assert config.rollout.agent.sandbox is not None and config.rollout.reward.grader is not None
    handle = await start_training(stack.client, config, stack.trainer_queue)
    summary = await training_result(stack, handle, 600)
    check_finished_run(summary, config)

    results = await rollout_results(stack.client, config.run_id)
    assert len(results) >= STEPS * config.batch_size * config.group_size
    for result in results:
        # Graded by DARL in the attempt's sandbox, every one: the tiny model fixes nothing.
        assert result.status == RolloutStatus.SUCCEEDED, result.error
        assert result.grade is not None and result.reward == result.grade.reward == 0.0
        assert result.grade.tests > 0 and result.grade.passed < result.grade.tests
        assert result.calls >= 1
