"""The trainer's side of its rollouts: reading the next tasks of its dataset, starting a
rollout workflow for each (idempotent by workflow id, rule 2), cancelling them, and asking
Temporal about rollouts the trainer has not heard from."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from darl.activities.errors import training_config_error
from darl.activities.heartbeats import heartbeats_throughout
from darl.activities.trainer_resources import HEARTBEAT_SECONDS, TrainerResources
from darl.workflows import search_attributes as sa
from darl.workflows.contracts import (
    RolloutMode,
    RolloutResult,
    RolloutSpec,
    rollout_workflow_id,
)
from darl.workflows.names import (
    CANCEL_ROLLOUTS,
    CHECK_ROLLOUTS,
    READ_TASKS,
    READ_VAL_TASKS,
    ROLLOUT_WORKFLOW,
    START_ROLLOUTS,
)
from darl.workflows.rollout_status import RolloutStatus
from darl.workflows.training_messages import (
    ReadTasksRequest,
    ReadValTasksRequest,
    RolloutLookup,
    RolloutStart,
    StartRolloutsRequest,
    TaskBatch,
)
from darl.workflows.training_state import TaskRow

# Rollout starts in flight at once: enough to start a batch in well under a second.
START_CONCURRENCY = 32


def rollout_specs(
    request: StartRolloutsRequest, task_of: Callable[[RolloutStart], Any]
) -> list[RolloutSpec]:
    """The specs of the rollouts `request` starts: the run's rollout settings, each rollout's
    ids, mode and prefix, and its task as `task_of` reads it from its row."""
    settings = request.settings
    if settings is None:
        if request.rollouts:
            raise training_config_error("start_rollouts: rollouts to start without their settings")
        return []
    return [
        RolloutSpec(
            run_id=request.run_id,
            rollout_id=start.rollout_id,
            group_id=start.group_id,
            task=task_of(start),
            mode=start.mode,
            agent=settings.agent,
            reward=settings.reward,
            timeouts=settings.timeouts,
            policy_version=request.policy_version,
            max_attempts=settings.max_attempts,
            report_to=request.report_to,
            revision=request.revision,
            prefix=start.prefix,
        )
        for start in request.rollouts
    ]


async def lookup_rollouts(client: Client, rollout_ids: list[str]) -> list[RolloutLookup]:
    """What Temporal knows of rollouts the trainer has not heard from: the result of one that
    completed, how one closed without a result (terminated, failed, not found)."""
    found = []
    for rollout_id in rollout_ids:
        handle = client.get_workflow_handle(
            rollout_workflow_id(rollout_id), result_type=RolloutResult
        )
        try:
            described = await handle.describe()
        except RPCError as err:
            if err.status != RPCStatusCode.NOT_FOUND:
                raise
            found.append(RolloutLookup(rollout_id=rollout_id, closed_as="not found"))
            continue
        status = described.status
        if status == WorkflowExecutionStatus.RUNNING:
            found.append(RolloutLookup(rollout_id=rollout_id, running=True))
        elif status == WorkflowExecutionStatus.COMPLETED:
            result = await handle.result()
            found.append(RolloutLookup(rollout_id=rollout_id, result=result.outcome()))
        else:
            name = status.name.lower() if status is not None else "unknown"
            found.append(RolloutLookup(rollout_id=rollout_id, closed_as=name))
    return found


class TrainerRolloutActivities(TrainerResources):
    """read_tasks, read_val_tasks, start_rollouts, cancel_rollouts, check_rollouts."""

    @activity.defn(name=READ_TASKS)
    @heartbeats_throughout(HEARTBEAT_SECONDS)
    async def read_tasks(self, request: ReadTasksRequest) -> TaskBatch:
        """The next `count` tasks from the cursor, across epoch ends, until `epochs` run out."""
        return await asyncio.to_thread(self._read_tasks, request)

    def _read_tasks(self, request: ReadTasksRequest) -> TaskBatch:
        dataset = request.dataset
        table = self._table(dataset.path)
        epoch, cursor = request.epoch, request.cursor
        rows: list[TaskRow] = []
        order = table.order(epoch, dataset.seed, dataset.shuffle)
        while len(rows) < request.count and epoch < request.epochs:
            index = int(order[cursor])
            rows.append(
                TaskRow(epoch=epoch, position=cursor, index=index, digest=table.digest(index))
            )
            cursor += 1
            if cursor == len(table.rows):
                epoch, cursor = epoch + 1, 0
                order = table.order(epoch, dataset.seed, dataset.shuffle)
        return TaskBatch(rows=rows, epoch=epoch, cursor=cursor, exhausted=epoch >= request.epochs)

    @activity.defn(name=READ_VAL_TASKS)
    @heartbeats_throughout(HEARTBEAT_SECONDS)
    async def read_val_tasks(self, request: ReadValTasksRequest) -> list[TaskRow]:
        return await asyncio.to_thread(self._read_val_tasks, request)

    def _read_val_tasks(self, request: ReadValTasksRequest) -> list[TaskRow]:
        path = request.validation.path or request.dataset.path
        table = self._table(path)
        count = min(request.validation.tasks, len(table.rows))
        return [TaskRow(epoch=0, position=i, index=i, digest=table.digest(i)) for i in range(count)]

    @activity.defn(name=START_ROLLOUTS)
    @heartbeats_throughout(HEARTBEAT_SECONDS)
    async def start_rollouts(self, request: StartRolloutsRequest) -> None:
        """Idempotent by workflow id: a rollout already started (or already finished) is
        left alone, never started twice (rule 2). Each task is read from its dataset here."""
        limit = asyncio.Semaphore(START_CONCURRENCY)
        specs = [*request.specs, *await asyncio.to_thread(self._specs, request)]

        async def start(spec: RolloutSpec) -> None:
            async with limit:
                with contextlib.suppress(WorkflowAlreadyStartedError):
                    await self._client.start_workflow(
                        ROLLOUT_WORKFLOW,
                        spec,
                        id=rollout_workflow_id(spec.rollout_id),
                        task_queue=request.task_queue,
                        id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                        search_attributes=sa.rollout_attributes(spec, RolloutStatus.PENDING.value),
                        # The Summary that `temporal workflow describe` and the Web UI show.
                        static_summary=sa.rollout_summary(spec),
                    )

        await asyncio.gather(*(start(s) for s in specs))

    def _specs(self, request: StartRolloutsRequest) -> list[RolloutSpec]:
        def task_of(start: RolloutStart) -> Any:
            path = request.val_dataset if start.mode == RolloutMode.VAL else request.dataset
            return self._task(start.row, path)

        return rollout_specs(request, task_of)

    def _task(self, row: TaskRow, path: str | None) -> Any:
        """The task a row names, read from the dataset at `path` and checked against its
        digest."""
        if row.index is None:
            return row.task
        if path is None:
            raise training_config_error("start_rollouts: rows by reference without their dataset")
        table = self._table(path)
        if row.index >= len(table.rows) or table.digest(row.index) != row.digest:
            raise training_config_error(
                f"dataset {path} changed under the run: its row {row.index} is not the task "
                "the run read there; a run's dataset must not change while it runs"
            )
        return table.rows[row.index]

    @activity.defn(name=CANCEL_ROLLOUTS)
    @heartbeats_throughout(HEARTBEAT_SECONDS)
    async def cancel_rollouts(self, rollout_ids: list[str]) -> None:
        """Request cancellation; each rollout kills its agent and reports `cancelled`."""

        async def cancel(rollout_id: str) -> None:
            try:
                await self._client.get_workflow_handle(rollout_workflow_id(rollout_id)).cancel()
            except RPCError as err:
                # Already closed: it has reported (or will be found by check_rollouts).
                if err.status not in (RPCStatusCode.NOT_FOUND, RPCStatusCode.FAILED_PRECONDITION):
                    raise

        await asyncio.gather(*(cancel(r) for r in rollout_ids))

    @activity.defn(name=CHECK_ROLLOUTS)
    @heartbeats_throughout(HEARTBEAT_SECONDS)
    async def check_rollouts(self, rollout_ids: list[str]) -> list[RolloutLookup]:
        return await lookup_rollouts(self._client, rollout_ids)
