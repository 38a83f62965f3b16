"""One trace covers a rollout: the workflow, its activities, the agent's call through the
gateway (joined by the trace context the rollout token carries, since the example agent sends
no traceparent), the gateway's call to the policy server, and the signal back into Temporal;
whoever started it. A training run's trace holds its steps; its rollouts are traces of their own
linked to it.

The first test runs every DARL component in this process, so one in-memory exporter sees every
span (the agent is a real subprocess using the official OpenAI SDK), and so does the replay
test. The others run the components as real `darl` processes exporting OTLP/HTTP to a receiver
on loopback, and start the workflows with the temporal CLI, which sends no trace context."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtlpSpan
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import BaseModel
from temporalio import activity
from temporalio.client import Client, OutboundInterceptor, StartWorkflowInput, WorkflowHandle
from temporalio.client import Interceptor as ClientInterceptor
from temporalio.contrib.opentelemetry import create_tracer_provider
from temporalio.converter import PayloadConverter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from darl.activities.rollout_activities import current_traceparent
from darl.activities.worker import RolloutWorkerSettings, build_worker
from darl.deploy import telemetry
from darl.deploy.temporal_connection import TemporalSettings, connect
from darl.deploy.temporal_tracing import TRACE_HEADER
from darl.gateway.app import create_app
from darl.gateway.state import GatewaySettings
from darl.gateway.store.directory import DirectoryTrajectoryStore
from darl.serving.policy_app import create_policy_app
from darl.serving.policy_server import PolicyServer
from darl.serving.tiny_model import create_model_dir
from darl.workflows.contracts import (
    LocalAgentSpec,
    RewardSpec,
    RolloutResult,
    RolloutSpec,
    RolloutTimeouts,
    rollout_workflow_id,
)
from darl.workflows.names import ROLLOUT_WORKFLOW, TRAINING_WORKFLOW
from darl.workflows.rollout_status import RolloutStatus
from darl.workflows.rollout_workflow import RolloutWorkflow
from darl.workflows.training_config import training_workflow_id
from darl.workflows.training_messages import TrainingSummary
from tests.conftest import BIN
from tests.integration.otlp_receiver import (
    ReceivedSpan,
    SpanSink,
    in_one_tree,
    otlp_receiver,
    trace_of,
)
from tests.integration.stack import Stack
from tests.integration.traced_workflow import STEP, HandingOnWorkflow, TracedWorkflow
from tests.integration.training_stack import AGENT_SERVICE, training_config
from tests.serving import served

SPAN_KIND_CLIENT = OtlpSpan.SpanKind.SPAN_KIND_CLIENT


# What every rollout's trace holds, whoever started it.
ROLLOUT_SPANS = {
    "RunWorkflow:RolloutWorkflow",
    "RunActivity:launch_agent",
    "RunActivity:await_agent",  # which computes a function reward too
    "POST /rollouts/{rollout_id}/v1/chat/completions",  # the gateway's server span
    "POST /v1/chat/completions",  # the policy server's server span
}


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    spans = InMemorySpanExporter()
    # Replay-safe, as configure_tracing's: workers make workflow spans only under such a one.
    provider = create_tracer_provider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    trace.set_tracer_provider(provider)
    if trace.get_tracer_provider() is not provider:
        pytest.skip("another tracer provider was installed first in this process")
    return spans


async def rollout_in_process(
    dev_env: WorkflowEnvironment, tmp_path: Path, traced_gateway: bool = True
) -> tuple[RolloutResult, str]:
    """One rollout of the arithmetic agent with every component in this process; its result
    and the policy server's URL."""
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
                    token_secret=settings_secret,
                    admin_key="admin",
                    upstreams=(policy_url,),
                    traced=traced_gateway,
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
                async with build_worker(client, worker_settings):
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
    return result, policy_url


