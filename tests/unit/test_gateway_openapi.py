"""The gateway's OpenAPI schema (what `/docs` shows) names every route's body and answer: the
model routes read their bodies themselves, yet their request models are declared, and every
reference in the schema resolves."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute

from darl.gateway.app import create_app, unwrap
from darl.gateway.routes import agent
from darl.gateway.state import GatewaySettings
from darl.gateway.store.directory import DirectoryTrajectoryStore
from darl.workflows.rollout_token import TokenClaims, mint_token

SECRET = b"s" * 32


@pytest.fixture
def app(tmp_path: Path) -> FastAPI:
    """The gateway's app, not started: no Temporal, no policy server."""
    settings = GatewaySettings(token_secret=SECRET, admin_key="k", upstreams=("http://x",))
    return unwrap(create_app(settings, DirectoryTrajectoryStore(tmp_path), None))  # type: ignore[arg-type]


@pytest.fixture
def schema(app: FastAPI) -> dict[str, Any]:
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


async def test_docs_page_serves_the_schema(app: FastAPI) -> None:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
        answer = await http.get("/openapi.json")
    assert answer.status_code == 200
    assert "MessagesRequest" in answer.json()["components"]["schemas"]


def test_every_path_parameter_is_declared_once(schema: dict[str, Any]) -> None:
    """The model routes read their claims themselves (no dependency declares the rollout id):
    their `openapi_extra` declares it, as FastAPI does for every other route, and only it."""
    for path, operations in schema["paths"].items():
        named = Counter(re.findall(r"{(\w+)}", path))
        for method, operation in operations.items():
            params = operation.get("parameters", [])
            declared = Counter(p["name"] for p in params if p["in"] == "path")
            assert declared == named, (method, path, declared)


HOT = {
    f"/rollouts/{{rollout_id}}/v1/{name}"
    for name in ("chat/completions", "completions", "responses", "messages")
}


@pytest.fixture
def routes(app: FastAPI) -> dict[str, APIRoute]:
    return {route.path: route for route in app.routes if isinstance(route, APIRoute)}


def test_the_routes_are_the_apps_own(routes: dict[str, APIRoute]) -> None:
    """Not included routers, which FastAPI serves through layers of its own at each request
    (docs/benchmarks.md)."""
    assert set(routes) >= HOT, "the model routes are not among the app's own routes"


def test_the_model_routes_solve_no_dependency() -> None:
    """Every model call takes these routes: FastAPI's solving of a dependency, or of a path
    parameter, would cost each 15-35 us (docs/benchmarks.md), so they read the token
    themselves."""
    routes = {r.path: r for r in agent.router.routes if isinstance(r, APIRoute) and r.path in HOT}
    assert set(routes) == HOT
    for path, route in routes.items():
        assert route.dependant.dependencies == [], path
        assert route.dependant.path_params == [], path


async def test_the_model_routes_check_the_token(app: FastAPI) -> None:
    """Reading the token themselves, they refuse what the dependency refused: no token, a
    token for another rollout, a rollout id no rollout can have."""
    other = mint_token(SECRET, TokenClaims("other-rollout", 1, "train", 2**40))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
        for path in sorted(HOT):
            url = path.format(rollout_id="r-1")
            missing = await http.post(url, json={})
            assert missing.status_code == 401, (path, missing.text)
            assert "missing rollout token" in missing.text
            elsewhere = await http.post(url, json={}, headers={"Authorization": f"Bearer {other}"})
            assert elsewhere.status_code == 403, (path, elsewhere.text)
            assert "another rollout" in elsewhere.text
            bad_id = await http.post(path.format(rollout_id="no%20such"), json={})
            assert bad_id.status_code == 404, (path, bad_id.text)
