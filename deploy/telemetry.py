"""OpenTelemetry for every DARL process, configured by the standard variables.

A tracer provider is always installed, so trace context (and an agent's TRACEPARENT) exists
even when nothing is exported. Exporting follows OTEL_TRACES_EXPORTER (`otlp`, `console`,
`none`; default `none`, or `otlp` when OTEL_EXPORTER_OTLP_ENDPOINT is set); the OTLP exporter
reads its own OTEL_EXPORTER_OTLP_* variables. OTEL_SERVICE_NAME overrides the service name.
A process that exports nothing records no spans of its own (they would be dropped): its
sampler is `parentbased_always_off`, so its spans exist for their context only (ids to
propagate, at a fraction of a recorded span's cost: a fifth of the gateway's CPU per call)
and record only under a caller that sampled its own. OTEL_TRACES_SAMPLER, when set, decides.
The provider is Temporal's replay-safe one: workflow spans get ids from the workflow's own
deterministic random and are not exported again when a worker replays a workflow.
"""

from __future__ import annotations

import os

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, Sampler
from temporalio.contrib.opentelemetry import ReplaySafeTracerProvider, create_tracer_provider

from darl.deploy.errors import DeployError


class TelemetryConfigError(DeployError, ValueError):
    """An OTEL_TRACES_EXPORTER that names no exporter DARL has."""


def _exporter_names() -> list[str]:
    default = "otlp" if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") else "none"
    names = [n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", default).split(",")]
    return [name for name in names if name not in ("", "none")]


# Whether the provider `configure_tracing` installed in this process exports; None until it
# has run (a provider installed otherwise, a test's say, is taken to export).
_installed_exports: bool | None = None


def drops_spans() -> bool:
    """Whether every span this process makes is dropped: `configure_tracing` installed its
    provider with no exporter. Such a span is worth its context (the ids it hands on), not
    its cost."""
    return _installed_exports is False


def exports_traces() -> bool:
    """Whether this process's spans go anywhere: an exporter is named and the SDK is on."""
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    return bool(_exporter_names())


def _exporters() -> list[SpanExporter]:
    exporters: list[SpanExporter] = []
    for name in _exporter_names():
        if name == "console":
            exporters.append(ConsoleSpanExporter())
        elif name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter())
        else:
            raise TelemetryConfigError(
                f"OTEL_TRACES_EXPORTER={name!r} is not supported (otlp, console, none)"
            )
    return exporters


def configure_tracing(service_name: str) -> ReplaySafeTracerProvider | None:
    """Install the process's tracer provider; None when OTEL_SDK_DISABLED=true."""
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    exporters = _exporters()
    sampler: Sampler | None = None  # the SDK's default, or OTEL_TRACES_SAMPLER's
    if not exporters and not os.environ.get("OTEL_TRACES_SAMPLER"):
        sampler = ParentBased(ALWAYS_OFF)
    provider = create_tracer_provider(sampler=sampler, resource=resource)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    if trace.get_tracer_provider() is provider:  # OpenTelemetry keeps the first one set
        global _installed_exports
        _installed_exports = bool(exporters)
    return provider


def flush_tracing(timeout_seconds: float = 5.0) -> None:
    """Export the spans still queued. Components leave with os._exit (see
    deploy/cli/support.py), which skips the provider's own shutdown: without this a stopping
    gateway drops its last spans."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, ReplaySafeTracerProvider):
        provider.force_flush(timeout_millis=int(timeout_seconds * 1000))
