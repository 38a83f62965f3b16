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


async def _gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
    return JSONResponse(
        error_body(exc.message, exc.type, exc.code), status_code=exc.status, headers=exc.headers
    )


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    detail = describe_errors(errors)
    return JSONResponse(
        error_body(f"invalid request: {detail}", "invalid_request_error", "bad_request"),
        status_code=400,
    )


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    status = exc.status_code if isinstance(exc, StarletteHTTPException) else 500
    detail = exc.detail if isinstance(exc, StarletteHTTPException) else "error"
    return JSONResponse(
        error_body(str(detail), "invalid_request_error", "not_found" if status == 404 else None),
        status_code=status,
    )


def install_error_handlers(app: Any) -> None:
    app.add_exception_handler(GatewayError, _gateway_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
