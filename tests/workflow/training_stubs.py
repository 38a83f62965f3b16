"""Stub activities and a stub RolloutWorkflow for TrainingWorkflow tests on the time-skipping
server. Named as stubs: the real ones are tested end to end in tests/integration.

A stub rollout takes its behaviour from its task: `duration` seconds (plus its member index),
times `time_scale` (default 1; a test on the dev server runs in real time),
`rewards` by member index, `fail_members` that end as failed_agent. It reports to the trainer
exactly as the real RolloutWorkflow does (`rollout_finished`, also when cancelled).
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from datetime import timedelta

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError

from darl.workflows.names import ROLLOUT_FINISHED_SIGNAL, ROLLOUT_WORKFLOW

with workflow.unsafe.imports_passed_through():
    from darl.activities.trainer_rollouts import lookup_rollouts, rollout_specs
    from darl.workflows.contracts import RolloutResult, RolloutSpec, rollout_workflow_id
    from darl.workflows.rollout_status import RolloutStatus
    from darl.workflows.training_config import TrainingConfig
    from darl.workflows.training_messages import (
        InitializeRequest,
        ReadTasksRequest,
        ReadValTasksRequest,
        RecordStepRequest,
        RestoreResult,
        RolloutLookup,
        StartRolloutsRequest,
        SyncRequest,
        SyncResult,
        TaskBatch,
        TaskRow,
        TrainStepRequest,
        TrainStepResult,
    )


def _member(rollout_id: str) -> int:
    return int(rollout_id.rsplit(".", 1)[1])


@workflow.defn(name=ROLLOUT_WORKFLOW)
class StubRolloutWorkflow:
    @workflow.run
    async def run(self, spec: RolloutSpec) -> RolloutResult:
        k = _member(spec.rollout_id)
        task = spec.task
        try:
            seconds = (float(task.get("duration", 5)) + k) * float(task.get("time_scale", 1))
            await workflow.sleep(timedelta(seconds=seconds))
        except asyncio.CancelledError:
            await self._report(spec, RolloutStatus.CANCELLED, None)
            raise
        if k in task.get("fail_members", []):
            result = await self._report(spec, RolloutStatus.FAILED_AGENT, None)
        else:
            rewards = task.get("rewards", [0.0, 1.0])
            result = await self._report(spec, RolloutStatus.SUCCEEDED, rewards[k % len(rewards)])
        return result

    @staticmethod
    async def _report(spec: RolloutSpec, status: RolloutStatus, reward: float | None):
        """Like the real one; a task with `silent` loses its members' reports."""
        result = RolloutResult(
            run_id=spec.run_id,
            rollout_id=spec.rollout_id,
            group_id=spec.group_id,
            mode=spec.mode,
            status=status,
            reward=reward,
            attempts=1,
            calls=1,
            completion_tokens=3,
            call_ids=[call_id := f"{spec.rollout_id}-c0"],
            events_digest=hashlib.sha256(call_id.encode()).hexdigest(),
            policy_versions=[spec.policy_version],
        )
        if spec.report_to and not spec.task.get("silent"):
            await workflow.get_external_workflow_handle(spec.report_to).signal(
                ROLLOUT_FINISHED_SIGNAL, result.outcome()
            )
        return result


@dataclass
class StubTrainerActivities:
    """Records what the trainer asked for; `tasks` is the dataset."""

    client: Client
    tasks: list[dict]
    started: list[RolloutSpec] = field(default_factory=list)
    steps: list[TrainStepRequest] = field(default_factory=list)
    syncs: list[int] = field(default_factory=list)
    records: dict[int, RecordStepRequest] = field(default_factory=dict)
    cancelled: list[str] = field(default_factory=list)
    lookups: int = 0
    # Failures to act out: check_run's (its message), read_tasks' from this cursor on.
    check_run_error: str | None = None
    restores: list[int] = field(default_factory=list)
    reads_fail_at: int | None = None

    def activities(self) -> list:
        return [
            self.check_run,
            self.initialize_policy,
            self.read_tasks,
            self.read_val_tasks,
            self.start_rollouts,
            self.cancel_rollouts,
            self.check_rollouts,
            self.train_step,
            self.sync_weights,
            self.restore_weights,
            self.record_step,
        ]

    @activity.defn
    async def check_run(self, config: TrainingConfig) -> None:
        # The real check is tested against the real world (tests/integration).
        if self.check_run_error is not None:
            raise ApplicationError(
                self.check_run_error, type="TrainingConfigError", non_retryable=True
            )

    @activity.defn
    async def initialize_policy(self, request: InitializeRequest) -> TrainStepResult:
        return TrainStepResult(step=0, policy_path="ckpt/step-0", metrics={}, seconds=0.0)

    @activity.defn
    async def read_tasks(self, request: ReadTasksRequest) -> TaskBatch:
        if self.reads_fail_at is not None and request.cursor >= self.reads_fail_at:
            raise ApplicationError(
                "dataset stub: row 7 is not a task", type="TrainingConfigError", non_retryable=True
            )
        epoch, cursor, rows = request.epoch, request.cursor, []
        while len(rows) < request.count and epoch < request.epochs:
            rows.append(TaskRow(epoch=epoch, position=cursor, task=self.tasks[cursor]))
            cursor += 1
            if cursor == len(self.tasks):
                epoch, cursor = epoch + 1, 0
        return TaskBatch(rows=rows, epoch=epoch, cursor=cursor, exhausted=epoch >= request.epochs)

    @activity.defn
    async def read_val_tasks(self, request: ReadValTasksRequest) -> list[TaskRow]:
        count = min(request.validation.tasks, len(self.tasks))
        return [TaskRow(epoch=0, position=i, task=self.tasks[i]) for i in range(count)]

    @activity.defn
    async def start_rollouts(self, request: StartRolloutsRequest) -> None:
        for spec in [*request.specs, *rollout_specs(request, lambda start: start.row.task)]:
            try:
                await self.client.start_workflow(
                    ROLLOUT_WORKFLOW,
                    spec,
                    id=rollout_workflow_id(spec.rollout_id),
                    task_queue=request.task_queue,
                    id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                    id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                )
            except WorkflowAlreadyStartedError:
                continue
            self.started.append(spec)

    @activity.defn
    async def cancel_rollouts(self, rollout_ids: list[str]) -> None:
        for rollout_id in rollout_ids:
            self.cancelled.append(rollout_id)
            await self.client.get_workflow_handle(rollout_workflow_id(rollout_id)).cancel()

    @activity.defn
    async def check_rollouts(self, rollout_ids: list[str]) -> list[RolloutLookup]:
        """The real lookup (it only reads Temporal)."""
        self.lookups += len(rollout_ids)
        return await lookup_rollouts(self.client, rollout_ids)

    @activity.defn
    async def train_step(self, request: TrainStepRequest) -> TrainStepResult:
        self.steps.append(request)
        return TrainStepResult(
            step=request.step,
            policy_path=f"ckpt/step-{request.step}",
            metrics={"pg_loss": 0.1, "lr": request.learning_rate or 0.0},
            seconds=0.01,
        )

    @activity.defn
    async def sync_weights(self, request: SyncRequest) -> SyncResult:
        self.syncs.append(request.policy_version)
        return SyncResult(paused_seconds=0.05, drained=True)

    @activity.defn
    async def restore_weights(self, request: SyncRequest) -> RestoreResult:
        self.restores.append(request.policy_version)
        return RestoreResult()

    @activity.defn
    async def record_step(self, request: RecordStepRequest) -> None:
        self.records[request.record.step] = request
