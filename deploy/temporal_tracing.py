"""Tracing on DARL's Temporal clients and workers: one trace per rollout, whoever started it.

Temporal's replay-safe OpenTelemetry interceptor opens each workflow's span with ids drawn from
the workflow's own deterministic random, so a workflow started without a trace context (the
temporal CLI, a schedule, the Web UI) roots a trace of its own that a replay re-creates instead
of duplicating, and every activity it runs joins it. A rollout is always a trace of its own:
started from inside another trace (the trainer's start_rollouts), it links to that span rather
than growing the run's trace by every call of every rollout."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from typing import Any, NoReturn

from opentelemetry import context, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from temporalio.api.common.v1 import Payload
from temporalio.client import Interceptor as ClientInterceptor
from temporalio.client import OutboundInterceptor, StartWorkflowInput, WorkflowHandle
from temporalio.contrib.opentelemetry import OpenTelemetryInterceptor, ReplaySafeTracerProvider

# The library's workflow-side interceptors, which DARL's subclasses keep from making a trace of
# every untraced query, and from making spans where they would be dropped. Private in
# temporalio 1.35: tests/integration/test_tracing.py runs them.
from temporalio.contrib.opentelemetry._otel_interceptor import (
    _TracingWorkflowInboundInterceptor,
    _TracingWorkflowOutboundInterceptor,
)
from temporalio.converter import PayloadConverter
from temporalio.plugin import SimplePlugin
from temporalio.worker import (
    ActivityInboundInterceptor,
    ContinueAsNewInput,
    ExecuteActivityInput,
    ExecuteWorkflowInput,
    HandleQueryInput,
    HandleSignalInput,
    HandleUpdateInput,
    NexusOperationInboundInterceptor,
    SignalChildWorkflowInput,
    SignalExternalWorkflowInput,
    StartActivityInput,
    StartChildWorkflowInput,
    StartLocalActivityInput,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
    WorkflowOutboundInterceptor,
    WorkflowRunner,
)
from temporalio.worker import Interceptor as WorkerInterceptor
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner
from temporalio.workflow import ActivityHandle, ChildWorkflowHandle

from darl.deploy.telemetry import drops_spans
from darl.workflows.names import ROLLOUT_WORKFLOW

log = logging.getLogger(__name__)

# The Temporal header the OpenTelemetry interceptors carry a trace context in.
TRACE_HEADER = "_tracer-data"
# What the workflow side reads that header with (the library's propagator, whatever
# OTEL_PROPAGATORS says).
_PROPAGATOR = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])


class WorkflowSpans(_TracingWorkflowInboundInterceptor):
    """A workflow's `RunWorkflow` span, its activities' and handlers' spans under it.

    The span ends (is exported) once, when the workflow completes, fails, is cancelled or
    continues as new (the next run's span is its child); a replay, after an eviction or a
    failed workflow task, re-creates it with the same ids and exports nothing twice."""

    _add_temporal_spans = True

    async def handle_query(self, input: HandleQueryInput) -> Any:
        # A query from a client without a trace (the Web UI opening a workflow, a status poll
        # from the temporal CLI) would otherwise be a one-span trace of its own.
        if TRACE_HEADER not in input.headers:
            return await WorkflowInboundInterceptor.handle_query(self, input)
        return await super().handle_query(input)


class WorkflowContext(WorkflowSpans):
    """Where every span is dropped (`drops_spans`), a workflow started with a trace context
    (its starter's) makes no span: it hands the header it was started with on, unread, to every
    activity, local activity and child workflow it starts, every workflow it signals and its
    next run, and runs its handlers without spans. One started without a trace context (from
    the temporal CLI, say) makes its spans as WorkflowSpans does: they give its trace its ids.
    The spans, and reading and writing the header at each step, cost the rollout worker 1.0-1.4
    ms of CPU a rollout (`python -m bench.worker_bench`), for spans no one exports. (DARL's
    workflows start no Nexus operations, nor signal-with-start ones: such a step takes the
    library's way, a span with no parent.)"""

    # The start's trace header, when it carries a trace context; read before the workflow's
    # first activation runs anything (a signal that came with the start runs first).
    header: Payload | None = None

    def init(self, outbound: WorkflowOutboundInterceptor) -> None:
        self.header = _trace_context(outbound.info().headers)
        spans = _TracingWorkflowOutboundInterceptor(outbound, self._add_temporal_spans)
        WorkflowInboundInterceptor.init(self, _HeaderRelay(spans, outbound, self))

    async def execute_workflow(self, input: ExecuteWorkflowInput) -> Any:
        if self.header is None:
            return await super().execute_workflow(input)
        return await WorkflowInboundInterceptor.execute_workflow(self, input)

    async def handle_signal(self, input: HandleSignalInput) -> None:
        if self.header is None:
            return await super().handle_signal(input)
        return await WorkflowInboundInterceptor.handle_signal(self, input)

    async def handle_query(self, input: HandleQueryInput) -> Any:
        if self.header is None:
            return await super().handle_query(input)
        return await WorkflowInboundInterceptor.handle_query(self, input)

    def handle_update_validator(self, input: HandleUpdateInput) -> None:
        if self.header is None:
            return super().handle_update_validator(input)
        return WorkflowInboundInterceptor.handle_update_validator(self, input)

    async def handle_update_handler(self, input: HandleUpdateInput) -> Any:
        if self.header is None:
            return await super().handle_update_handler(input)
        return await WorkflowInboundInterceptor.handle_update_handler(self, input)


def _trace_context(headers: Mapping[str, Payload]) -> Payload | None:
    """The trace header among `headers`, if it carries a valid trace context: a starter with
    no context to send may send an empty one."""
    header = headers.get(TRACE_HEADER)
    if header is None:
        return None
    try:
        carrier = json.loads(header.data)
    except ValueError:
        return None
    if not isinstance(carrier, dict):
        return None
    sent = trace.get_current_span(_PROPAGATOR.extract(carrier)).get_span_context()
    return header if sent.is_valid else None


class _HeaderRelay(WorkflowOutboundInterceptor):
    """A WorkflowContext's steps: with the workflow's header, or through the library's spans
    when it has none."""

    def __init__(
        self,
        spans: WorkflowOutboundInterceptor,
        unread: WorkflowOutboundInterceptor,
        inbound: WorkflowContext,
    ) -> None:
        super().__init__(spans)
        self._unread = unread
        self._inbound = inbound

    def _route(
        self, headers: Mapping[str, Payload]
    ) -> tuple[WorkflowOutboundInterceptor, Mapping[str, Payload]]:
        """Where the step goes next, and the headers it goes with."""
        header = self._inbound.header
        if header is None:
            return self.next, headers
        return self._unread, {**headers, TRACE_HEADER: header}

    def start_activity(self, input: StartActivityInput) -> ActivityHandle[Any]:
        onward, input.headers = self._route(input.headers)
        return onward.start_activity(input)

    def start_local_activity(self, input: StartLocalActivityInput) -> ActivityHandle[Any]:
        onward, input.headers = self._route(input.headers)
        return onward.start_local_activity(input)

    async def start_child_workflow(
        self, input: StartChildWorkflowInput
    ) -> ChildWorkflowHandle[Any, Any]:
        onward, input.headers = self._route(input.headers)
        return await onward.start_child_workflow(input)

    async def signal_child_workflow(self, input: SignalChildWorkflowInput) -> None:
        onward, input.headers = self._route(input.headers)
        await onward.signal_child_workflow(input)

    async def signal_external_workflow(self, input: SignalExternalWorkflowInput) -> None:
        onward, input.headers = self._route(input.headers)
        await onward.signal_external_workflow(input)

    def continue_as_new(self, input: ContinueAsNewInput) -> NoReturn:
        onward, input.headers = self._route(input.headers)
        onward.continue_as_new(input)


class DarlTracingInterceptor(ClientInterceptor, WorkerInterceptor):
    """Temporal's OpenTelemetry interceptor with DARL's workflow spans and rollout starts.

    Workflow spans need the process's tracer provider to be replay-safe (what
    `darl.deploy.telemetry.configure_tracing` installs); under any other provider, or none,
    workers run without them and activities still join a trace their caller sent."""

    def __init__(self) -> None:
        self._library = OpenTelemetryInterceptor(add_temporal_spans=True)
        self._context_only = OpenTelemetryInterceptor(add_temporal_spans=False)

    def intercept_client(self, next: OutboundInterceptor) -> OutboundInterceptor:
        return _RolloutStarts(self._library.intercept_client(next), untraced=next)

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        # Where every span is dropped (`drops_spans`), an activity runs in its caller's trace
        # context without a span of its own: the span cost the rollout worker ~0.23 ms of CPU
        # an activity. What the activity hands on (the agent's TRACEPARENT, its requests)
        # then names the starter's span as parent where the workflow hands its header on
        # (WorkflowContext), else the workflow's StartActivity span, which no one exports.
        library = self._context_only if drops_spans() else self._library
        return library.intercept_activity(_ActivityAttributes(next))

    def intercept_nexus_operation(
        self, next: NexusOperationInboundInterceptor
    ) -> NexusOperationInboundInterceptor:
        return self._library.intercept_nexus_operation(next)

    def workflow_interceptor_class(
        self, input: WorkflowInterceptorClassInput
    ) -> type[WorkflowInboundInterceptor] | None:
        if not isinstance(trace.get_tracer_provider(), ReplaySafeTracerProvider):
            log.warning(
                "the tracer provider is not replay-safe (configure_tracing installs one): "
                "this worker's workflows make no spans"
            )
            return None
        return WorkflowContext if drops_spans() else WorkflowSpans


def darl_attributes(request: object) -> dict[str, str | int]:
    """What an activity's request or a rollout's spec says of where it belongs (run, rollout,
    attempt, step), as span attributes a trace search can use."""
    spec = getattr(request, "spec", None)
    found = {
        "darl.run_id": getattr(request, "run_id", None) or getattr(spec, "run_id", None),
        "darl.rollout_id": getattr(request, "rollout_id", None)
        or getattr(spec, "rollout_id", None),
        "darl.group_id": getattr(request, "group_id", None) or getattr(spec, "group_id", None),
        "darl.attempt": getattr(request, "attempt", None),
        "darl.step": getattr(request, "step", None),
    }
    return {k: v for k, v in found.items() if isinstance(v, str | int) and v != ""}


class _ActivityAttributes(ActivityInboundInterceptor):
    """Labels an activity's span (a train step's, a rollout's launch) with DARL's ids."""

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        span = trace.get_current_span()
        # A span that records nothing (a process that exports no traces) is not labelled:
        # reading the ids off the request costs more than the rest of the span.
        if input.args and span.is_recording():
            span.set_attributes(darl_attributes(input.args[0]))
        return await super().execute_activity(input)


class _RolloutStarts(OutboundInterceptor):
    """Starts each rollout as the root of a trace of its own, linked to the span it was
    started from (the trainer's start_rollouts, a command's span)."""

    def __init__(self, traced: OutboundInterceptor, untraced: OutboundInterceptor) -> None:
        super().__init__(traced)
        self._untraced = untraced

    async def start_workflow(self, input: StartWorkflowInput) -> WorkflowHandle[Any, Any]:
        if input.workflow != ROLLOUT_WORKFLOW or input.start_signal:
            return await super().start_workflow(input)
        starter = trace.get_current_span().get_span_context()
        attributes: dict[str, str | int] = {"temporalWorkflowID": input.id}
        if input.args:
            attributes |= darl_attributes(input.args[0])
        with trace.get_tracer(__name__).start_as_current_span(
            f"StartWorkflow:{input.workflow}",
            context=context.Context(),
            kind=SpanKind.CLIENT,
            links=[Link(starter)] if starter.is_valid else [],
            attributes=attributes,
        ):
            carrier: dict[str, str] = {}
            _PROPAGATOR.inject(carrier)
            # No context (no tracer provider installed) sends no header, as the library's
            # interceptor sends none: the rollout's workflow then roots its own trace.
            if carrier:
                input.headers = {
                    **input.headers,
                    TRACE_HEADER: PayloadConverter.default.to_payloads([carrier])[0],
                }
            return await self._untraced.start_workflow(input)


def _with_opentelemetry_passed_through(runner: WorkflowRunner | None) -> WorkflowRunner:
    if runner is None:
        raise ValueError("the DARL tracing plugin needs the worker's workflow runner")
    if isinstance(runner, SandboxedWorkflowRunner):
        # One OpenTelemetry (context, tracer provider) inside and outside the sandbox.
        return dataclasses.replace(
            runner,
            restrictions=runner.restrictions.with_passthrough_modules("opentelemetry"),
        )
    return runner


def tracing_plugin() -> SimplePlugin:
    """For Client.connect: traces every client call and, on workers built from the client,
    every workflow and activity."""
    return SimplePlugin(
        "darl.tracing",
        interceptors=[DarlTracingInterceptor()],
        workflow_runner=_with_opentelemetry_passed_through,
    )
