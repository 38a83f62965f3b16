"""The gateway's typed errors: every class is drawn in the module's tree with its status and
code, a code names one failure (a subclass shares its parent's only where it is the same
failure, told apart by status), and an error answers in the caller's protocol."""

from __future__ import annotations

import json
import re

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from darl.gateway import errors
from darl.workflows.errors import DarlError


def api_errors() -> list[type[errors.APIError]]:
    found, todo = [], [errors.APIError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def test_the_docstring_draws_every_error_with_its_status_and_code() -> None:
    drawn = {
        m["name"]: (m["status"], m["code"])
        for m in re.finditer(
            r"[├└]── (?P<name>\w+Error) +(?P<status>\d{3})? +(?P<code>[a-z_]+)",
            errors.__doc__ or "",
        )
    }
    for cls in api_errors():
        status = drawn[cls.__name__][0]
        parent_status = cls.__mro__[1].status if cls is not errors.APIError else None
        # A status is drawn where a class sets its own.
        assert int(status or parent_status or 0) == cls.status, cls
        assert drawn[cls.__name__][1] == cls.code, cls


def test_each_code_names_one_failure() -> None:
    by_code: dict[str, list[type[errors.APIError]]] = {}
    for cls in api_errors():
        by_code.setdefault(cls.code, []).append(cls)
    for code, classes in by_code.items():
        roots = [c for c in classes if not any(issubclass(c, o) and c is not o for o in classes)]
        assert len(roots) == 1, (code, classes)


def test_every_error_is_darls() -> None:
    assert issubclass(errors.GatewayError, DarlError)
    assert all(issubclass(cls, errors.GatewayError) for cls in api_errors())


def test_refusals_that_are_no_failed_call_are_told_by_class() -> None:
    assert isinstance(errors.PauseOutlastedError("held too long"), errors.NOT_FAILURES)
    assert isinstance(errors.RolloutFinishedError("ended"), errors.NOT_FAILURES)
    assert not isinstance(errors.UpstreamError("broken"), errors.NOT_FAILURES)


@pytest.mark.parametrize(
    ("path", "shape"),
    [("/rollouts/r/v1/chat/completions", "openai"), ("/rollouts/r/v1/messages", "anthropic")],
)
def test_an_error_answers_in_the_callers_protocol(path: str, shape: str) -> None:
    app = FastAPI()
    errors.install_error_handlers(app)

    @app.post(path)
    async def refuse() -> None:
        raise errors.GatewayPausedError("paused", headers={"Retry-After": "3"})

    answer = TestClient(app).post(path)
    assert answer.status_code == 429
    assert answer.headers["Retry-After"] == "3"
    body = json.loads(answer.text)
    if shape == "openai":
        assert body["error"] == {
            "message": "paused",
            "type": "rate_limit_error",
            "code": "gateway_paused",
            "param": None,
        }
    else:
        assert body == {"type": "error", "error": {"type": "rate_limit_error", "message": "paused"}}


def test_an_upstream_status_is_carried_through() -> None:
    refused = errors.UpstreamError("the model refused", status=400)
    assert (refused.status, refused.code) == (400, "upstream_error")
    assert errors.UpstreamError("x").status == 502
    assert errors.UnauthorizedError("no").headers == {"WWW-Authenticate": "Bearer"}
