"""The rollout worker: serves RolloutWorkflow and its activities on the `darl-rollouts` queue."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import aiohttp
from temporalio.client import Client
from temporalio.worker import UnsandboxedWorkflowRunner, Worker, WorkflowRunner
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner

from darl.activities.agent_contract import ContractIssuer
from darl.activities.gateway_attempts import GatewayAttempts
from darl.activities.http import http_session
from darl.activities.rollout_activities import RolloutActivities
from darl.activities.runners.base import AgentRunner
from darl.activities.runners.http import HttpAgentRunner
from darl.activities.runners.kubernetes import KubernetesJobRunner
from darl.activities.runners.kubernetes_settings import KubernetesSettings
from darl.activities.runners.local import LocalProcessRunner
from darl.activities.runners.workflow import WorkflowAgentRunner
from darl.activities.trainer_reports import ReportActivities, TrainerReports
from darl.workflows.names import ROLLOUT_TASK_QUEUE
from darl.workflows.rollout_workflow import RolloutWorkflow

log = logging.getLogger(__name__)

# The gateway's admin API: an open and a close per attempt, each a moment long. The gateway
# keeps an idle connection 75 s (deploy/serving.py), longer than this pool does.
ADMIN_CONNECTIONS = 64
ADMIN_KEEP_ALIVE_SECONDS = 30.0


@dataclass(frozen=True)
class RolloutWorkerSettings:
    gateway_url: str
    token_secret: bytes
    agents_dir: Path
    admin_key: str | None = None
    gateway_admin_url: str | None = None
    task_queue: str = ROLLOUT_TASK_QUEUE
    max_concurrent_agents: int = 256
    # Runs `kubernetes` agents as Jobs when set.
    kubernetes: KubernetesSettings | None = None
    # Client spans for the worker's HTTP requests; `darl worker` sets it from whether the
    # process exports traces (an untraced request still carries the rollout's trace context).
    # Its activities' spans follow the installed provider instead (`drops_spans`): the two
    # differ only under OTEL_SDK_DISABLED=true, where every span is a no-op anyway.
    traced: bool = True
    # RolloutWorkflow in Temporal's sandbox, which refuses a non-deterministic call. Off: the
    # sandbox cost this worker 4.3-5.0 ms of CPU a rollout, its workflow side 1.7x
    # (`make bench-worker`, docs/limitations.md). A canary worker can run with it on.
    sandboxed: bool = False


def rollout_workflow_runner(sandboxed: bool) -> WorkflowRunner:
    """The runner the rollout worker runs RolloutWorkflow under: Temporal's sandbox (the
    standard library, temporalio and pydantic passed through, as the SDK does by default; the
    contracts by the workflow module's own `imports_passed_through`), or none."""
    if sandboxed:
        return SandboxedWorkflowRunner()
    return UnsandboxedWorkflowRunner()


@contextlib.asynccontextmanager
async def build_worker(
    client: Client,
    settings: RolloutWorkerSettings,
    admin_session: aiohttp.ClientSession | None = None,
    runners: dict[str, AgentRunner] | None = None,
) -> AsyncIterator[Worker]:
    """The running worker. `admin_session` (borrowed; the worker keeps one of its own without
    it) is for the gateway's admin API, whose calls (opening and closing an attempt) join the
    rollout's trace; agent HTTP services get a pool of their own (an attempt holds its
    connection while its agent runs)."""
    async with contextlib.AsyncExitStack() as resources:
        if admin_session is None:
            admin_session = await resources.enter_async_context(
                http_session(ADMIN_CONNECTIONS, ADMIN_KEEP_ALIVE_SECONDS, settings.traced)
            )
        if runners is None:
            owned = HttpAgentRunner(
                max_attempts=settings.max_concurrent_agents, traced=settings.traced
            )
            resources.push_async_callback(owned.aclose)
            runners = {
                LocalProcessRunner.kind: LocalProcessRunner(settings.agents_dir),
                HttpAgentRunner.kind: owned,
                WorkflowAgentRunner.kind: WorkflowAgentRunner(),
            }
            if settings.kubernetes is not None:
                runners[KubernetesJobRunner.kind] = KubernetesJobRunner(settings.kubernetes)
        gateway = None
        if settings.admin_key:
            gateway = GatewayAttempts(
                settings.gateway_admin_url or settings.gateway_url,
                settings.admin_key,
                admin_session,
            )
        activities = RolloutActivities(
            runners, ContractIssuer(settings.gateway_url, settings.token_secret), client, gateway
        )
        reports = ReportActivities(TrainerReports(client))
        worker = Worker(
            client,
            task_queue=settings.task_queue,
            workflows=[RolloutWorkflow],
            activities=[*activities.activities(), reports.report_rollout],
            max_concurrent_activities=settings.max_concurrent_agents,
            # Out of the sandbox unless asked (`sandboxed`): the workflow's module imports only
            # temporalio and the contracts (docs/architecture.md), and the workflow tests run
            # it in the sandbox, which would catch a non-deterministic call.
            workflow_runner=rollout_workflow_runner(settings.sandboxed),
            # Agents outlive a worker that stops: the next worker re-attaches to them.
            graceful_shutdown_timeout=timedelta(seconds=0),
        )
        async with worker:
            yield worker
