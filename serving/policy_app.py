"""The reference policy server's HTTP API, vLLM's shape: `/v1/chat/completions` (with function
tools), `/v1/completions`, `/v1/models`, `/tokenize`, `/detokenize`; `/pause`, `/resume`,
`/is_paused`; `/reload_weights` and `/version`; health and metrics; and an index at `/`. Errors
answer with vLLM 0.32's error body, a prompt over the context in its words."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError

from darl.serving.generation import GenerationRejectedError
from darl.serving.openai_format import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponseShape,
    TokenizeRequest,
)
from darl.serving.policy_server import BadRequestError, GenerationFailedError, PolicyServer
from darl.workflows.errors import one_line
from darl.workflows.training_config import ServerPauseMode

router = APIRouter()


def create_policy_app(server: PolicyServer) -> FastAPI:
    app = FastAPI(title="DARL reference policy server")
    app.state.server = server
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(GenerationRejectedError, _status(400))
    app.add_exception_handler(BadRequestError, _status(400))
    app.add_exception_handler(GenerationFailedError, _status(500))
    app.include_router(router)
    FastAPIInstrumentor.instrument_app(
        app, excluded_urls="health,healthz,metrics", exclude_spans=["receive", "send"]
    )
    return app


def server_of(request: Request) -> PolicyServer:
    server: PolicyServer = request.app.state.server
    return server


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """vLLM 0.32's error body (`ErrorResponse`): `{"error": {message, type, param, code}}`,
    the type its exception class's name and the code the HTTP status."""
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}},
        status_code=status,
    )


async def _invalid(_: Request, exc: Exception) -> JSONResponse:
    errors = exc.errors() if isinstance(exc, RequestValidationError) else [{"msg": str(exc)}]
    return _error(400, f"invalid request: {errors[0]['msg']}")


def _status(status: int) -> Any:
    """An exception handler answering `status` with the exception's message (and the field
    at fault, for a request the engine refused)."""

    async def handler(_: Request, exc: Exception) -> JSONResponse:
        param = exc.param if isinstance(exc, GenerationRejectedError) else None
        return _error(status, str(exc), param)

    return handler


async def parse(request: Request, schema: type[BaseModel]) -> Any:
    try:
        return schema.model_validate(json.loads(await request.body()))
    except ValidationError as err:
        raise BadRequestError(one_line(err.errors(), whole="body")) from err
    except ValueError as err:
        raise BadRequestError(f"body is not valid JSON: {err}") from err


class ReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str
    version: int


@router.post("/v1/chat/completions")
async def chat(request: Request) -> Response:
    server = server_of(request)
    req: ChatRequest = await parse(request, ChatRequest)
    req.check_output_budget(server.engine.max_model_len)
    tools = server.tool_choice(req)
    shape = ResponseShape(
        "chat",
        server.model_name,
        server.tokenizer,
        server.chat_prompt(req.messages, req.tools),
        with_logprobs=req.logprobs,
        with_token_ids=req.return_token_ids,
        tools=tools if tools.parses else None,
    )
    req_max = req.max_completion_tokens or req.max_tokens
    params = req.sampling(
        default_max_tokens=req_max or 64, top_logprobs=req.top_logprobs if req.logprobs else 0
    )
    return await server.generate(
        request,
        shape,
        params,
        req.n,
        req.stream,
        req.include_usage,
        constraint=server.tool_constraint(tools),
    )


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    """vLLM's shape: `{"count", "tokens", "max_model_len", "token_strs"}`."""
    server = server_of(request)
    req: TokenizeRequest = await parse(request, TokenizeRequest)
    tokens = server.tokenize(req)
    return {
        "count": len(tokens),
        "max_model_len": server.engine.max_model_len,
        "tokens": tokens,
        "token_strs": None,
    }


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    """vLLM's shape: `{"prompt"}`, the ids' text as the model's tokenizer decodes them."""
    server = server_of(request)
    req: DetokenizeRequest = await parse(request, DetokenizeRequest)
    vocab = len(server.tokenizer)
    if any(not 0 <= t < vocab for t in req.tokens):
        raise BadRequestError(f"token ids must lie in [0, {vocab})")
    return {"prompt": server.tokenizer.decode(req.tokens)}


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    server = server_of(request)
    req: CompletionRequest = await parse(request, CompletionRequest)
    req.check_output_budget(server.engine.max_model_len)
    shape = ResponseShape(
        "completion",
        server.model_name,
        server.tokenizer,
        server.completion_prompt(req),
        with_logprobs=req.logprobs is not None,
        with_token_ids=req.return_token_ids,
    )
    params = req.sampling(default_max_tokens=16, top_logprobs=req.logprobs or 0)
    return await server.generate(request, shape, params, req.n, req.stream, req.include_usage)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    server = server_of(request)
    return {
        "object": "list",
        "data": [
            {
                "id": server.model_name,
                "object": "model",
                "owned_by": "darl",
                "max_model_len": server.engine.max_model_len,
            }
        ],
    }


@router.post("/pause")
async def pause(
    request: Request, mode: ServerPauseMode = "abort", timeout: float = 600.0
) -> dict[str, Any]:
    """vLLM's meaning: `wait` answers once the requests in flight have finished."""
    server = server_of(request)
    server.engine.pause(mode)
    drained = None
    if mode == "wait":
        drained = await asyncio.to_thread(server.engine.wait_idle, timeout)
    return {"paused": True, "mode": mode, "drained": drained}


@router.post("/resume")
async def resume(request: Request) -> dict[str, Any]:
    server = server_of(request)
    server.engine.resume()
    return {"paused": False}


@router.get("/is_paused")
async def is_paused(request: Request) -> dict[str, Any]:
    server = server_of(request)
    return {"is_paused": server.engine.paused}


@router.post("/reload_weights")
async def reload_weights(request: Request, body: ReloadRequest) -> dict[str, Any]:
    server = server_of(request)
    await server.reload_weights(Path(body.path), body.version)
    return {"policy_version": server.policy_version}


@router.get("/version")
async def version(request: Request) -> dict[str, Any]:
    server = server_of(request)
    return {"policy_version": server.policy_version, "model": server.model_name}


@router.get("/")
async def index(request: Request) -> dict[str, Any]:
    """What a person who opens the server's address finds: what it is and its routes."""
    server = server_of(request)
    return {
        "name": "DARL reference policy server",
        "version": importlib.metadata.version("darl"),
        "model": server.model_name,
        "policy_version": server.policy_version,
        "routes": {
            "chat completions": "/v1/chat/completions",
            "completions": "/v1/completions",
            "models": "/v1/models",
            "tokenize": "/tokenize",
            "detokenize": "/detokenize",
            "policy version": "/version",
            "health": "/healthz",
            "metrics": "/metrics",
        },
        "docs": "/docs",
    }


@router.get("/health")
@router.get("/healthz")
async def health() -> dict[str, Any]:
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    server = server_of(request)
    return Response(generate_latest(server.registry), media_type=CONTENT_TYPE_LATEST)
