"""End to end on the real dev server: the digits model trains with GRPO through the real
gateway, policy server, rollout worker, agent service and trainer worker, and its reward rises
by more than noise can explain."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from deploy.training_cli import load_config
from gateway.store import DirectoryTrajectoryStore
from tests.integration.stack import Stack
from trainer.digits_task import TEST, make_tasks
from trainer.run_files import read_metrics
from workflows.training_contracts import (
    StepRecord,
    TrainingConfig,
    TrainingSummary,
    training_workflow_id,
)

pytestmark = pytest.mark.integration

CONFIG = Path(__file__).parents[2] / "examples" / "digits" / "train.yaml"
STEPS = TEST.steps


def training_config(stack: Stack, root: Path, run_id: str, **overrides: object) -> TrainingConfig:
    """The demo's config with the TEST recipe (trainer/digits_task.py), pointed at this
    stack; small and on-policy."""
    tasks = root / "tasks.jsonl"
    rows = make_tasks(400, seed=11, max_tokens=TEST.max_tokens)
    tasks.write_text("".join(json.dumps(t) + "\n" for t in rows))
    config = load_config(CONFIG, run_id)
    values = config.model_dump()
    values.update(
        dataset={"path": str(tasks), "seed": 1},
        run_dir=str(root / "runs" / run_id),
        mode="sync",
        group_size=TEST.group_size,
        batch_size=TEST.groups_per_step,
        total_steps=STEPS,
        validation={"every_steps": 0},
        reconcile_after_seconds=60,
    )
    values["backend"]["model_dir"] = str(stack.model_dir)
    values["backend"]["settings"] = TEST.trainer
    values["weight_sync"].update(
        gateway_admin_url=stack.gateway_url, policy_servers=[stack.policy_url]
    )
    values["rollout"].update(task_queue=stack.task_queue)
    values["rollout"]["agent"]["url"] = f"{stack.agent_service_url}/rollouts"
    values.update(overrides)
    return TrainingConfig.model_validate(values)


def pooled(records: list[StepRecord]) -> tuple[float, float, int]:
    """Mean, variance and count of the per-rollout rewards of several steps."""
    n = sum(r.rollouts for r in records)
    mean = sum(r.reward_mean * r.rollouts for r in records) / n
    second = sum((r.reward_std**2 + r.reward_mean**2) * r.rollouts for r in records) / n
    return mean, second - mean**2, n


@pytest.fixture(scope="module")
def training_stack(dev_env: WorkflowEnvironment, tmp_path_factory: pytest.TempPathFactory):
    stack = Stack(Path(tmp_path_factory.mktemp("training")), dev_env.client)
    stack.model = "digits"
    try:
        stack.start_policy_server()
        stack.start_gateway()
        stack.start_worker()
        stack.start_agent_service("examples.digits.agent_service:app")
        stack.start_trainer_worker()
        yield stack
    finally:
        stack.stop()


async def test_the_digits_model_learns(training_stack: Stack, tmp_path: Path):
    stack = training_stack
    config = training_config(stack, tmp_path, "e2e-learns")
    handle = await stack.client.start_workflow(
        "TrainingWorkflow",
        config,
        id=training_workflow_id(config.run_id),
        task_queue=stack.trainer_queue,
        result_type=TrainingSummary,
    )
    async with asyncio.timeout(280):
        summary = await handle.result()
    assert summary.steps == STEPS and summary.reason == f"completed {STEPS} steps"
    records = [StepRecord.model_validate(r) for r in read_metrics(Path(config.run_dir))]
    assert [r.step for r in records] == list(range(1, STEPS + 1))

    # The statistic: Welch's t of the per-rollout rewards of the last 2 steps against the
    # first 2 (each 2 x 64 rollouts). Under "no learning" t is about N(0, 1); t > 4 has a
    # one-sided probability below 4e-5. (Measured in process: t of 7-13 on 5 seeds.)
    first_mean, first_var, n1 = pooled(records[:2])
    last_mean, last_var, n2 = pooled(records[-2:])
    t = (last_mean - first_mean) / math.sqrt(first_var / n1 + last_var / n2)
    assert t > 4, f"reward {first_mean:.3f} -> {last_mean:.3f}, Welch t = {t:.2f}"

    # On-policy: every call of a trained step was served by the policy it then trained.
    c = summary.counters
    assert c.rollouts_started == (
        c.rollouts_trained
        + c.rollouts_in_dropped_groups
        + c.rollouts_failed
        + c.rollouts_cancelled
        + c.rollouts_validated
        + c.rollouts_left_over
    )
    assert c.rollouts_failed == 0 and c.unknown_reports == 0
    checkpoints = sorted(p.name for p in (Path(config.run_dir) / "checkpoints").iterdir())
    assert checkpoints == [f"step-{s:06d}" for s in range(STEPS + 1)]
    assert statistics.fmean(r.paused_seconds for r in records) < 5

    store = DirectoryTrajectoryStore(stack.store_dir)
    versions = {
        record.policy_version
        for rollout_dir in list(stack.store_dir.iterdir())[:50]
        if rollout_dir.is_dir() and rollout_dir.name.startswith(config.run_id)
        for record in store.read_sync(rollout_dir.name)
    }
    assert versions and versions <= set(range(STEPS))