def rollout_trace(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    spans = exporter.get_finished_spans()
    root = next(s for s in spans if s.name == "StartWorkflow:RolloutWorkflow")
    return [s for s in spans if s.context.trace_id == root.context.trace_id]


async def test_one_trace_covers_the_rollout(
    dev_env: WorkflowEnvironment, exporter: InMemorySpanExporter, tmp_path: Path
) -> None:
    exporter.clear()
    result, policy_url = await rollout_in_process(dev_env, tmp_path)
    assert result.status == RolloutStatus.SUCCEEDED, result.error

    in_trace = rollout_trace(exporter)
    names = {s.name for s in in_trace}
    assert {
        *ROLLOUT_SPANS,
        # The worker closing; the close answers with the call's event (no signal).
        "POST /admin/rollouts/{rollout_id}/attempts/{attempt}/close",
    } <= names, sorted(names)
    upstream_calls = [
        s
        for s in in_trace
        if s.kind == trace.SpanKind.CLIENT
        and s.attributes.get("url.full", s.attributes.get("http.url", "")).startswith(policy_url)
    ]
    assert upstream_calls, "the gateway's call to the policy server is in the trace"


async def test_a_gateway_that_exports_nothing_hands_the_trace_on(
    dev_env: WorkflowEnvironment, exporter: InMemorySpanExporter, tmp_path: Path
) -> None:
    """A gateway whose spans would go nowhere makes none: the policy server gets the trace
    context the agent's call came with (here its rollout token's, the launch's span), so the
    policy server's span is a child of the launch, and the trace holds no gateway span."""
    exporter.clear()
    result, policy_url = await rollout_in_process(dev_env, tmp_path, traced_gateway=False)
    assert result.status == RolloutStatus.SUCCEEDED, result.error

    in_trace = rollout_trace(exporter)
    names = {s.name for s in in_trace}
    assert "POST /rollouts/{rollout_id}/v1/chat/completions" not in names, sorted(names)
    assert not [
        s
        for s in exporter.get_finished_spans()
        if s.kind == trace.SpanKind.CLIENT
        and s.attributes.get("url.full", s.attributes.get("http.url", "")).startswith(policy_url)
    ], "the gateway made a client span"
    launch = next(s for s in in_trace if s.name == "RunActivity:launch_agent")
    served = [s for s in in_trace if s.name == "POST /v1/chat/completions"]
    assert served, sorted(names)
    assert {s.parent.span_id for s in served if s.parent} == {launch.context.span_id}


# --- every starter: components as real processes exporting OTLP ----------------------------


class TracedStack(Stack):
    """The integration stack, its components exporting their spans to `endpoint`."""

    def __init__(self, root: Path, client: Client, endpoint: str) -> None:
        super().__init__(root, client)
        self.endpoint = endpoint

    def env(self) -> dict[str, str]:
        return {
            **super().env(),
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_TRACES_EXPORTER": "otlp",
            # Export within a moment: the test waits for the spans, not for a 5 s batch.
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }


@pytest.fixture(scope="module")
def traced_stack(
    dev_env: WorkflowEnvironment, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TracedStack, SpanSink]]:
    with otlp_receiver() as (endpoint, sink):
        stack = TracedStack(Path(tmp_path_factory.mktemp("traced")), dev_env.client, endpoint)
        try:
            yield stack.start(), sink
        finally:
            stack.stop()


def complete(spans: list[ReceivedSpan]) -> bool:
    _, orphans = in_one_tree(spans)
    return {s.name for s in spans} >= ROLLOUT_SPANS and not orphans


