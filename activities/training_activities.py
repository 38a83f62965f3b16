"""The trainer's activities (task queue `darl-trainer`): read tasks, start and cancel rollouts,
train a step, sync weights, write the run's files. Each is idempotent, so Temporal may retry
any of them after a crash: starts by workflow id, steps by checkpoint, syncs by version."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from pathlib import Path

import httpx
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from activities.rollout_activities import heartbeating
from gateway.store import DirectoryTrajectoryStore
from trainer import run_files
from trainer.aggregation import AggregationSettings, RolloutSample, aggregate
from trainer.backend import StepKnobs, TrainerBackend, TrainerBackendError
from trainer.backends import make_backend
from trainer.datasets import DatasetError, TaskTables
from trainer.policy_control import (
    GatewayControl,
    WeightSyncError,
    policy_server_control,
    sync_weights,
)
from workflows import search_attributes as sa
from workflows.contracts import RolloutResult, rollout_workflow_id
from workflows.rollout_status import RolloutStatus
from workflows.training_contracts import (
    BackendSpec,
    InitializeRequest,
    ReadTasksRequest,
    ReadValTasksRequest,
    RecordStepRequest,
    RolloutLookup,
    StartRolloutsRequest,
    SyncRequest,
    SyncResult,
    TaskBatch,
    TaskRow,
    TrainStepRequest,
    TrainStepResult,
)
from workflows.training_workflow import (
    CANCEL_ROLLOUTS,
    CHECK_ROLLOUTS,
    INITIALIZE_POLICY,
    READ_TASKS,
    READ_VAL_TASKS,
    RECORD_STEP,
    START_ROLLOUTS,
    SYNC_WEIGHTS,
    TRAIN_STEP,
    TRAINING_CONFIG_ERROR,
)

log = logging.getLogger(__name__)

# Rollout starts in flight at once: enough to start a batch in well under a second.
START_CONCURRENCY = 32
HEARTBEAT_SECONDS = 5.0


def heartbeat_every() -> float:
    """Well inside the activity's heartbeat timeout, whatever the config made it."""
    timeout = activity.info().heartbeat_timeout
    if timeout is None:
        return HEARTBEAT_SECONDS
    return min(HEARTBEAT_SECONDS, timeout.total_seconds() / 3)


def config_error(message: str) -> ApplicationError:
    return ApplicationError(message, type=TRAINING_CONFIG_ERROR, non_retryable=True)


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
            found.append(RolloutLookup(rollout_id=rollout_id, result=await handle.result()))
        else:
            name = status.name.lower() if status is not None else "unknown"
            found.append(RolloutLookup(rollout_id=rollout_id, closed_as=name))
    return found


