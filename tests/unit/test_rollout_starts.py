"""A rollout starts as the root of a trace of its own: the start sends the trace header its
workflow hands on, and a starter with no trace context to send (no tracer provider installed:
`darl rollout start`, OTEL_SDK_DISABLED=true) sends none, so the workflow roots its own trace
instead of handing on an empty one (`deploy/temporal_tracing.py`)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, cast

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from temporalio.client import OutboundInterceptor, StartWorkflowInput

from darl.deploy.temporal_tracing import TRACE_HEADER, DarlTracingInterceptor
from darl.workflows.names import ROLLOUT_WORKFLOW


class Kept(OutboundInterceptor):
    """The end of the client's chain: keeps what it was asked to start."""

    def __init__(self) -> None:
        self.started: list[StartWorkflowInput] = []

    async def start_workflow(self, input: StartWorkflowInput) -> Any:
        self.started.append(input)


async def started_headers(provider: TracerProvider | None) -> dict[str, Any]:
    kept = Kept()
    chain = DarlTracingInterceptor().intercept_client(kept)
    start = SimpleNamespace(
        workflow=ROLLOUT_WORKFLOW, start_signal=None, args=[], id="rollout/r1", headers={}
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trace, "_TRACER_PROVIDER", provider)
        await chain.start_workflow(cast(StartWorkflowInput, start))
    [sent] = kept.started
    return dict(sent.headers)


async def test_a_rollout_started_with_no_trace_context_sends_no_trace_header() -> None:
    assert TRACE_HEADER not in await started_headers(None)


async def test_a_rollout_started_under_a_tracer_provider_sends_its_start_span() -> None:
    headers = await started_headers(TracerProvider())
    carrier = json.loads(headers[TRACE_HEADER].data)
    assert carrier["traceparent"].startswith("00-")