async def start_with_temporal_cli(
    stack: TracedStack, workflow_type: str, task_queue: str, workflow_id: str, value: BaseModel
) -> None:
    """`temporal workflow start`, as a user without a tracer starts a workflow."""
    cli = await asyncio.create_subprocess_exec(
        str(BIN / "temporal"),
        "workflow",
        "start",
        "--address",
        stack.client.service_client.config.target_host,
        "--type",
        workflow_type,
        "--task-queue",
        task_queue,
        "--workflow-id",
        workflow_id,
        "--input",
        value.model_dump_json(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(cli.communicate(), timeout=60)
    assert cli.returncode == 0, stderr.decode()


async def test_a_rollout_started_by_the_temporal_cli_is_one_trace(
    traced_stack: tuple[TracedStack, SpanSink],
) -> None:
    stack, sink = traced_stack
    spec = RolloutSpec(
        run_id="cli-trace",
        rollout_id=f"cli-trace-{uuid.uuid4().hex[:8]}",
        task={"question": "What is 1 + 1?", "answer": "2"},
        agent=LocalAgentSpec(command=["{python}", "-m", "darl.examples.arithmetic.agent"]),
        reward=RewardSpec(function="numeric_match"),
        timeouts=RolloutTimeouts(agent_seconds=120),
    )
    workflow_id = rollout_workflow_id(spec.rollout_id)
    await start_with_temporal_cli(stack, ROLLOUT_WORKFLOW, stack.task_queue, workflow_id, spec)
    handle = stack.client.get_workflow_handle(workflow_id, result_type=RolloutResult)
    result = await asyncio.wait_for(handle.result(), timeout=180)
    assert result.status == RolloutStatus.SUCCEEDED, result.error

    spans = await asyncio.to_thread(
        sink.wait_for,
        lambda got: complete(trace_of(got, "RunWorkflow:RolloutWorkflow", workflow_id)),
        60,
    )
    in_trace = trace_of(spans, "RunWorkflow:RolloutWorkflow", workflow_id)
    # Every span Temporal made for this workflow is in one trace (before, each activity's span
    # was the root of a trace of its own, and the workflow made none).
    of_workflow = [s for s in spans if s.attributes.get("temporalWorkflowID") == workflow_id]
    assert len({s.trace_id for s in of_workflow}) == 1, sorted(
        (s.trace_id, s.name) for s in of_workflow
    )
    names = {s.name for s in in_trace}
    assert names >= ROLLOUT_SPANS, sorted(names)
    assert {s.trace_id for s in of_workflow} == {in_trace[0].trace_id}
    roots, orphans = in_one_tree(in_trace)
    assert [s.name for s in roots] == ["RunWorkflow:RolloutWorkflow"], [s.name for s in roots]
    assert not orphans, [s.name for s in orphans]
    launch = next(s for s in in_trace if s.name == "RunActivity:launch_agent")
    assert launch.attributes.get("darl.rollout_id") == spec.rollout_id
    upstream_calls = [
        s
        for s in in_trace
        if s.service == "darl-gateway"
        and s.kind == SPAN_KIND_CLIENT
        and str(s.attributes.get("url.full", s.attributes.get("http.url", ""))).startswith(
            stack.policy_url
        )
    ]
    assert upstream_calls, "the gateway's call to the policy server is in the rollout's trace"
    assert {s.service for s in in_trace} >= {
        "darl-rollout-worker",
        "darl-gateway",
        "darl-policy-server",
    }


# --- replay: a worker that caches no workflow replays it at every task ----------------------


@activity.defn(name=STEP)
async def traced_step(which: str) -> str:
    return which


async def test_a_replayed_workflow_makes_each_span_once_in_one_trace(
    dev_env: WorkflowEnvironment, exporter: InMemorySpanExporter
) -> None:
    """Started without a trace context (as the temporal CLI starts), on a worker that evicts
    the workflow after every task: the workflow's span is re-created by each replay with the
    same ids and ends once; no activity's span is made twice; continue-as-new stays in the
    trace."""
    traced = await connect(
        TemporalSettings(address=dev_env.client.service_client.config.target_host)
    )
    queue = f"replay-{uuid.uuid4().hex[:8]}"
    workflow_id = f"traced/{uuid.uuid4().hex[:8]}"
    async with Worker(
        traced,
        task_queue=queue,
        workflows=[TracedWorkflow],
        activities=[traced_step],
        max_cached_workflows=0,
    ):
        # The session's untraced client: no trace context in the start, as from the CLI.
        result = await asyncio.wait_for(
            dev_env.client.execute_workflow(
                TracedWorkflow.run, False, id=workflow_id, task_queue=queue
            ),
            timeout=60,
        )
    assert result == "done"
    spans = [
        s
        for s in exporter.get_finished_spans()
        if (s.attributes or {}).get("temporalWorkflowID") == workflow_id
    ]
    names = sorted(s.name for s in spans)
    assert names == sorted(
        ["RunWorkflow:TracedWorkflow"] * 2
        + [f"StartActivity:{STEP}"] * 4
        + [f"RunActivity:{STEP}"] * 4
    ), names
    assert len({s.context.span_id for s in spans}) == len(spans), "a span exported twice"
    assert len({s.context.trace_id for s in spans}) == 1, "the workflow is one trace"
    roots = [s for s in spans if s.parent is None]
    assert [s.name for s in roots] == ["RunWorkflow:TracedWorkflow"]
    by_id = {s.context.span_id: s for s in spans}
    assert all(s.parent is None or s.parent.span_id in by_id for s in spans)


# What each activity of the next tests handed on, as it would to its agent.
handed_on: list[str | None] = []


@activity.defn(name=STEP)
async def step_handing_on(which: str) -> str:
    handed_on.append(current_traceparent())
    return which


async def run_where_spans_are_dropped(
    dev_env: WorkflowEnvironment,
    monkeypatch: pytest.MonkeyPatch,
    starter: Client,
    workflow: type[TracedWorkflow] | type[HandingOnWorkflow] = TracedWorkflow,
) -> str:
    """`workflow` (TracedWorkflow: two activities, a continue-as-new, two more) on a worker
    whose spans no one would export (`drops_spans`), started by `starter`; its workflow id."""
    traced = await connect(
        TemporalSettings(address=dev_env.client.service_client.config.target_host)
    )
    queue = f"context-{uuid.uuid4().hex[:8]}"
    workflow_id = f"traced/{uuid.uuid4().hex[:8]}"
    handed_on.clear()
    monkeypatch.setattr(telemetry, "_installed_exports", False)
    async with Worker(traced, task_queue=queue, workflows=[workflow], activities=[step_handing_on]):
        if workflow is TracedWorkflow:
            run = starter.execute_workflow(
                TracedWorkflow.run, False, id=workflow_id, task_queue=queue
            )
        else:
            run = starter.execute_workflow(
                HandingOnWorkflow.run, id=workflow_id, task_queue=queue, start_signal="go"
            )
        result = await asyncio.wait_for(run, timeout=60)
    assert result == "done"
    return workflow_id


def traceparent_of(span: ReadableSpan) -> str:
    return f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-01"


async def test_where_spans_are_dropped_a_workflow_hands_on_its_starters_context(
    dev_env: WorkflowEnvironment, exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A workflow started with a trace context makes no span of its own there: its activities,
    and the next run after a continue-as-new, run in the context its starter sent, which an
    exporting starter exports."""
    starter = await connect(
        TemporalSettings(address=dev_env.client.service_client.config.target_host)
    )
    workflow_id = await run_where_spans_are_dropped(dev_env, monkeypatch, starter)
    spans = [
        s
        for s in exporter.get_finished_spans()
        if (s.attributes or {}).get("temporalWorkflowID") == workflow_id
    ]
    [start] = spans  # no workflow span, no activity span
    assert start.name == "StartWorkflow:TracedWorkflow"
    assert handed_on == [traceparent_of(start)] * 4


async def test_where_spans_are_dropped_its_handlers_and_local_activities_make_none_either(
    dev_env: WorkflowEnvironment, exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Signal-with-start, as a trainer's rollouts are not but any starter may: the signal's
    handler runs before the workflow's code, in the start's context already (no span of its
    own), and the local activity gets the starter's context like the activity."""
    traced = await connect(
        TemporalSettings(address=dev_env.client.service_client.config.target_host)
    )
    workflow_id = await run_where_spans_are_dropped(dev_env, monkeypatch, traced, HandingOnWorkflow)
    spans = [
        s
        for s in exporter.get_finished_spans()
        if (s.attributes or {}).get("temporalWorkflowID") == workflow_id
    ]
    [start] = spans  # no workflow, handler or activity span
    assert start.name == "SignalWithStartWorkflow:HandingOnWorkflow"
    assert handed_on == [traceparent_of(start)] * 2


class EmptyTraceHeader(ClientInterceptor):
    """A starter that sends the trace header with no context in it."""

    def intercept_client(self, next: OutboundInterceptor) -> OutboundInterceptor:
        return _SendsAnEmptyHeader(next)


class _SendsAnEmptyHeader(OutboundInterceptor):
    async def start_workflow(self, input: StartWorkflowInput) -> WorkflowHandle[Any, Any]:
        empty = PayloadConverter.default.to_payloads([{}])[0]
        input.headers = {**input.headers, TRACE_HEADER: empty}
        return await super().start_workflow(input)


@pytest.mark.parametrize("header", ["none", "empty"])
async def test_where_spans_are_dropped_a_workflow_started_without_a_trace_still_roots_one(
    dev_env: WorkflowEnvironment,
    exporter: InMemorySpanExporter,
    monkeypatch: pytest.MonkeyPatch,
    header: str,
) -> None:
    """Started without a trace context (as the temporal CLI starts, or with an empty header),
    a workflow makes its spans there too: they give the rollout's trace its ids, and each
    activity runs under its StartActivity span (a sampler set on the worker makes the
    `traceparent` it hands on say "sampled"). The run after its continue-as-new is started
    with that context, and hands it on."""
    starter = dev_env.client
    if header == "empty":
        target = dev_env.client.service_client.config.target_host
        starter = await Client.connect(target, interceptors=[EmptyTraceHeader()])
    workflow_id = await run_where_spans_are_dropped(dev_env, monkeypatch, starter)
    spans = [
        s
        for s in exporter.get_finished_spans()
        if (s.attributes or {}).get("temporalWorkflowID") == workflow_id
    ]
    names = sorted(s.name for s in spans)
    assert names == ["RunWorkflow:TracedWorkflow"] + [f"StartActivity:{STEP}"] * 2, names
    [run] = [s for s in spans if s.name.startswith("RunWorkflow")]
    assert run.parent is None, "the workflow roots its trace"
    starts = sorted(
        (s for s in spans if s.name.startswith("StartActivity")), key=lambda s: s.start_time or 0
    )
    assert handed_on == [traceparent_of(s) for s in starts] + [traceparent_of(run)] * 2


# --- a training run: its steps are its trace, each rollout a trace linked to it -------------


@pytest.fixture(scope="module")
def traced_training_stack(
    dev_env: WorkflowEnvironment, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TracedStack, SpanSink]]:
    with otlp_receiver() as (endpoint, sink):
        root = Path(tmp_path_factory.mktemp("traced-training"))
        stack = TracedStack(root, dev_env.client, endpoint)
        stack.model = "digits"
        try:
            stack.start()
            stack.start_agent_service(AGENT_SERVICE)
            stack.start_trainer_worker("trainer")
            yield stack, sink
        finally:
            stack.stop()


async def test_a_training_run_started_by_the_temporal_cli_traces_its_steps_and_rollouts(
    traced_training_stack: tuple[TracedStack, SpanSink],
) -> None:
    """The run's trace holds its workflow and its steps (train_step among them); each of its
    rollouts is a trace of its own whose root links to the run's start_rollouts span."""
    stack, sink = traced_training_stack
    run_id = f"traced-{uuid.uuid4().hex[:6]}"
    config = training_config(stack, run_id, steps=1)
    workflow_id = training_workflow_id(run_id)
    await start_with_temporal_cli(
        stack, TRAINING_WORKFLOW, stack.trainer_queue, workflow_id, config
    )
    handle = stack.client.get_workflow_handle(workflow_id, result_type=TrainingSummary)
    summary = await asyncio.wait_for(handle.result(), timeout=240)
    assert summary.steps == 1, summary

    def run_trace_done(got: list[ReceivedSpan]) -> bool:
        run = trace_of(got, "RunWorkflow:TrainingWorkflow", workflow_id)
        return "RunActivity:train_step" in {s.name for s in run} and not in_one_tree(run)[1]

    spans = await asyncio.to_thread(sink.wait_for, run_trace_done, 60)
    run = trace_of(spans, "RunWorkflow:TrainingWorkflow", workflow_id)
    roots, orphans = in_one_tree(run)
    assert [s.name for s in roots] == ["RunWorkflow:TrainingWorkflow"], [s.name for s in roots]
    assert not orphans, [s.name for s in orphans]
    steps = [s for s in run if s.name == "RunActivity:train_step"]
    assert [s.attributes.get("darl.step") for s in steps] == [1], steps
    assert steps[0].attributes.get("darl.run_id") == run_id
    starts = {s.span_id for s in run if s.name == "RunActivity:start_rollouts"}
    assert starts, sorted({s.name for s in run})

    # No rollout's span is in the run's trace; each rollout's trace links to a start.
    rollout_roots = [
        s
        for s in spans
        if s.name == "StartWorkflow:RolloutWorkflow" and s.attributes.get("darl.run_id") == run_id
    ]
    assert len(rollout_roots) >= summary.steps * 4, len(rollout_roots)
    for root in rollout_roots:
        assert not root.parent_span_id, "a rollout is the root of its own trace"
        assert [span_id for _, span_id in root.links] and all(
            span_id in starts for _, span_id in root.links
        ), root.links
    assert not any(s.name == "RunWorkflow:RolloutWorkflow" for s in run)
    assert all(s.trace_id != run[0].trace_id for s in rollout_roots)

    # And each rollout's trace is whole: one root, the workflow and the agent's calls in it.
    def rollouts_done(got: list[ReceivedSpan]) -> bool:
        return all(
            "RunWorkflow:RolloutWorkflow" in {s.name for s in one} and not in_one_tree(one)[1]
            for one in ([s for s in got if s.trace_id == r.trace_id] for r in rollout_roots)
        )

    spans = await asyncio.to_thread(sink.wait_for, rollouts_done, 60)
    for root in rollout_roots:
        one = [s for s in spans if s.trace_id == root.trace_id]
        roots, orphans = in_one_tree(one)
        assert roots == [root] and not orphans, sorted(s.name for s in one)
        assert "RunWorkflow:RolloutWorkflow" in {s.name for s in one}
    # The digits agent service speaks the completions API.
    called = [s for s in spans if s.name == "POST /rollouts/{rollout_id}/v1/completions"]
    assert called, "the agents' calls are traced"
    assert {s.trace_id for s in called} <= {r.trace_id for r in rollout_roots}
