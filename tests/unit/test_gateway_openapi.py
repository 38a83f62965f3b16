"""The gateway's OpenAPI schema (what `/docs` shows) names every route's body and answer: the
model routes read their bodies themselves, yet their request models are declared, and every
reference in the schema resolves."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute

from darl.gateway.app import create_app, unwrap
from darl.gateway.state import GatewaySettings
from darl.gateway.store.directory import DirectoryTrajectoryStore


@pytest.fixture
def schema(tmp_path: Path) -> dict[str, Any]:
    settings = GatewaySettings(token_secret=b"s" * 32, admin_key="k", upstreams=("http://x",))
    app = unwrap(create_app(settings, DirectoryTrajectoryStore(tmp_path), None))  # type: ignore[arg-type]
    body: dict[str, Any] = app.openapi()
    return body


def body_of(schema: dict[str, Any], path: str, method: str = "post") -> str:
    content = schema["paths"][path][method]["requestBody"]["content"]["application/json"]
    ref: str = content["schema"]["$ref"]
    return ref.rsplit("/", 1)[1]


def answer_of(schema: dict[str, Any], path: str, method: str) -> str:
    content = schema["paths"][path][method]["responses"]["200"]["content"]["application/json"]
    ref: str = content["schema"]["$ref"]
    return ref.rsplit("/", 1)[1]


def test_model_routes_declare_their_request_models(schema: dict[str, Any]) -> None:
    v1 = "/rollouts/{rollout_id}/v1"
    assert body_of(schema, f"{v1}/chat/completions") == "ChatCompletionRequest"
    assert body_of(schema, f"{v1}/completions") == "CompletionRequest"
    assert body_of(schema, f"{v1}/responses") == "ResponsesRequest"
    assert body_of(schema, f"{v1}/messages") == "MessagesRequest"
    assert body_of(schema, f"{v1}/messages/count_tokens") == "CountTokensRequest"
    assert body_of(schema, "/rollouts/{rollout_id}/result") == "AgentReport"


def test_admin_routes_take_and_answer_models(schema: dict[str, Any]) -> None:
    assert body_of(schema, "/admin/pause") == "PauseRequest"
    assert answer_of(schema, "/admin/pause", "post") == "PauseAnswer"
    assert answer_of(schema, "/admin/state", "get") == "GatewayState"
    close = "/admin/rollouts/{rollout_id}/attempts/{attempt}/close"
    assert body_of(schema, close) == "CloseRequest"
    assert answer_of(schema, close, "post") == "CloseAnswer"
    assert answer_of(schema, "/healthz", "get") == "Health"


def test_every_reference_resolves(schema: dict[str, Any]) -> None:
    refs = set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(schema)))
    assert refs, "the schema references no models"
    assert refs <= set(schema["components"]["schemas"]), refs - set(schema["components"]["schemas"])


async def test_docs_page_serves_the_schema(tmp_path: Path) -> None:
    settings = GatewaySettings(token_secret=b"s" * 32, admin_key="k", upstreams=("http://x",))
    app = unwrap(create_app(settings, DirectoryTrajectoryStore(tmp_path), None))  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
        answer = await http.get("/openapi.json")
    assert answer.status_code == 200
    assert "MessagesRequest" in answer.json()["components"]["schemas"]


def test_every_path_parameter_is_declared(schema: dict[str, Any]) -> None:
    """The model routes read their claims themselves (no dependency declares the rollout id):
    their `openapi_extra` declares it, as FastAPI does for every other route."""
    for path, operations in schema["paths"].items():
        named = set(re.findall(r"{(\w+)}", path))
        for method, operation in operations.items():
            declared = {p["name"] for p in operation.get("parameters", []) if p["in"] == "path"}
            assert declared == named, (method, path, declared)


def test_the_model_routes_solve_no_dependency(tmp_path: Path) -> None:
    """Every model call takes these routes: FastAPI's solving of a dependency would cost each
    ~25 us (docs/benchmarks.md), so they read the token themselves."""
    settings = GatewaySettings(token_secret=b"s" * 32, admin_key="k", upstreams=("http://x",))
    app = unwrap(create_app(settings, DirectoryTrajectoryStore(tmp_path), None))  # type: ignore[arg-type]
    v1 = "/rollouts/{rollout_id}/v1"
    hot = {f"{v1}/chat/completions", f"{v1}/completions", f"{v1}/responses", f"{v1}/messages"}
    routes = {route.path: route for route in app.routes if isinstance(route, APIRoute)}
    assert hot <= set(routes)
    for path in hot:
        assert routes[path].dependant.dependencies == [], path
