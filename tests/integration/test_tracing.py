"""One trace covers a rollout: the workflow, its activities, the agent's call through the
gateway (joined by the trace context the rollout token carries, since the example agent sends
no traceparent), the gateway's call to the policy server, and the signal back into Temporal.

All DARL components run in this process so one in-memory exporter sees every span; the agent
is a real subprocess using the official OpenAI SDK."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from temporalio.testing import WorkflowEnvironment

from darl.activities.worker import RolloutWorkerSettings, build_worker
from darl.deploy.temporal_connection import TemporalSettings, connect
from darl.gateway.app import GatewaySettings, create_app
from darl.gateway.store import DirectoryTrajectoryStore
from darl.serving.policy_app import create_policy_app
from darl.serving.policy_server import PolicyServer
from darl.serving.tiny_model import create_model_dir
from darl.workflows.contracts import (
    LocalAgentSpec,
    RewardSpec,
    RolloutSpec,
    RolloutTimeouts,
    rollout_workflow_id,
)
from darl.workflows.rollout_status import RolloutStatus
from darl.workflows.rollout_workflow import RolloutWorkflow
from tests.serving import served


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    trace.set_tracer_provider(provider)
    if trace.get_tracer_provider() is not provider:
        pytest.skip("another tracer provider was installed first in this process")
    return spans


async def test_one_trace_covers_the_rollout(
    dev_env: WorkflowEnvironment, exporter: InMemorySpanExporter, tmp_path: Path
) -> None:
    client = await connect(
        TemporalSettings(address=dev_env.client.service_client.config.target_host)
    )
    policy = PolicyServer(create_model_dir(tmp_path / "model"))
    policy.engine.start()
    settings_secret = b"trace-secret"
    queue = f"trace-{uuid.uuid4().hex[:8]}"
    try:
        async with served(create_policy_app(policy), tmp_path, "policy") as policy_url:
            gateway_app = create_app(
                GatewaySettings(
                    token_secret=settings_secret, admin_key="admin", upstreams=(policy_url,)
                ),
                DirectoryTrajectoryStore(tmp_path / "store"),
                client,
            )
            async with served(gateway_app, tmp_path, "gateway") as gateway_url:
                worker_settings = RolloutWorkerSettings(
                    gateway_url=gateway_url,
                    token_secret=settings_secret,
                    agents_dir=tmp_path / "agents",
                    admin_key="admin",
                    task_queue=queue,
                )
                async with httpx.AsyncClient() as http, build_worker(client, worker_settings, http):
                    spec = RolloutSpec(
                        run_id="trace",
                        rollout_id=f"trace-{uuid.uuid4().hex[:8]}",
                        task={"question": "What is 1 + 1?", "answer": "2"},
                        agent=LocalAgentSpec(
                            command=["{python}", "-m", "darl.examples.arithmetic.agent"]
                        ),
                        reward=RewardSpec(function="numeric_match"),
                        timeouts=RolloutTimeouts(agent_seconds=120),
                    )
                    result = await client.execute_workflow(
                        RolloutWorkflow.run,
                        spec,
                        id=rollout_workflow_id(spec.rollout_id),
                        task_queue=queue,
                        execution_timeout=None,
                    )
    finally:
        await asyncio.to_thread(policy.engine.stop)
    assert result.status == RolloutStatus.SUCCEEDED, result.error

    spans = exporter.get_finished_spans()
    root = next(s for s in spans if s.name == "StartWorkflow:RolloutWorkflow")
    in_trace = [s for s in spans if s.context.trace_id == root.context.trace_id]
    names = {s.name for s in in_trace}
    assert {
        "RunWorkflow:RolloutWorkflow",
        "RunActivity:launch_agent",
        "RunActivity:await_agent",
        "RunActivity:compute_reward",
        "POST /rollouts/{rollout_id}/v1/chat/completions",  # the gateway's server span
        "POST /v1/chat/completions",  # the policy server's server span
        "SignalWorkflow:model_calls",  # the gateway delivering the call's event
        "POST /admin/rollouts/{rollout_id}/attempts/{attempt}/close",  # the worker closing
    } <= names, sorted(names)
    upstream_calls = [
        s
        for s in in_trace
        if s.kind == trace.SpanKind.CLIENT
        and s.attributes.get("url.full", s.attributes.get("http.url", "")).startswith(policy_url)
    ]
    assert upstream_calls, "the gateway's httpx call to the policy server is in the trace"
