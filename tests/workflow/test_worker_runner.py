"""The rollout worker's workflow runner: RolloutWorkflow runs outside Temporal's sandbox unless
the worker is told otherwise (`RolloutWorkerSettings.sandboxed`), and runs whole under either,
with DARL's client (its data converter and tracing plugin) as `darl worker` builds it; the
stored histories replay under both."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio import workflow
from temporalio.client import Client, WorkflowHistory
from temporalio.client import Interceptor as ClientInterceptor
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import (
    ExecuteWorkflowInput,
    Replayer,
    Worker,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
)
from temporalio.worker import Interceptor as WorkerInterceptor

from darl.activities.runners.http import HttpAgentRunner
from darl.activities.worker import RolloutWorkerSettings, build_worker, rollout_workflow_runner
from darl.deploy.temporal_connection import DATA_CONVERTER
from darl.deploy.temporal_tracing import tracing_plugin
from darl.workflows.contracts import rollout_workflow_id
from darl.workflows.rollout_status import RolloutStatus
from darl.workflows.rollout_workflow import RolloutWorkflow
from tests.workflow.collector import CollectorWorkflow
from tests.workflow.test_one_activity_attempt import (
    HISTORIES,
    TIMEOUT,
    FakeStack,
    http_spec,
    serving,
    start,
)
from tests.workflow.test_rollout_workflow import call_event


class RunnerProbe(ClientInterceptor, WorkerInterceptor):
    """Notes, for each workflow a worker built from its client runs, whether it ran in the
    sandbox."""

    def __init__(self) -> None:
        self.in_sandbox: list[bool] = []

    def workflow_interceptor_class(
        self, input: WorkflowInterceptorClassInput
    ) -> type[WorkflowInboundInterceptor]:
        seen = self.in_sandbox

        class Probe(WorkflowInboundInterceptor):
            async def execute_workflow(self, input: ExecuteWorkflowInput) -> Any:
                seen.append(workflow.unsafe.in_sandbox())
                return await super().execute_workflow(input)

        return Probe


@pytest.mark.parametrize(
    ("sandboxed", "expected"), [(None, False), (False, False), (True, True)], ids=str
)
async def test_a_rollout_runs_whole_under_the_runner_the_worker_is_given(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path, sandboxed: bool | None, expected: bool
) -> None:
    """None: the settings' default, what `darl worker` runs."""
    probe = RunnerProbe()
    client = Client(
        time_skipping_env.client.service_client,
        namespace=time_skipping_env.client.namespace,
        data_converter=DATA_CONVERTER,
        plugins=[tracing_plugin()],
        interceptors=[probe],
    )
    queue = f"q-{uuid.uuid4().hex[:8]}"
    settings = RolloutWorkerSettings(
        gateway_url="http://gateway.test",
        token_secret=b"test",
        agents_dir=tmp_path / "agents",
        task_queue=queue,
        admin_key="admin",
    )
    if sandboxed is not None:
        settings = dataclasses.replace(settings, sandboxed=sandboxed)
    s = http_spec()
    stack = FakeStack([call_event(s, "c0", 0)])
    async with (
        serving(stack) as session,
        build_worker(client, settings, session, runners={"http": HttpAgentRunner(session)}),
        Worker(client, task_queue=queue + "-collector", workflows=[CollectorWorkflow]),
    ):
        handle = await start(time_skipping_env, s, queue)
        result = await asyncio.wait_for(handle.result(), TIMEOUT)
    assert result.status == RolloutStatus.SUCCEEDED and result.call_ids == ["c0"]
    assert probe.in_sandbox and set(probe.in_sandbox) == {expected}


# The stored histories and the rollout ids they were recorded with.
RECORDED = {
    "http_rollout_before_patch": "recorded-http",
    "timed_out_rollout_before_patch": "recorded-timeout",
    "http_rollout_revision_2": "recorded-http-2",
}


@pytest.mark.parametrize("sandboxed", [False, True], ids=["unsandboxed", "sandboxed"])
async def test_the_stored_histories_replay_under_either_runner(sandboxed: bool) -> None:
    assert sorted(RECORDED) == sorted(path.stem for path in HISTORIES.glob("*.json"))
    replayer = Replayer(
        workflows=[RolloutWorkflow],
        data_converter=DATA_CONVERTER,
        workflow_runner=rollout_workflow_runner(sandboxed),
    )
    for name, rollout_id in RECORDED.items():
        history = WorkflowHistory.from_json(
            rollout_workflow_id(rollout_id), (HISTORIES / f"{name}.json").read_text()
        )
        result = await replayer.replay_workflow(history)
        assert result.replay_failure is None, name
