"""The gateway's errors: a tree of classes, each with its status and code as class attributes,
answered as a JSON body saying what is wrong (OpenAI's shape, or Anthropic's on its routes).
Code branches on the class (`isinstance`), never on the code string.

    GatewayError                                  (a darl.workflows.errors.DarlError)
    ├── StoreUnavailableError                     the store cannot be used (store/base.py)
    ├── AppendRefusedError                        the store refused a call's record (store/base.py)
    │   ├── AttemptClosedError                    its attempt was closed
    │   ├── CallBudgetSpentError                  its attempt made MAX_CALLS_PER_ATTEMPT calls
    │   ├── AlreadyReplayedError                  its recorded call was reproduced already
    │   └── ReplayOverError                       its attempt holds a live call
    ├── StoreUrlError                             a store URL DARL cannot open (store/url.py)
    ├── CaptureError                              an answer lacks token ids (chat/capture.py)
    └── APIError                            500   server_error
        ├── BadRequestError                 400   bad_request
        │   ├── InvalidJSONError                  invalid_json
        │   ├── UnsupportedError                  unsupported
        │   ├── InvalidReplayError                invalid_replay
        │   ├── InvalidIdempotencyKeyError        invalid_idempotency_key
        │   ├── PreviousResponseNotFoundError     previous_response_not_found
        │   ├── PreviousResponseNotStoredError    previous_response_not_stored
        │   ├── InvalidResultError                invalid_result
        │   ├── InvalidEventError                 invalid_event
        │   ├── TooManyReportsError               too_many_reports
        │   ├── CallsExhaustedError               calls_exhausted
        │   └── ContextLengthExceededError        context_length_exceeded
        ├── UnauthorizedError               401   invalid_token
        ├── ForbiddenError                  403   forbidden
        ├── UnknownRolloutError             404   unknown_rollout
        ├── RolloutFinishedError            409   rollout_finished      (no failed call)
        ├── IdempotencyKeyInFlightError     409   idempotency_key_in_flight
        ├── IdempotencyKeyReusedError       422   idempotency_key_reused
        ├── ClientDisconnectedError         499   client_disconnected   (nobody to answer)
        ├── BodyTooLargeError               413   body_too_large
        │   └── ReportTooLargeError               report_too_large
        ├── GatewayPausedError              429   gateway_paused        (no failed call)
        │   └── PauseOutlastedError         503   gateway_paused
        ├── GatewayRestartingError          503   gateway_restarting
        ├── RolloutSpecUnreadableError      500   rollout_spec_unreadable
        ├── TemporalRefusedError            500   temporal_refused
        ├── TemporalUnavailableError        503   temporal_unavailable
        └── UpstreamError                   502   upstream_error
            ├── UpstreamUnreachableError          upstream_unreachable
            ├── UpstreamTimeoutError        504   upstream_timeout
            ├── UpstreamUnversionedError          upstream_unversioned
            ├── UpstreamVersionUnreadableError    upstream_version_unreadable
            └── UpstreamStaleError          503   upstream_stale
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from darl.workflows.errors import DarlError, one_line


class GatewayError(DarlError):
    """Anything the gateway raises on purpose."""


class APIError(GatewayError):
    """A request refused or failed: answered with `status` and a body in the caller's protocol
    (OpenAI's `{"error": {message, type, param, code}}`, or Anthropic's on its routes). The
    class says which failure it is; `status`, `type` and `code` are its class attributes, and
    an instance may carry another status (an upstream's own 4xx), headers (`Retry-After`) or
    the request field at fault (`param`)."""

    status: int = 500
    type: str = "server_error"
    code: str = "server_error"
    default_headers: ClassVar[dict[str, str]] = {}

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        self.headers = {**self.default_headers, **(headers or {})}
        self.param = param


class BadRequestError(APIError):
    status = 400
    type = "invalid_request_error"
    code = "bad_request"


class InvalidJSONError(BadRequestError):
    code = "invalid_json"


class UnsupportedError(BadRequestError):
    """A feature of the agent's protocol that DARL would otherwise silently drop."""

    code = "unsupported"


class InvalidReplayError(BadRequestError):
    code = "invalid_replay"


class InvalidIdempotencyKeyError(BadRequestError):
    """An `Idempotency-Key` header that is not 1 to 200 visible ASCII characters."""

    code = "invalid_idempotency_key"


class PreviousResponseNotFoundError(BadRequestError):
    code = "previous_response_not_found"


class PreviousResponseNotStoredError(BadRequestError):
    code = "previous_response_not_stored"


class InvalidResultError(BadRequestError):
    code = "invalid_result"


class InvalidEventError(BadRequestError):
    code = "invalid_event"


class TooManyReportsError(BadRequestError):
    """An attempt's report past the most it may send (REPORTS_PER_ATTEMPT)."""

    code = "too_many_reports"


class CallsExhaustedError(BadRequestError):
    """A model call of an attempt that has made MAX_CALLS_PER_ATTEMPT of them: no retry helps
    (OpenAI's and Anthropic's SDKs do not retry a 400)."""

    code = "calls_exhausted"


class ContextLengthExceededError(BadRequestError):
    """The agent's prompt does not fit the policy's context (its policy server said so): the
    agent's own doing, so a failed call but no incident, said in the words each protocol's
    clients recognise (`protocols/overflow.py`)."""

    code = "context_length_exceeded"


class UnauthorizedError(APIError):
    status = 401
    type = "authentication_error"
    code = "invalid_token"
    default_headers = {"WWW-Authenticate": "Bearer"}


class ForbiddenError(APIError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class UnknownRolloutError(APIError):
    status = 404
    type = "invalid_request_error"
    code = "unknown_rollout"


class RolloutFinishedError(APIError):
    """The attempt has ended: its agent is gone and nobody reads more of its record, so the
    refusal is no failed call."""

    status = 409
    type = "invalid_request_error"
    code = "rollout_finished"


class IdempotencyKeyInFlightError(APIError):
    """A call of the attempt with the request's `Idempotency-Key` is still at a policy server
    after the retry waited as long as a call may take (OpenAI's SDKs retry a 409)."""

    status = 409
    type = "invalid_request_error"
    code = "idempotency_key_in_flight"


class IdempotencyKeyReusedError(APIError):
    """An `Idempotency-Key` a call of the attempt was made with, sent with another request: the
    agent never gets another request's answer (no SDK retries a 422)."""

    status = 422
    type = "invalid_request_error"
    code = "idempotency_key_reused"


class ClientDisconnectedError(APIError):
    """The client went away while it sent its request (an agent killed mid-request): nothing
    of the request was used, and the answer reaches nobody (499, as nginx logs it)."""

    status = 499
    type = "invalid_request_error"
    code = "client_disconnected"


class BodyTooLargeError(APIError):
    status = 413
    type = "invalid_request_error"
    code = "body_too_large"


class ReportTooLargeError(BodyTooLargeError):
    """An agent's report over its budget (REPORT_MAX_BYTES)."""

    code = "report_too_large"


class GatewayPausedError(APIError):
    """Paused for a weight sync (flow control: the agent is told when to retry), so the
    refusal is no failed call."""

    status = 429
    type = "rate_limit_error"
    code = "gateway_paused"


class PauseOutlastedError(GatewayPausedError):
    """A call held by a pause for longer than it may wait."""

    status = 503
    type = "server_error"


class GatewayRestartingError(APIError):
    status = 503
    code = "gateway_restarting"


class RolloutSpecUnreadableError(APIError):
    """A rollout's workflow started with an input that does not read as this DARL's spec."""

    code = "rollout_spec_unreadable"


class TemporalRefusedError(APIError):
    """Temporal refused a request for what it holds (INVALID_ARGUMENT: a payload over its
    limits): DARL's own failure, which no retry passes, never "Temporal is away"."""

    code = "temporal_refused"


class TemporalUnavailableError(APIError):
    status = 503
    code = "temporal_unavailable"
    default_headers = {"Retry-After": "1"}


class UpstreamError(APIError):
    """The policy server failed the call (or answered something DARL cannot record)."""

    status = 502
    code = "upstream_error"


class UpstreamUnreachableError(UpstreamError):
    code = "upstream_unreachable"


class UpstreamTimeoutError(UpstreamError):
    status = 504
    code = "upstream_timeout"


class UpstreamUnversionedError(UpstreamError):
    """The policy server does not say which weights it serves at all: a DARL reference
    server or a vLLM in dev mode is needed (a set-up error, not a passing one)."""

    code = "upstream_unversioned"


class UpstreamVersionUnreadableError(UpstreamError):
    """Asking a versioned policy server which weights it serves failed this time."""

    code = "upstream_version_unreadable"


class UpstreamStaleError(UpstreamError):
    """The policy server serves weights behind the run's and did not catch up in time."""

    status = 503
    code = "upstream_stale"
    default_headers = {"Retry-After": "5"}


# Refusals that are no failed call of the attempt.
NOT_FAILURES = (RolloutFinishedError, GatewayPausedError)


def error_body(
    message: str, type: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


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
    path: str,
    status: int,
    message: str,
    type: str,
    code: str | None,
    headers: dict[str, str],
    param: str | None = None,
) -> JSONResponse:
    body = (
        anthropic_error_body(status, message)
        if speaks_anthropic(path)
        else error_body(message, type, code, param)
    )
    return JSONResponse(body, status_code=status, headers=headers)


def describe_errors(errors: Sequence[Any]) -> str:
    """Pydantic's validation errors as one line: `messages: Field required; n: ...`."""
    return one_line(errors, whole="body")


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return shaped_error(
        request.url.path, exc.status, exc.message, exc.type, exc.code, exc.headers, exc.param
    )


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
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
