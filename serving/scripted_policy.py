"""A scripted policy server: a stand-in for a model that can solve coding tasks (none runs on
a CPU here). It answers OpenAI chat completions, in vLLM's shape as DARL's gateway needs it,
with the tool calls a scripts file lists for each task, so a test drives a real agent harness
through a known fix, a wrong one or a reward hack.

    python -m darl.serving.scripted_policy --scripts FILE [--port 0] [--ready-file F]

The scripts file is JSON: `{"scripts": [{"name", "match", "calls": [{"tool", "arguments",
"content"?}, ...]}]}`. A request belongs to the script whose `match` text appears in its
messages (the longest such match); its n-th answer is the script's n-th call, n counted from
the assistant turns already in the messages, so the server keeps no state and a retried or
replayed call gets the same answer. Token ids are the UTF-8 bytes of a ChatML rendering (the
chat special tokens as ids 256 and up): one id per byte, as DARL's tiny tokenizer has one
per character, so a rollout's records in the store are the size of a real run's. Each
answer's logprobs are 0: the script is certain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from darl.files import write_ready_file
from darl.serving.errors import ServingError

# The version the server says its (scripted) weights are, as DARL's policy servers prove it.
VERSION_HEADER = "x-darl-policy-version"
SPECIAL_TOKENS = {"<|im_start|>": 256, "<|im_end|>": 257, "<|endoftext|>": 258}
_SPECIAL = re.compile("|".join(re.escape(token) for token in SPECIAL_TOKENS))
IM_END = SPECIAL_TOKENS["<|im_end|>"]


class ScriptError(ServingError, ValueError):
    """A scripts file that cannot be read, or a request no script can answer."""


class ScriptedCall(BaseModel):
    """One answer: a call of the tool the agent offered under `tool`, with `arguments`."""

    model_config = ConfigDict(extra="forbid")
    tool: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    content: str = ""


class Script(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    match: str = Field(min_length=1)
    calls: list[ScriptedCall] = Field(min_length=1)


class ScriptBook(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scripts: list[Script]

    @classmethod
    def read(cls, path: Path) -> ScriptBook:
        try:
            return cls.model_validate_json(path.read_text())
        except (OSError, ValidationError) as err:
            raise ScriptError(f"cannot read the scripts file {path}: {err}") from err

    def script_for(self, text: str) -> Script:
        """The script whose `match` appears in `text`, the longest if several do."""
        found = sorted((s for s in self.scripts if s.match in text), key=lambda s: -len(s.match))
        if not found:
            names = ", ".join(s.name for s in self.scripts[:10])
            raise ScriptError(
                f"no script matches this request (scripts: {names}); its messages begin "
                f"{text[:200]!r}"
            )
        if len(found) > 1 and len(found[1].match) == len(found[0].match):
            raise ScriptError(f"scripts {found[0].name!r} and {found[1].name!r} both match")
        return found[0]


class ContextOverflowError(ScriptError):
    """A prompt longer than the context the server says it has (`--max-model-len`)."""


class ChatRequest(BaseModel):
    """The fields of an OpenAI chat request this server reads; the rest are ignored."""

    model_config = ConfigDict(extra="ignore")
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    stream: bool = False
    n: int = 1


class TokenizeRequest(BaseModel):
    """vLLM's `/tokenize` of a chat (the gateway measures a refused prompt with it)."""

    model_config = ConfigDict(extra="ignore")
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None


def message_text(content: Any) -> str:
    """OpenAI message content (a string, None, or text parts) as text."""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def token_ids(text: str) -> list[int]:
    """One id per UTF-8 byte; the chat special tokens are one id each."""
    ids: list[int] = []
    start = 0
    for special in _SPECIAL.finditer(text):
        ids.extend(text[start : special.start()].encode("utf-8"))
        ids.append(SPECIAL_TOKENS[special.group()])
        start = special.end()
    ids.extend(text[start:].encode("utf-8"))
    return ids


def render_call(name: str, arguments: str) -> str:
    """A tool call as Hermes / Qwen2.5 write it (DARL's tiny chat template does the same)."""
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n</tool_call>'


def render_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """ChatML, with the tools' signatures in the system block: the next prompt of an episode
    begins with this one plus its answer, as a real template's does."""
    parts = []
    if tools:
        system = ""
        if messages[0].get("role") == "system":
            system = message_text(messages[0].get("content")) + "\n\n"
            messages = messages[1:]
        signatures = "\n".join(json.dumps(tool) for tool in tools)
        parts.append(
            f"<|im_start|>system\n{system}# Tools\n<tools>\n{signatures}\n</tools><|im_end|>\n"
        )
    for message in messages:
        role, text = message.get("role", "user"), message_text(message.get("content"))
        if role == "tool":
            parts.append(f"<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n")
            continue
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            arguments = function.get("arguments", "{}")
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments)
            text += render_call(str(function.get("name", "")), arguments)
        parts.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def logprob_entry(token_id: int) -> dict[str, Any]:
    """A chat logprob entry: the script is certain of its answer (logprob 0)."""
    if token_id >= 256:
        token = next(name for name, i in SPECIAL_TOKENS.items() if i == token_id)
        raw = list(token.encode())
    else:
        token = chr(token_id) if token_id < 128 else f"bytes:\\x{token_id:02x}"
        raw = [token_id]
    return {"token": token, "logprob": 0.0, "bytes": raw, "top_logprobs": []}


