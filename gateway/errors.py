"""Gateway errors: each a status code and an OpenAI-style JSON body saying what is wrong."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class GatewayError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.headers = headers or {}


def error_body(message: str, type: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "code": code, "param": None}}


# Anthropic's error types by status (its API's documented set).
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape: `{"type": "error", "error": {"type": ..., "message": ...}}`."""
    default = "api_error" if status >= 500 else "invalid_request_error"
    kind = ANTHROPIC_ERROR_TYPES.get(status, default)
    return {"type": "error", "error": {"type": kind, "message": message}}


def speaks_anthropic(path: str) -> bool:
    """Whether a path is one of the Anthropic Messages API routes (its errors take its shape,
    also those of the token check that runs before the route)."""
    return path.startswith("/rollouts/") and "/v1/messages" in path


def shaped_error(
    path: str, status: int, message: str, type: str, code: str | None, headers: dict[str, str]
) -> JSONResponse:
    body = (
        anthropic_error_body(status, message)
        if speaks_anthropic(path)
        else error_body(message, type, code)
    )
    return JSONResponse(body, status_code=status, headers=headers)


def bad_request(message: str, code: str = "bad_request") -> GatewayError:
    return GatewayError(400, message, code=code)


def unauthorized(message: str) -> GatewayError:
    return GatewayError(
        401,
        message,
        type="authentication_error",
        code="invalid_token",
        headers={"WWW-Authenticate": "Bearer"},
    )


def forbidden(message: str) -> GatewayError:
    return GatewayError(403, message, type="permission_error", code="forbidden")


def describe_errors(errors: Sequence[Any]) -> str:
    """Pydantic's validation errors as one line: `messages: Field required; n: ...`."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in errors)


async def _gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
    return shaped_error(request.url.path, exc.status, exc.message, exc.type, exc.code, exc.headers)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    message = f"invalid request: {describe_errors(errors)}"
    return shaped_error(request.url.path, 400, message, "invalid_request_error", "bad_request", {})


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    status = exc.status_code if isinstance(exc, StarletteHTTPException) else 500
    detail = exc.detail if isinstance(exc, StarletteHTTPException) else "error"
    code = "not_found" if status == 404 else None
    return shaped_error(request.url.path, status, str(detail), "invalid_request_error", code, {})


def install_error_handlers(app: Any) -> None:
    app.add_exception_handler(GatewayError, _gateway_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
