"""`check_run`: the checks at a run's start that fail it at once, saying why, when it cannot
work (rule 9): a run id that already trained, data that lacks what the reward or the agent
reads, a reward function that does not load, a service that does not answer."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from temporalio import activity
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.exceptions import ApplicationError

from darl.activities import rewards
from darl.activities.agent_contract import (
    TaskPathError,
    TaskValueTooLargeError,
    env_map_values,
    task_field,
    task_path,
)
from darl.activities.errors import service_unreachable, training_config_error
from darl.activities.heartbeats import heartbeats_throughout
from darl.activities.rollout_activities import earlier_executions
from darl.activities.trainer_resources import HEARTBEAT_SECONDS, TrainerResources
from darl.trainer.gateway_replicas import GatewayReplicas
from darl.trainer.policy_control import WeightSyncError
from darl.workflows.contracts import HttpAgentSpec, WorkflowAgentSpec, task_over_budget
from darl.workflows.names import CHECK_RUN, ROLLOUT_WORKFLOW
from darl.workflows.training_config import TrainingConfig


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
    return training_config_error(
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
    return training_config_error(
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
    return training_config_error(
        f"dataset {dataset}: {len(over)} of {len(rows)} rows are too large to be a task; the "
        f"first is row {first}: {why}"
    )


def _check_env_map(rows: list[Any], env_map: dict[str, str], dataset: str) -> None:
    """Raise a config error unless every row has each value the agent's `env_map` reads, and
    each fits in an environment variable."""
    for name, value in env_map.items():
        path = task_path(value)
        if path is None:
            continue  # a literal, not a task path
        missing = rows_missing(rows, path, f"env_map {name}", dataset, value)
        if missing is not None:
            raise missing
        too_large = rows_too_large(rows, name, value, dataset)
        if too_large is not None:
            raise too_large


class RunCheckActivities(TrainerResources):
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
                raise training_config_error(
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
            raise training_config_error(
                f"{checkpoints} already holds checkpoints up to step {steps[-1]} of an earlier "
                "run: start this one with another run_id (or run_dir)"
            )

    def _check_data(self, config: TrainingConfig) -> None:
        rows = self._table(config.dataset.path).rows
        val_rows: list[Any] = []
        if config.validation.every_steps and config.validation.path:
            val_rows = self._table(config.validation.path).rows
        reward = config.rollout.reward
        if reward.function is not None:
            try:
                rewards.resolve(reward)
            except rewards.RewardFunctionError as err:
                raise training_config_error(str(err)) from err
            if reward.function in rewards.BUILTIN:
                missing = rows_missing(
                    rows,
                    reward.answer_key,
                    f"the reference answer {reward.function} reads",
                    config.dataset.path,
                )
                if missing is not None:
                    raise missing
        agent = config.rollout.agent
        if isinstance(agent, WorkflowAgentSpec):
            if agent.input_field is not None:
                missing = rows_missing(
                    rows, agent.input_field, "the agent workflow's input", config.dataset.path
                )
                if missing is not None:
                    raise missing
        else:
            _check_env_map(rows, agent.env_map, config.dataset.path)
        for path, table in ((config.dataset.path, rows), (config.validation.path, val_rows)):
            over = rows_over_budget(table, path or "")
            if over is not None:
                raise over

    async def _check_services(self, config: TrainingConfig) -> None:
        agent = config.rollout.agent
        if isinstance(agent, HttpAgentSpec):
            # Any HTTP answer (a 405 to a GET) says the service is up.
            await self._reachable(agent.url, "agent service")
        if isinstance(agent, WorkflowAgentSpec):
            await self._polled(agent)
        for server in config.weight_sync.policy_servers:
            await self._reachable(server.launcher_url or server.url, "policy server")
        replicas = GatewayReplicas(config.weight_sync.admin_urls, self._admin_key, self._http)
        try:
            gateway_urls = await replicas.urls()
        except (ConnectionError, WeightSyncError) as err:
            raise service_unreachable(f"the gateway's replicas cannot be found: {err}") from err
        for gateway_url in gateway_urls:
            url = f"{gateway_url}/admin/state"
            response = await self._reachable(url, "gateway", self._admin_key)
            if response.status_code in (401, 403):
                raise training_config_error(
                    f"the gateway at {gateway_url} refuses the trainer worker's admin "
                    f"key ({response.status_code}): give both the same DARL_ADMIN_KEY"
                )

    async def _polled(self, agent: WorkflowAgentSpec) -> None:
        """A worker of the user's polls the agent workflow's task queue: without one, every
        rollout would wait out its timeout with nothing saying why."""
        described = await self._client.workflow_service.describe_task_queue(
            DescribeTaskQueueRequest(
                namespace=self._client.namespace,
                task_queue=TaskQueue(name=agent.task_queue),
                task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
            )
        )
        if not described.pollers:
            raise service_unreachable(
                f"no worker polls the task queue {agent.task_queue!r} for the agent workflow "
                f"{agent.workflow!r}: start the agents' worker (with "
                "darl.temporal_agents.DarlPlugin) before the run"
            )

    async def _reachable(self, url: str, what: str, key: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            return await self._http.get(url, headers=headers, timeout=10.0)
        except httpx.TransportError as err:
            raise service_unreachable(f"the {what} at {url} does not answer: {err!r}") from err