class TrainerActivities:
    def __init__(
        self,
        client: Client,
        store: DirectoryTrajectoryStore,
        runs_dir: Path,
        admin_key: str,
        http: httpx.AsyncClient,
    ) -> None:
        self._client = client
        self._store = store
        self._runs_dir = runs_dir
        self._admin_key = admin_key
        self._http = http
        self._tables = TaskTables()
        self._backends: dict[str, TrainerBackend] = {}
        # One step at a time per process: steps of one run never overlap in memory.
        self._train_lock = threading.Lock()

    def activities(self) -> list:
        return [
            self.initialize_policy,
            self.read_tasks,
            self.read_val_tasks,
            self.start_rollouts,
            self.cancel_rollouts,
            self.check_rollouts,
            self.train_step,
            self.sync_weights,
            self.record_step,
        ]

    def run_dir(self, run_id: str, run_dir: str | None) -> Path:
        return Path(run_dir) if run_dir else self._runs_dir / run_id

    def _backend(self, run_id: str, run_dir: str | None, spec: BackendSpec) -> TrainerBackend:
        backend = self._backends.get(run_id)
        if backend is None:
            checkpoints = self.run_dir(run_id, run_dir) / "checkpoints"
            try:
                backend = make_backend(spec, checkpoints)
            except ValueError as err:
                raise config_error(f"backend settings: {err}") from err
            self._backends[run_id] = backend
        return backend

    def close(self) -> None:
        """Release what the backends hold (verl's Ray workers)."""
        while self._backends:
            _, backend = self._backends.popitem()
            backend.close()

    # --- the policy ------------------------------------------------------------------------

    @activity.defn(name=INITIALIZE_POLICY)
    async def initialize_policy(self, request: InitializeRequest) -> TrainStepResult:
        """Step 0 from the initial model, or the latest checkpoint of an earlier run."""
        backend = self._backend(request.run_id, request.run_dir, request.backend)
        model_dir = Path(request.backend.model_dir)
        if not await asyncio.to_thread(model_dir.is_dir):
            raise config_error(f"model_dir {model_dir} is not a model directory")
        info = await asyncio.to_thread(backend.initialize)
        return TrainStepResult(
            step=info.step, policy_path=str(backend.policy_path(info.step)), metrics={}, seconds=0
        )

    @activity.defn(name=TRAIN_STEP)
    async def train_step(self, request: TrainStepRequest) -> TrainStepResult:
        """Idempotent per step (rule 5): a step already checkpointed is returned as it was;
        after a crash the retry trains from the last checkpoint. Heartbeats throughout."""
        backend = self._backend(request.run_id, request.run_dir, request.backend)

        def train() -> TrainStepResult:
            with self._train_lock:
                backend.initialize()
                settings = AggregationSettings(
                    mode=request.aggregation.mode,
                    max_prompt_length=request.aggregation.max_prompt_length,
                    max_response_length=request.aggregation.max_response_length,
                    pad_token_id=backend.pad_token_id,
                )
                batch, counters = aggregate(self._samples(request), settings)
                done = backend.train_step(request.step, batch, StepKnobs(lr=request.learning_rate))
            aggregated = {f"aggregation/{k}": float(v) for k, v in counters.as_dict().items()}
            return TrainStepResult(
                step=done.step,
                policy_path=str(backend.policy_path(done.step)),
                metrics={**done.metrics, **aggregated},
                seconds=done.seconds,
            )

        try:
            return await heartbeating(asyncio.to_thread(train), heartbeat_every())
        except (ValueError, TrainerBackendError) as err:
            # A batch no step can use, a step out of order: retrying cannot fix either.
            raise config_error(f"step {request.step}: {err}") from err

    def _samples(self, request: TrainStepRequest) -> list[RolloutSample]:
        samples = []
        for group in request.groups:
            for member in group.members:
                records = self._store.read_sync(
                    member.rollout_id, attempt=member.attempt, call_ids=member.call_ids
                )
                samples.append(
                    RolloutSample(
                        rollout_id=member.rollout_id,
                        group_id=group.group_id,
                        reward=member.reward,
                        records=records,
                    )
                )
        return samples

    @activity.defn(name=SYNC_WEIGHTS)
    async def sync_weights(self, request: SyncRequest) -> SyncResult:
        settings = request.weight_sync
        gateway = GatewayControl(
            settings.gateway_admin_url.rstrip("/"), self._admin_key, self._http
        )
        servers = [policy_server_control(spec, self._http) for spec in settings.policy_servers]
        try:
            outcome = await heartbeating(
                sync_weights(
                    gateway,
                    servers,
                    request.policy_path,
                    request.policy_version,
                    settings.inflight,
                    settings.drain_timeout_seconds,
                    settings.pause_mode,
                    settings.register_upstreams,
                ),
                heartbeat_every(),
            )
        except WeightSyncError as err:
            raise ApplicationError(str(err), type="WeightSyncError", non_retryable=True) from err
        return SyncResult(paused_seconds=outcome.paused_seconds, drained=outcome.drained)

    # --- tasks and rollouts ----------------------------------------------------------------

    @activity.defn(name=READ_TASKS)
    async def read_tasks(self, request: ReadTasksRequest) -> TaskBatch:
        """The next `count` tasks from the cursor, across epoch ends, until `epochs` run out."""
        try:
            table = self._tables.get(request.dataset.path)
        except DatasetError as err:
            raise config_error(str(err)) from err
        dataset = request.dataset
        epoch, cursor, rows = request.epoch, request.cursor, []
        order = table.order(epoch, dataset.seed, dataset.shuffle)
        while len(rows) < request.count and epoch < request.epochs:
            index = int(order[cursor])
            rows.append(TaskRow(epoch=epoch, position=cursor, task=table.rows[index]))
            cursor += 1
            if cursor == len(table.rows):
                epoch, cursor = epoch + 1, 0
                order = table.order(epoch, dataset.seed, dataset.shuffle)
        return TaskBatch(rows=rows, epoch=epoch, cursor=cursor, exhausted=epoch >= request.epochs)

    @activity.defn(name=READ_VAL_TASKS)
    async def read_val_tasks(self, request: ReadValTasksRequest) -> list[TaskRow]:
        path = request.validation.path or request.dataset.path
        try:
            table = self._tables.get(path)
        except DatasetError as err:
            raise config_error(str(err)) from err
        count = min(request.validation.tasks, len(table.rows))
        return [TaskRow(epoch=0, position=i, task=table.rows[i]) for i in range(count)]

    @activity.defn(name=START_ROLLOUTS)
    async def start_rollouts(self, request: StartRolloutsRequest) -> None:
        """Idempotent by workflow id: a rollout already started (or already finished) is
        left alone, never started twice (rule 2)."""
        limit = asyncio.Semaphore(START_CONCURRENCY)

        async def start(spec) -> None:
            async with limit:
                with contextlib.suppress(WorkflowAlreadyStartedError):
                    await self._client.start_workflow(
                        "RolloutWorkflow",
                        spec,
                        id=rollout_workflow_id(spec.rollout_id),
                        task_queue=request.task_queue,
                        id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                        search_attributes=sa.rollout_attributes(spec, RolloutStatus.PENDING.value),
                    )

        await heartbeating(asyncio.gather(*(start(s) for s in request.specs)), heartbeat_every())

    @activity.defn(name=CANCEL_ROLLOUTS)
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
    async def check_rollouts(self, rollout_ids: list[str]) -> list[RolloutLookup]:
        return await lookup_rollouts(self._client, rollout_ids)

    # --- the run's files ---------------------------------------------------------------------

    @activity.defn(name=RECORD_STEP)
    async def record_step(self, request: RecordStepRequest) -> None:
        run_dir = self.run_dir(request.run_id, request.run_dir)
        await asyncio.to_thread(run_files.write_step, run_dir, request.record.model_dump())
        await asyncio.to_thread(run_files.plot_rewards, run_dir, request.run_id)
