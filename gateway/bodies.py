"""Reading request bodies: a JSON object within a size limit, or an admin body as a model."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from darl.gateway.errors import GatewayError, bad_request, describe_errors


async def read_json_object(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object, refusing bodies over `limit` bytes (413)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise GatewayError(413, f"request body over {limit} bytes", code="body_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise GatewayError(413, f"request body over {limit} bytes", code="body_too_large")
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise bad_request(f"request body is not valid JSON: {err}", "invalid_json") from err
    if not isinstance(value, dict):
        raise bad_request("request body must be a JSON object", "invalid_json")
    return value


Body = TypeVar("Body", bound=BaseModel)


async def read_model(request: Request, model: type[Body], limit: int) -> Body:
    """An admin body: JSON whatever the Content-Type says (curl -d sends a form type); an
    empty body means the model's defaults."""
    if not (await request.body()).strip():
        data: dict[str, Any] = {}
    else:
        data = await read_json_object(request, limit)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise bad_request(f"invalid request: {describe_errors(err.errors())}") from err
