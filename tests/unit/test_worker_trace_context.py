"""A rollout worker that exports no spans makes none where a span would only be dropped, and
still hands the rollout's trace context on: its activities run in the context their workflow
sent (`drops_spans`), and its HTTP requests (the agent service's POST, the gateway's admin
calls; `RolloutWorkerSettings.traced=False`, which `darl worker` sets where nothing
exports) carry the current context as it is. A real
aiohttp server on loopback keeps the headers it got; a real SDK tracer provider, sampling as
`configure_tracing`'s does where nothing exports, makes the activity's spans."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from opentelemetry import context, propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from temporalio.converter import PayloadConverter
from temporalio.testing import ActivityEnvironment
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput
from typer.testing import CliRunner

import darl.activities.worker as worker_module
from darl.activities.http import http_session
from darl.activities.rollout_activities import current_traceparent
from darl.activities.runners.http import HttpAgentRunner
from darl.activities.worker import RolloutWorkerSettings
from darl.deploy import telemetry
from darl.deploy.cli import app, components
from darl.deploy.temporal_tracing import TRACE_HEADER, DarlTracingInterceptor

ACTIVITY = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture(autouse=True)
def provider(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process's provider as configure_tracing makes it where nothing exports (a span
    of its own would show as a new span id in what is handed on)."""
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", TracerProvider(sampler=ParentBased(ALWAYS_OFF)))


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, list[dict[str, str]]]]:
    """Its URL and the headers of every request it got."""
    seen: list[dict[str, str]] = []

    async def keep(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/", keep)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/", seen
    finally:
        await runner.cleanup()


async def post_in(carrier: dict[str, str], url: str, traced: bool) -> None:
    token = context.attach(propagate.extract(carrier))
    try:
        async with (
            http_session(4, 1.0, traced=traced) as session,
            session.post(url, json={}) as response,
        ):
            assert response.status == 200
    finally:
        context.detach(token)


async def test_an_untraced_request_carries_the_current_trace_context_as_it_is(
    server: tuple[str, list[dict[str, str]]],
) -> None:
    url, seen = server
    carrier = {"traceparent": ACTIVITY, "tracestate": "vendor=opaque", "baggage": "user=7"}
    await post_in(carrier, url, traced=False)
    assert len(seen) == 1
    assert seen[0]["traceparent"] == ACTIVITY
    assert seen[0]["tracestate"] == "vendor=opaque"
    assert seen[0]["baggage"] == "user=7"


async def test_a_traced_request_carries_a_span_of_its_own(
    server: tuple[str, list[dict[str, str]]],
) -> None:
    url, seen = server
    await post_in({"traceparent": ACTIVITY}, url, traced=True)
    _, trace_id, span_id, _ = seen[0]["traceparent"].split("-")
    _, parent_trace_id, parent_span_id, _ = ACTIVITY.split("-")
    assert trace_id == parent_trace_id
    assert span_id != parent_span_id


async def test_an_untraced_request_with_no_trace_context_sends_none(
    server: tuple[str, list[dict[str, str]]],
) -> None:
    url, seen = server
    await post_in({}, url, traced=False)
    assert len(seen) == 1
    assert "traceparent" not in seen[0]
    assert "baggage" not in seen[0]


async def test_the_agent_runners_own_pool_is_traced_as_told(
    server: tuple[str, list[dict[str, str]]],
) -> None:
    url, seen = server
    untraced, traced = HttpAgentRunner(traced=False), HttpAgentRunner()
    token = context.attach(propagate.extract({"traceparent": ACTIVITY}))
    try:
        async with untraced.session.post(url, json={}) as response:
            assert response.status == 200
        assert traced.session.trace_configs
        assert not untraced.session.trace_configs
    finally:
        context.detach(token)
        await untraced.aclose()
        await traced.aclose()
    assert [got["traceparent"] for got in seen] == [ACTIVITY]


class HandsOn(ActivityInboundInterceptor):
    """The activity: what it would hand its agent as TRACEPARENT."""

    def __init__(self) -> None:
        pass

    async def execute_activity(self, input: ExecuteActivityInput) -> str | None:
        return current_traceparent()


async def traceparent_in_activity(monkeypatch: pytest.MonkeyPatch, drops: bool) -> str | None:
    monkeypatch.setattr(telemetry, "_installed_exports", not drops)
    header = PayloadConverter.default.to_payloads([{"traceparent": ACTIVITY}])[0]
    chain = DarlTracingInterceptor().intercept_activity(HandsOn())
    run = ExecuteActivityInput(fn=HandsOn, args=[], executor=None, headers={TRACE_HEADER: header})
    return await ActivityEnvironment().run(chain.execute_activity, run)


async def test_where_spans_are_dropped_an_activity_hands_on_its_workflows_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert await traceparent_in_activity(monkeypatch, drops=True) == ACTIVITY


async def test_where_spans_export_an_activity_hands_on_a_span_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    handed = await traceparent_in_activity(monkeypatch, drops=False)
    assert handed is not None
    _, trace_id, span_id, _ = handed.split("-")
    _, parent_trace_id, parent_span_id, _ = ACTIVITY.split("-")
    assert trace_id == parent_trace_id
    assert span_id != parent_span_id


@pytest.mark.parametrize(("exporter", "traced"), [("none", False), ("console", True)])
def test_darl_worker_traces_its_requests_only_where_it_exports(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, exporter: str, traced: bool
) -> None:
    settings: list[RolloutWorkerSettings] = []
    monkeypatch.setattr(worker_module, "build_worker", lambda client, made: settings.append(made))
    monkeypatch.setattr(components, "run_worker", lambda build, *args: build(None, None))
    monkeypatch.setattr(components, "configure_tracing", lambda name: None)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", exporter)
    monkeypatch.setenv("DARL_TOKEN_SECRET", "secret")
    monkeypatch.setenv("DARL_ADMIN_KEY", "admin")
    result = CliRunner().invoke(app, ["worker", "--agents-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert [made.traced for made in settings] == [traced]
