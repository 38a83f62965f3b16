"""End to end on the real dev server: the digits model trains with GRPO through the real
gateway, policy server, rollout worker, agent service and trainer worker, and its reward rises
by more than noise can explain."""

from __future__ import annotations

import math
import uuid
from pathlib import Path

import pytest

from darl.examples.digits.task import TEST
from darl.trainer.run_files import read_metrics
from darl.workflows.training_state import StepRecord
from tests.integration.stack import Stack
from tests.integration.training_stack import (
    check_finished_run,
    served_versions,
    start_training,
    training_config,
    training_result,
)

pytestmark = pytest.mark.integration


def pooled(records: list[StepRecord]) -> tuple[float, float, int]:
    """Mean, variance and count of the per-rollout rewards of several steps."""
    n = sum(r.rollouts for r in records)
    mean = sum(r.reward_mean * r.rollouts for r in records) / n
    second = sum((r.reward_std**2 + r.reward_mean**2) * r.rollouts for r in records) / n
    return mean, second - mean**2, n


async def test_the_digits_model_learns(training_stack: Stack):
    """The TEST recipe of examples/digits/task.py, on-policy, through every real component."""
    stack = training_stack
    config = training_config(
        stack,
        f"learns-{uuid.uuid4().hex[:8]}",
        TEST.steps,
        group_size=TEST.group_size,
        batch_size=TEST.groups_per_step,
        min_group_size=TEST.group_size,
        backend_settings=TEST.trainer,
        max_tokens=TEST.max_tokens,
    )
    handle = await start_training(stack.client, config, stack.trainer_queue)
    summary = await training_result(stack, handle, 240)
    check_finished_run(summary, config)
    assert summary.counters.rollouts_failed == 0

    # The statistic: Welch's t of the per-rollout rewards of the last 2 steps against the
    # first 2 (each 2 x 64 rollouts). Under "no learning" t is about N(0, 1); t > 4 has a
    # one-sided probability below 4e-5. (Measured in process: t of 7-13 on 5 seeds.)
    records = [StepRecord.model_validate(r) for r in read_metrics(Path(config.run_dir or ""))]
    first_mean, first_var, n1 = pooled(records[:2])
    last_mean, last_var, n2 = pooled(records[-2:])
    t = (last_mean - first_mean) / math.sqrt(first_var / n1 + last_var / n2)
    assert t > 4, f"reward {first_mean:.3f} -> {last_mean:.3f}, Welch t = {t:.2f}"

    # On-policy: each trained rollout's calls were served by the policy of the step before.
    assert served_versions(stack, config.run_id) == set(range(TEST.steps))
