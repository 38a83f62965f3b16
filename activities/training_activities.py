"""The trainer's activities (task queue `darl-trainer`): read tasks, start and cancel rollouts,
train a step, sync weights, write the run's files. Each is idempotent, so Temporal may retry
any of them after a crash: starts by workflow id, steps by checkpoint, syncs by version."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import statistics
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from darl.activities import rewards
from darl.activities.agent_contract import (
    TaskPathError,
    TaskValueTooLargeError,
    env_map_values,
    task_field,
    task_path,
)
from darl.activities.heartbeats import heartbeats_throughout
from darl.activities.rollout_activities import earlier_executions
from darl.gateway.store.base import TrajectoryStore
from darl.gateway.store.record import CallRecord
from darl.trainer import run_files
from darl.trainer.aggregation import AggregationSettings, RolloutSample, aggregate
from darl.trainer.backend import StepOverrides, TrainerBackend, TrainerBackendError
from darl.trainer.backend_factory import make_backend
from darl.trainer.datasets import DatasetError, TaskTables
from darl.trainer.gateway_replicas import GatewayReplicas
from darl.trainer.policy_control import (
    WeightSyncError,
    policy_server_control,
    restore_weights,
    sync_weights,
)
from darl.workflows import search_attributes as sa
from darl.workflows.contracts import (
    HttpAgentSpec,
    RolloutMode,
    RolloutResult,
    RolloutSpec,
    rollout_workflow_id,
    task_over_budget,
)
from darl.workflows.names import (
    CANCEL_ROLLOUTS,
    CHECK_ROLLOUTS,
    CHECK_RUN,
    CHOOSE_BRANCH_POINT,
    INITIALIZE_POLICY,
    READ_TASKS,
    READ_VAL_TASKS,
    RECORD_STEP,
    RESTORE_WEIGHTS,
    ROLLOUT_WORKFLOW,
    START_ROLLOUTS,
    SYNC_WEIGHTS,
    TRAIN_STEP,
    TRAINING_CONFIG_ERROR,
    WEIGHT_SYNC_ERROR,
)
from darl.workflows.rollout_status import RolloutStatus
from darl.workflows.training_config import BackendSpec, DatasetSpec, GroupsSpec, TrainingConfig
from darl.workflows.training_messages import (
    BranchPoint,
    BranchPointRequest,
    InitializeRequest,
    ReadTasksRequest,
    ReadValTasksRequest,
    RecordStepRequest,
    RestoreResult,
    RolloutLookup,
    RolloutStart,
    StartRolloutsRequest,
    SyncRequest,
    SyncResult,
    TaskBatch,
    TrainStepRequest,
    TrainStepResult,
)
from darl.workflows.training_state import TaskRow

log = logging.getLogger(__name__)

# Rollout starts in flight at once: enough to start a batch in well under a second.
START_CONCURRENCY = 32
# A trainer activity heartbeats at least this often, and well inside its heartbeat timeout,
# whatever the config made it.
HEARTBEAT_SECONDS = 5.0


# A trajectory a step must train is not in the store as its rollout committed it.
TRAJECTORY_LOST = "TrajectoryLost"


def config_error(message: str) -> ApplicationError:
    return ApplicationError(message, type=TRAINING_CONFIG_ERROR, non_retryable=True)


def unreachable(message: str) -> ApplicationError:
    """Something the run needs does not answer yet: retried a while (AT_START), then fatal."""
    return ApplicationError(message, type="Unreachable")


def rows_missing(
    rows: list[Any], path: str, what: str, dataset: str, shown: str | None = None
) -> ApplicationError | None:
    """A config error naming the rows of `dataset` that have no value at `path` (written
    `shown` in the config), if any."""
    shown = path if shown is None else shown
    missing = []
    for index, row in enumerate(rows):
        try:
            task_field(row, path, shown)
        except TaskPathError:
            missing.append(index)
    if not missing:
        return None
    return config_error(
        f"dataset {dataset}: {len(missing)} of {len(rows)} rows have no field {shown!r} "
        f"({what}); the first is row {missing[0]}"
    )


def rows_too_large(rows: list[Any], name: str, spec: str, dataset: str) -> ApplicationError | None:
    """A config error naming the rows of `dataset` whose `env_map` value `name` (written
    `spec`) is too large for an environment variable, if any."""
    over: list[tuple[int, TaskValueTooLargeError]] = []
    for index, row in enumerate(rows):
        try:
            env_map_values(row, {name: spec})
        except TaskValueTooLargeError as err:
            over.append((index, err))
    if not over:
        return None
    first, refused = over[0]
    return config_error(
        f"dataset {dataset}: {len(over)} of {len(rows)} rows are too large for the agent's "
        f"environment; the first is row {first}: {refused}"
    )


def rows_over_budget(rows: list[Any], dataset: str) -> ApplicationError | None:
    """A config error naming the rows of `dataset` over a task's budget (TASK_MAX_BYTES),
    the first with its largest field, if any."""
    over = [(i, why) for i, row in enumerate(rows) if (why := task_over_budget(row)) is not None]
    if not over:
        return None
    first, why = over[0]
    return config_error(
        f"dataset {dataset}: {len(over)} of {len(rows)} rows are too large to be a task; the "
        f"first is row {first}: {why}"
    )


def committed_calls(
    records: list[CallRecord], rollout_id: str, calls: int, digest: str
) -> list[CallRecord]:
    """The calls a rollout's final attempt committed, from all its attempt's `records`: the
    first `calls` by sequence (a call recorded after the attempt's close comes after them) of
    those its agent received (an answer it never received is no part of its trajectory),
    checked against `digest`, the SHA-256 of their ids (`RolloutOutcome.events_digest`).
    KeyError when the store's record is not what the rollout committed."""
    received = (r for r in records if not r.unreceived)
    taken = sorted(received, key=lambda r: r.sequence)[:calls]
    found = hashlib.sha256("\n".join(r.call_id for r in taken).encode()).hexdigest()
    if len(taken) < calls or found != digest:
        raise KeyError(
            f"the store's record of {rollout_id} ({len(records)} calls) is not the {calls} "
            "calls its final attempt committed"
        )
    return taken


def rollout_specs(
    request: StartRolloutsRequest, task_of: Callable[[RolloutStart], Any]
) -> list[RolloutSpec]:
    """The specs of the rollouts `request` starts: the run's rollout settings, each rollout's
    ids, mode and prefix, and its task as `task_of` reads it from its row."""
    settings = request.settings
    if settings is None:
        if request.rollouts:
            raise config_error("start_rollouts: rollouts to start without their settings")
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


def surprisal(record: CallRecord) -> float:
    """The mean -logprob of a call's sampled tokens (an entropy proxy); 0.0 for a call that
    sampled none or came back without logprobs."""
    logprobs = record.completion_logprobs()
    return -statistics.fmean(logprobs) if logprobs else 0.0


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


class TrainerActivities:
    def __init__(
        self,
        client: Client,
        store: TrajectoryStore,
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
            self.choose_branch_point,
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

    # --- the start of a run ------------------------------------------------------------------

    @activity.defn(name=CHECK_RUN)
    @heartbeats_throughout(HEARTBEAT_SECONDS)
    async def check_run(self, config: TrainingConfig) -> None:
        """Fail the run at its start, saying why, when it cannot work (rule 9): a run id that
        already trained, data that cannot be read or lacks what the reward or the agent reads,
        a reward function that does not load (TrainingConfigError, not retried); an agent
        service, policy server or gateway that does not answer (retried about half a minute)."""
        await self._refuse_a_second_run(config)
        await asyncio.to_thread(self._check_data, config)
        await self._check_services(config)

    async def _refuse_a_second_run(self, config: TrainingConfig) -> None:
        """A run id trains once: an earlier execution of its workflow id that started rollouts,
        or checkpoints past step 0 in its run directory, are an earlier run's (its rollout ids
        and steps would be reused). One that failed before its first rollout (a bad config,
        fixed since) leaves nothing behind and may be started again."""
        for execution in await earlier_executions(self._client):
            query = f'DarlRun = "{config.run_id}" AND WorkflowType = "{ROLLOUT_WORKFLOW}"'
            rollouts = (await self._client.count_workflows(query)).count
            if rollouts:
                ended = execution.status.name.lower() if execution.status else "unknown"
                raise config_error(
                    f"run {config.run_id!r} already ran ({execution.id} is {ended}, with "
                    f"{rollouts} rollouts); a run id trains once: start this one with "
                    "another run_id"
                )
        checkpoints = self.run_dir(config.run_id, config.run_dir) / "checkpoints"
        steps = sorted(
            int(p.name.removeprefix("step-"))
            for p in await asyncio.to_thread(lambda: list(checkpoints.glob("step-*")))
            if p.name.removeprefix("step-").isdigit()
        )
        if steps and steps[-1] > 0:
            raise config_error(
                f"{checkpoints} already holds checkpoints up to step {steps[-1]} of an earlier "
                "run: start this one with another run_id (or run_dir)"
            )

    def _check_data(self, config: TrainingConfig) -> None:
        rows = self._rows(config.dataset)
        val_rows: list[Any] = []
        if config.validation.every_steps and config.validation.path:
            val_rows = self._rows(DatasetSpec(path=config.validation.path))
        reward = config.rollout.reward
        if reward.function is not None:
            try:
                rewards.resolve(reward)
            except rewards.RewardFunctionError as err:
                raise config_error(str(err)) from err
            if reward.function in rewards.BUILTIN:
                missing = rows_missing(
                    rows,
                    reward.answer_key,
                    f"the reference answer {reward.function} reads",
                    config.dataset.path,
                )
                if missing is not None:
                    raise missing
        for name, value in config.rollout.agent.env_map.items():
            path = task_path(value)
            if path is None:
                continue  # a literal, not a task path
            missing = rows_missing(rows, path, f"env_map {name}", config.dataset.path, value)
            if missing is not None:
                raise missing
            too_large = rows_too_large(rows, name, value, config.dataset.path)
            if too_large is not None:
                raise too_large
        for path, table in ((config.dataset.path, rows), (config.validation.path, val_rows)):
            over = rows_over_budget(table, path or "")
            if over is not None:
                raise over

    def _rows(self, dataset: DatasetSpec) -> list[Any]:
        try:
            return self._tables.get(dataset.path).rows
        except DatasetError as err:
            raise config_error(str(err)) from err

    async def _check_services(self, config: TrainingConfig) -> None:
        agent = config.rollout.agent
        if isinstance(agent, HttpAgentSpec):
            # Any HTTP answer (a 405 to a GET) says the service is up.
            await self._reachable(agent.url, "agent service")
        for server in config.weight_sync.policy_servers:
            await self._reachable(server.launcher_url or server.url, "policy server")
        replicas = GatewayReplicas(config.weight_sync.admin_urls, self._admin_key, self._http)
        try:
            gateway_urls = await replicas.urls()
        except (ConnectionError, WeightSyncError) as err:
            raise unreachable(f"the gateway's replicas cannot be found: {err}") from err
        for gateway_url in gateway_urls:
            url = f"{gateway_url}/admin/state"
            response = await self._reachable(url, "gateway", self._admin_key)
            if response.status_code in (401, 403):
                raise config_error(
                    f"the gateway at {gateway_url} refuses the trainer worker's admin "
                    f"key ({response.status_code}): give both the same DARL_ADMIN_KEY"
                )

    async def _reachable(self, url: str, what: str, key: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            return await self._http.get(url, headers=headers, timeout=10.0)
        except httpx.TransportError as err:
            raise unreachable(f"the {what} at {url} does not answer: {err!r}") from err

    @activity.defn(name=INITIALIZE_POLICY)
    @heartbeats_throughout(HEARTBEAT_SECONDS)
    async def initialize_policy(self, request: InitializeRequest) -> TrainStepResult:
        """Step 0 from the initial model (a run whose checkpoints went further was refused by
        check_run; a retry after a crash finds step 0 saved)."""
        backend = self._backend(request.run_id, request.run_dir, request.backend)
        model_dir = Path(request.backend.model_dir)
        if not await asyncio.to_thread(model_dir.is_dir):
            raise config_error(f"model_dir {model_dir} is not a model directory")
        info = await asyncio.to_thread(backend.initialize)
        return TrainStepResult(
            step=info.step, policy_path=str(backend.policy_path(info.step)), metrics={}, seconds=0
        )

    @activity.defn(name=TRAIN_STEP)
    @heartbeats_throughout(HEARTBEAT_SECONDS)
    async def train_step(self, request: TrainStepRequest) -> TrainStepResult:
        """Idempotent per step (rule 5): a step already checkpointed is returned as it was;
        after a crash the retry trains from the last checkpoint. Heartbeats throughout."""
        backend = self._backend(request.run_id, request.run_dir, request.backend)

        def train() -> TrainStepResult:
            with self._train_lock:
                backend.initialize()
                settings = AggregationSettings(
                    **request.aggregation.model_dump(), pad_token_id=backend.pad_token_id
                )
                batch, counters = aggregate(self._samples(request), settings)
                done = backend.train_step(
                    request.step, batch, StepOverrides(lr=request.learning_rate)
                )
            aggregated = {f"aggregation/{k}": float(v) for k, v in counters.as_dict().items()}
            return TrainStepResult(
                step=done.step,
                policy_path=str(backend.policy_path(done.step)),
                metrics={**done.metrics, **aggregated},
                seconds=done.seconds,
            )

        try:
            return await asyncio.to_thread(train)
        except (ValueError, TrainerBackendError) as err:
            # A batch no step can use, a step out of order: retrying cannot fix either.
            raise config_error(f"step {request.step}: {err}") from err
        except KeyError as err:
            # A member's calls are not in the store as its rollout committed them: lost.
            raise ApplicationError(
                f"step {request.step}: {err.args[0]}", type=TRAJECTORY_LOST, non_retryable=True
            ) from err

    def _samples(self, request: TrainStepRequest) -> list[RolloutSample]:
        samples = []
        for group in request.groups:
            for member in group.members:
                records = self._store.read_sync(
                    member.rollout_id, attempt=member.attempt, call_ids=member.call_ids
                )
                if member.call_ids is None:
                    records = committed_calls(
                        records, member.rollout_id, member.calls, member.digest
                    )
                samples.append(
                    RolloutSample(
                        rollout_id=member.rollout_id,
                        group_id=group.group_id,
                        reward=member.reward,
                        records=records,
                        masked_calls=member.masked_calls,
                    )
                )
        return samples

    @activity.defn(name=SYNC_WEIGHTS)
    @heartbeats_throughout(HEARTBEAT_SECONDS)
    async def sync_weights(self, request: SyncRequest) -> SyncResult:
        settings = request.weight_sync
        gateway = GatewayReplicas(settings.admin_urls, self._admin_key, self._http)
        servers = [policy_server_control(spec, self._http) for spec in settings.policy_servers]
        try:
            outcome = await sync_weights(
                gateway,
                servers,
                request.policy_path,
                request.policy_version,
                settings.inflight,
                settings.drain_timeout_seconds,
                pause_mode=settings.pause_mode,
                register_upstreams=settings.register_upstreams,
            )
        except WeightSyncError as err:
            raise ApplicationError(str(err), type=WEIGHT_SYNC_ERROR, non_retryable=True) from err
        return SyncResult(paused_seconds=outcome.paused_seconds, drained=outcome.drained)

    @activity.defn(name=RESTORE_WEIGHTS)
    @heartbeats_throughout(HEARTBEAT_SECONDS)
    async def restore_weights(self, request: SyncRequest) -> RestoreResult:
        """Between syncs: load the run's weights again on a policy server that lost them."""
        servers = [
            policy_server_control(spec, self._http) for spec in request.weight_sync.policy_servers
        ]
        try:
            restored = await restore_weights(servers, request.policy_path, request.policy_version)
        except WeightSyncError as err:
            raise ApplicationError(str(err), type=WEIGHT_SYNC_ERROR, non_retryable=True) from err
        return RestoreResult(restored=restored)

    # --- tasks and rollouts ----------------------------------------------------------------

    @activity.defn(name=READ_TASKS)
    @heartbeats_throughout(HEARTBEAT_SECONDS)
    async def read_tasks(self, request: ReadTasksRequest) -> TaskBatch:
        """The next `count` tasks from the cursor, across epoch ends, until `epochs` run out."""
        return await asyncio.to_thread(self._read_tasks, request)

    def _read_tasks(self, request: ReadTasksRequest) -> TaskBatch:
        try:
            table = self._tables.get(request.dataset.path)
        except DatasetError as err:
            raise config_error(str(err)) from err
        dataset = request.dataset
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
        try:
            table = self._tables.get(path)
        except DatasetError as err:
            raise config_error(str(err)) from err
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
            raise config_error("start_rollouts: rows by reference without their dataset")
        try:
            table = self._tables.get(path)
        except DatasetError as err:
            raise config_error(str(err)) from err
        if row.index >= len(table.rows) or table.digest(row.index) != row.digest:
            raise config_error(
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

    @activity.defn(name=CHOOSE_BRANCH_POINT)
    @heartbeats_throughout(HEARTBEAT_SECONDS)
    async def choose_branch_point(self, request: BranchPointRequest) -> BranchPoint:
        """A branching group's branch point under `branch_at: surprisal`, from its seed's
        committed calls in the store (`GroupsSpec.highest_surprisal`); None when it has fewer
        than two, or the store lacks some (no prefix the gateway could replay). Reads only."""
        try:
            records = await self._store.read(
                request.rollout_id, attempt=request.attempt, call_ids=request.call_ids
            )
            if request.call_ids is None:
                records = committed_calls(
                    records, request.rollout_id, request.calls, request.digest
                )
        except KeyError as err:
            log.warning("seed %s cannot branch: %s", request.rollout_id, err)
            return BranchPoint(at=None, surprisal=[])
        figures = [surprisal(record) for record in records]
        if len(figures) < 2:
            return BranchPoint(at=None, surprisal=figures)
        return BranchPoint(at=GroupsSpec.highest_surprisal(figures), surprisal=figures)

    # --- the run's files ---------------------------------------------------------------------

    @activity.defn(name=RECORD_STEP)
    @heartbeats_throughout(HEARTBEAT_SECONDS)
    async def record_step(self, request: RecordStepRequest) -> None:
        run_dir = self.run_dir(request.run_id, request.run_dir)

        def write() -> None:
            run_files.write_step(run_dir, request.record.model_dump())
            run_files.plot_rewards(run_dir, request.run_id)

        await asyncio.to_thread(write)