class ScriptedPolicy:
    """Answers chat requests from a ScriptBook."""

    def __init__(
        self, book: ScriptBook, *, model_name: str, max_model_len: int, policy_version: int
    ) -> None:
        self.book = book
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.policy_version = policy_version

    def prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        """The prompt's ids; a prompt over the context is refused as vLLM 0.32 refuses it."""
        ids = token_ids(render_prompt(messages, tools))
        if len(ids) > self.max_model_len:
            raise ContextOverflowError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt contains {len(ids)} input tokens, which exceeds this limit even "
                "without any output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={len(ids)})"
            )
        return ids

    def next_call(self, req: ChatRequest) -> tuple[int, ScriptedCall]:
        """The request's script and its call after the assistant turns the request holds."""
        script = self.book.script_for(
            "\n".join(message_text(m.get("content")) for m in req.messages)
        )
        turn = sum(1 for m in req.messages if m.get("role") == "assistant")
        if turn >= len(script.calls):
            raise ScriptError(
                f"script {script.name!r} has {len(script.calls)} calls; asked for one more"
            )
        call = script.calls[turn]
        offered = [str((t.get("function") or {}).get("name")) for t in req.tools or []]
        if call.tool not in offered:
            raise ScriptError(
                f"script {script.name!r} call {turn} uses tool {call.tool!r}; the agent "
                f"offered {offered}"
            )
        return turn, call

    def answer(self, req: ChatRequest) -> dict[str, Any]:
        """A chat completion in vLLM's shape: the call as a tool call, with token ids and
        logprobs of the prompt and the answer as this server renders them."""
        if req.stream or req.n != 1:
            raise ScriptError("the scripted policy server answers one whole choice (no stream)")
        prompt_ids = self.prompt_ids(req.messages, req.tools)
        turn, call = self.next_call(req)
        arguments = json.dumps(call.arguments)
        completion_ids = [*token_ids(call.content + render_call(call.tool, arguments)), IM_END]
        forced = req.tool_choice is not None and req.tool_choice not in ("auto", "none")
        message = {
            "role": "assistant",
            "content": call.content or ("" if forced else None),
            "tool_calls": [
                {
                    # Deterministic, so a replayed or retried call gets the same answer.
                    "id": f"call_{turn}",
                    "type": "function",
                    "function": {"name": call.tool, "arguments": arguments},
                }
            ],
        }
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "prompt_token_ids": prompt_ids,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": "tool_calls",
                    "stop_reason": None,
                    "token_ids": completion_ids,
                    "logprobs": {"content": [logprob_entry(t) for t in completion_ids]},
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(completion_ids),
                "total_tokens": len(prompt_ids) + len(completion_ids),
            },
        }


def _error(err: ScriptError | ValidationError) -> JSONResponse:
    """vLLM 0.32's error body (DARL's reference server's too); a prompt over the context
    names `input_tokens` as the field at fault, as vLLM does."""
    if isinstance(err, ValidationError):
        message, param = f"invalid request: {err.errors()[0]['msg']}", None
    else:
        message, param = str(err), "input_tokens" if isinstance(err, ContextOverflowError) else None
    error = {"message": message, "type": "BadRequestError", "param": param, "code": 400}
    return JSONResponse({"error": error}, status_code=400)


def create_scripted_policy_app(
    policy: ScriptedPolicy, ready: dict[str, Any] | None = None
) -> FastAPI:
    """The app; with `ready` (`{"path", "url"}`), it writes the ready file once it starts."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if ready is not None:
            write_ready_file(Path(ready["path"]), {"url": ready["url"], "name": "scripted-policy"})
        yield

    app = FastAPI(title="DARL scripted policy server (a stand-in for a model)", lifespan=lifespan)
    headers = {VERSION_HEADER: str(policy.policy_version)}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        try:
            req = ChatRequest.model_validate_json(await request.body())
            return JSONResponse(policy.answer(req), headers=headers)
        except (ValidationError, ScriptError) as err:
            return _error(err)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        try:
            req = TokenizeRequest.model_validate_json(await request.body())
            ids = token_ids(render_prompt(req.messages, req.tools))
        except ValidationError as err:
            return _error(err)
        body = {"count": len(ids), "max_model_len": policy.max_model_len, "tokens": ids}
        return JSONResponse({**body, "token_strs": None})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = {"id": policy.model_name, "object": "model", "owned_by": "darl-scripted"}
        return {"object": "list", "data": [{**model, "max_model_len": policy.max_model_len}]}

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"policy_version": policy.policy_version, "model": policy.model_name}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="A scripted policy server: a stand-in for a model that can solve coding "
        "tasks. It answers each task's chat calls with the tool calls its scripts file lists."
    )
    parser.add_argument("--scripts", type=Path, required=True, help="the scripts file (JSON)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free port from the kernel")
    parser.add_argument("--ready-file", type=Path, help="where to write the bound address")
    parser.add_argument("--model-name", default="darl-scripted")
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--policy-version", type=int, default=0)
    args = parser.parse_args(argv)
    policy = ScriptedPolicy(
        ScriptBook.read(args.scripts),
        model_name=args.model_name,
        max_model_len=args.max_model_len,
        policy_version=args.policy_version,
    )
    # Bound before serving: port 0 gives a free port with no probing race, and connections
    # queue on the listening socket until uvicorn accepts them.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(512)
    url = f"http://{args.host}:{sock.getsockname()[1]}"
    ready = {"path": str(args.ready_file), "url": url} if args.ready_file else None
    app = create_scripted_policy_app(policy, ready)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=75))
    asyncio.run(server.serve(sockets=[sock]))


if __name__ == "__main__":
    main()
