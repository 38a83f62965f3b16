"""Reading request bodies: a JSON object within a size limit, or an admin body as a model."""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from darl.gateway import json_codec
from darl.gateway.errors import (
    BadRequestError,
    BodyTooLargeError,
    ClientDisconnectedError,
    InvalidJSONError,
    describe_errors,
)


async def read_json_object(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object, refusing bodies over `limit` bytes (413)."""
    return json_object(await read_body(request, limit))


async def read_body(request: Request, limit: int) -> bytes:
    """The request body's bytes, refusing bodies over `limit` bytes (413)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLargeError(f"request body over {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise BodyTooLargeError(f"request body over {limit} bytes")
    except ClientDisconnect as err:
        # The client's doing, not the server's: a typed error, not a logged traceback.
        raise ClientDisconnectedError(
            f"the client went away after sending {size} bytes of its request"
        ) from err
    return b"".join(chunks)


def json_object(body: bytes) -> dict[str, Any]:
    """`body` read as a JSON object (400 if it is not one)."""
    try:
        value = json_codec.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise InvalidJSONError(f"request body is not valid JSON: {err}") from err
    if not isinstance(value, dict):
        raise InvalidJSONError("request body must be a JSON object")
    return value


Body = TypeVar("Body", bound=BaseModel)


async def read_model(request: Request, model: type[Body], limit: int) -> Body:
    """An admin body: JSON whatever the Content-Type says (curl -d sends a form type); an
    empty body means the model's defaults."""
    sent = await read_body(request, limit)
    data: dict[str, Any] = json_object(sent) if sent.strip() else {}
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise BadRequestError(f"invalid request: {describe_errors(err.errors())}") from err


# The schemas of the bodies routes declare with `documented`, for the app's OpenAPI components.
BODY_SCHEMAS: dict[str, Any] = {}


def documented(*models: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra` declaring its JSON body as one of `models`, for a route that
    reads its body itself (the size limit and the errors' wording are DARL's; the agents' routes
    pass the body through unparsed): the schema shows at `/docs` while FastAPI parses nothing."""
    refs = []
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        BODY_SCHEMAS.update(schema.pop("$defs", {}))
        BODY_SCHEMAS[model.__name__] = schema
        refs.append({"$ref": f"#/components/schemas/{model.__name__}"})
    body = refs[0] if len(refs) == 1 else {"oneOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}}}


def with_body_schemas(app: FastAPI) -> None:
    """Add the `documented` bodies' schemas to the app's OpenAPI components."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        schema = generate()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, body in BODY_SCHEMAS.items():
            components.setdefault(name, body)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
