"""TrainerReports, the rollout worker's batching of rollouts' reports, against Temporal's
time-skipping server with a collector workflow standing in for the trainer."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from darl.activities.trainer_reports import TrainerReports
from darl.workflows.contracts import RolloutMode, RolloutOutcome, RolloutResult
from darl.workflows.rollout_status import RolloutStatus
from tests.workflow.collector import CollectorWorkflow

TIMEOUT = 60


def result(i: int, error: str | None = None) -> RolloutOutcome:
    return RolloutResult(
        run_id="run",
        rollout_id=f"g{i // 4}.{i % 4}",
        group_id=f"g{i // 4}",
        mode=RolloutMode.TRAIN,
        status=RolloutStatus.SUCCEEDED,
        reward=float(i),
        attempts=1,
        call_ids=[f"c{i}"],
        error=error,
    ).outcome()


@asynccontextmanager
async def trainer(env: WorkflowEnvironment, expected: int) -> AsyncIterator[WorkflowHandle]:
    queue = f"collector-{uuid.uuid4().hex[:8]}"
    async with Worker(env.client, task_queue=queue, workflows=[CollectorWorkflow]):
        yield await env.client.start_workflow(
            CollectorWorkflow.run, expected, id=f"trainer-{uuid.uuid4().hex[:8]}", task_queue=queue
        )


async def test_reports_that_wait_together_go_in_one_signal(time_skipping_env: WorkflowEnvironment):
    """100 rollouts finishing at once cost the trainer 2 signals (64 + 36), each report
    arrives once, and every caller is answered only after its signal was taken."""
    reports = TrainerReports(time_skipping_env.client, max_results=64)
    sent = [result(i) for i in range(100)]
    async with trainer(time_skipping_env, len(sent)) as handle:
        delivered = await asyncio.wait_for(
            asyncio.gather(*(reports.report(handle.id, r) for r in sent)), TIMEOUT
        )
        received = await asyncio.wait_for(handle.result(), TIMEOUT)
    assert delivered == [True] * 100
    assert reports.signals_sent == 2
    assert sorted(received, key=lambda r: r.reward or 0) == sent


async def test_a_batch_stays_under_its_byte_limit(time_skipping_env: WorkflowEnvironment):
    """Outcomes carrying long errors (an agent's log tail, cut) split into more signals."""
    sent = [result(i, error="x" * 3_000) for i in range(10)]
    assert all(r.error is not None and len(r.error) < 1_010 for r in sent)
    size = len(sent[0].model_dump_json())
    reports = TrainerReports(time_skipping_env.client, max_bytes=3 * size)
    async with trainer(time_skipping_env, len(sent)) as handle:
        await asyncio.wait_for(
            asyncio.gather(*(reports.report(handle.id, r) for r in sent)), TIMEOUT
        )
        received = await asyncio.wait_for(handle.result(), TIMEOUT)
    assert reports.signals_sent == 4  # 3 + 3 + 3 + 1
    assert len(received) == 10


async def test_one_at_a_time_each_report_goes_at_once(time_skipping_env: WorkflowEnvironment):
    """No batching delay: a report with nothing queued beside it is its own signal."""
    reports = TrainerReports(time_skipping_env.client)
    async with trainer(time_skipping_env, 3) as handle:
        for i in range(3):
            assert await asyncio.wait_for(reports.report(handle.id, result(i)), TIMEOUT)
        await asyncio.wait_for(handle.result(), TIMEOUT)
    assert reports.signals_sent == 3


async def test_a_trainer_that_is_not_running_is_told_apart(time_skipping_env: WorkflowEnvironment):
    reports = TrainerReports(time_skipping_env.client)
    delivered = await asyncio.wait_for(reports.report("trainer-never-started", result(0)), TIMEOUT)
    assert delivered is False and reports.signals_sent == 0
