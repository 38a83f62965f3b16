"""Tracing on DARL's Temporal clients and workers: one trace per rollout, whoever started it.

Temporal's replay-safe OpenTelemetry interceptor opens each workflow's span with ids drawn from
the workflow's own deterministic random, so a workflow started without a trace context (the
temporal CLI, a schedule, the Web UI) roots a trace of its own that a replay re-creates instead
of duplicating, and every activity it runs joins it. A rollout is always a trace of its own:
started from inside another trace (the trainer's start_rollouts), it links to that span rather
than growing the run's trace by every call of every rollout."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from opentelemetry import context, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from temporalio.client import Interceptor as ClientInterceptor
from temporalio.client import OutboundInterceptor, StartWorkflowInput, WorkflowHandle
from temporalio.contrib.opentelemetry import OpenTelemetryInterceptor, ReplaySafeTracerProvider

# The library's workflow-side interceptor, which DARL's subclass keeps from making a trace of
# every untraced query. Private in temporalio 1.35: tests/integration/test_tracing.py runs it.
from temporalio.contrib.opentelemetry._otel_interceptor import (
    _TracingWorkflowInboundInterceptor,
)
from temporalio.converter import PayloadConverter
from temporalio.plugin import SimplePlugin
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
    HandleQueryInput,
    NexusOperationInboundInterceptor,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
    WorkflowRunner,
)
from temporalio.worker import Interceptor as WorkerInterceptor
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner

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
        # then names the workflow's StartActivity span as parent, a span no one exports
        # either way.
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
        return WorkflowSpans


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
