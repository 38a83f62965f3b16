"""DARL's reference policy server: the tiny model behind an OpenAI-compatible API with vLLM's
fields and control endpoints (`/pause?mode=keep|wait|abort`, `/resume`, `/is_paused`), plus
`/reload_weights` from a checkpoint directory with the policy version it then reports: on
every answer (`X-Darl-Policy-Version`, the weights that finished it) and at `/version`. With a
state file it records each load and restores the last one when it starts again, so a
restarted server serves the weights it had, never its initial ones under a later label.

It exists so the whole loop runs on a laptop and in CI; it is not a production server.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter
from safetensors import SafetensorError
from safetensors.torch import load_file

from darl.files import write_atomically
from darl.serving.errors import ServingError
from darl.serving.generation import (
    GenerationEngine,
    SamplingParams,
    Sequence,
    TokenStep,
)
from darl.serving.openai_format import (
    ChatRequest,
    ChoiceState,
    CompletionRequest,
    ResponseShape,
    TokenizeRequest,
    template_message,
)
from darl.serving.tiny_model import load_model_dir
from darl.serving.tool_calls import (
    ToolCallConstraint,
    ToolChoice,
    ToolSpecError,
    character_tokens,
    parse_tool_choice,
)

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "darl-tiny"
CLIENT_CLOSED = 499
VERSION_HEADER = "X-Darl-Policy-Version"
# The version of weights that are no run's: a restore that failed.
UNRESTORED_VERSION = -1
CALL_ID_HEADER = "X-Darl-Call-Id"


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (vLLM aborts such a request; so do we)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class BadRequestError(ServingError, ValueError):
    """Answered with 400 and vLLM's error body."""


class GenerationFailedError(ServingError, RuntimeError):
    """The engine failed on the batch this request was in (answered with 500)."""


def _read_checkpoint(path: Path) -> dict[str, Any]:
    file = path / "model.safetensors" if path.is_dir() else path
    if not file.is_file():
        raise BadRequestError(f"no checkpoint at {path}")
    try:
        return load_file(file)
    except SafetensorError as err:
        raise BadRequestError(f"{file} is not a safetensors checkpoint: {err}") from err


def _load_into(model: Any, state: dict[str, Any]) -> None:
    """Load a checkpoint's tensors, all or none: one that does not fit the model raises
    BadRequestError before any weight changes (a half-loaded model would serve under the old
    version's name)."""
    own = model.state_dict()
    # Tied embeddings: a saved checkpoint has no separate lm_head.
    missing = sorted(set(own) - set(state) - {"lm_head.weight"})
    unexpected = sorted(set(state) - set(own))
    misshapen = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
    if missing or unexpected or misshapen:
        raise BadRequestError(
            f"checkpoint does not fit the model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}, other shapes {misshapen[:5]}"
        )
    model.load_state_dict(state, strict=False)


class PolicyServer:
    """Owns the model, the engine, the served policy version and the call log.

    `state_file` records the checkpoint and version of every load; a server started with an
    existing one loads that checkpoint first (its model dir only gives the architecture)."""

    def __init__(
        self,
        model_dir: Path,
        model_name: str = DEFAULT_MODEL_NAME,
        max_batch: int = 32,
        seed: int = 0,
        response_log: Path | None = None,
        state_file: Path | None = None,
    ) -> None:
        model, tokenizer = load_model_dir(model_dir)
        self.tokenizer = tokenizer
        self._token_chars = character_tokens(
            lambda t: str(tokenizer.decode([t])), len(tokenizer), set(tokenizer.all_special_ids)
        )
        self.model_name = model_name
        self.policy_version = 0
        self.state_file = state_file
        restored = self._restore(model)
        self.engine = GenerationEngine(model, tokenizer, max_batch=max_batch, seed=seed)
        if restored is not None:
            log.info("restored policy version %d from %s", self.policy_version, restored)
        self.response_log = response_log
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "darl_policy_requests",
            "Answered requests.",
            ["endpoint", "status"],
            registry=self.registry,
        )

    # --- requests ------------------------------------------------------------------------

    def tool_choice(self, req: ChatRequest) -> ToolChoice:
        try:
            return parse_tool_choice(req.tools, req.tool_choice)
        except ToolSpecError as err:
            raise BadRequestError(str(err)) from err

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The prompt's token ids as the model dir's chat template renders it (with the
        tools' signatures when there are tools, as vLLM renders them for every tool_choice)."""
        try:
            rendered = [template_message(m) for m in messages]
        except ValueError as err:
            raise BadRequestError(str(err)) from err
        # transformers types tools as dicts or python functions (a list is invariant).
        schemas: list[dict[Any, Any] | Callable[..., Any]] | None = list(tools) if tools else None
        text = self.tokenizer.apply_chat_template(
            rendered,
            tools=schemas,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def tokenize(self, req: TokenizeRequest) -> list[int]:
        """vLLM's `/tokenize`: a chat's prompt (as `/v1/chat/completions` would build it) or
        a prompt string's ids."""
        if req.messages is not None:
            if req.tools is not None:
                # The same checks a chat request's tools get.
                try:
                    parse_tool_choice(req.tools, "none")
                except ToolSpecError as err:
                    raise BadRequestError(str(err)) from err
            return self.chat_prompt(req.messages, req.tools, req.add_generation_prompt)
        if req.prompt is not None:
            return self.tokenizer(req.prompt, add_special_tokens=False)["input_ids"]
        raise BadRequestError("tokenize needs `messages` or `prompt`")

    def tool_constraint(self, choice: ToolChoice) -> ToolCallConstraint | None:
        """The decoding constraint of a forced tool_choice (None for auto and none)."""
        if not choice.forced:
            return None
        return ToolCallConstraint(choice.grammar(), self._token_chars, self.tokenizer.eos_token_id)

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            return self.tokenizer(req.prompt, add_special_tokens=False)["input_ids"]
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in req.prompt):
            raise BadRequestError(f"prompt token ids must lie in [0, {vocab})")
        return list(req.prompt)

    def _restore(self, model: Any) -> Path | None:
        """Load the checkpoint the state file names, if any; returns its path."""
        if self.state_file is None or not self.state_file.exists():
            return None
        record = json.loads(self.state_file.read_text())
        path, version = Path(record["path"]), int(record["version"])
        try:
            _load_into(model, _read_checkpoint(path))
        except (BadRequestError, OSError) as err:
            # Serving the model dir's weights is safe as long as they are not called
            # `version`: under a version no run has, the gateway records nothing from this
            # server until a weight sync loads the run's weights.
            log.error(
                "cannot restore version %d from %s, as %s records (%s): serving the model "
                "dir's weights as version %d until a weight sync",
                version,
                path,
                self.state_file,
                err,
                UNRESTORED_VERSION,
            )
            self.policy_version = UNRESTORED_VERSION
            return None
        self.policy_version = version
        return path

    def _record_load(self, path: Path, version: int) -> None:
        if self.state_file is None:
            return
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(
            self.state_file, json.dumps({"path": str(path.resolve()), "version": version})
        )

    async def generate(
        self,
        request: Request,
        shape: ResponseShape,
        params: SamplingParams,
        n: int,
        stream: bool,
        include_usage: bool,
        constraint: ToolCallConstraint | None = None,
    ) -> Response:
        """Generate `n` choices and answer them whole or streamed; `constraint` restricts
        every choice's tokens (a forced tool call)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        sequences = [
            Sequence(
                index=i,
                prompt_ids=shape.prompt_ids,
                params=params if params.seed is None else replace(params, seed=params.seed + i),
                loop=loop,
                events=events,
                allowed_tokens=constraint.allowed if constraint is not None else None,
            )
            for i in range(n)
        ]
        for seq in sequences:
            self.engine.submit(seq)
        choices = [ChoiceState(index=i) for i in range(n)]
        endpoint = shape.kind
        call_id = request.headers.get(CALL_ID_HEADER)
        if stream:
            body = self._stream(shape, sequences, choices, events, include_usage, call_id)
            # The version as the stream starts; the gateway asks /version again at its end.
            return StreamingResponse(
                body,
                media_type="text/event-stream",
                headers={VERSION_HEADER: str(self.policy_version)},
            )
        collecting = asyncio.ensure_future(self._drain(choices, events, n))
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({collecting, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            for seq in sequences:
                seq.cancelled = True  # ends them at the next step if still generating
        if not collecting.done():
            collecting.cancel()
            return Response(status_code=CLIENT_CLOSED)
        collecting.result()
        self.requests.labels(endpoint, "200").inc()
        response = shape.whole(choices)
        # Read once: the version of the weights that produced the last token.
        version = self.policy_version
        self._log(endpoint, shape, choices, call_id, version)
        return JSONResponse(response, headers={VERSION_HEADER: str(version)})

    async def _drain(self, choices: list[ChoiceState], events: asyncio.Queue, n: int) -> None:
        async for _ in self._collect(choices, events, n):
            pass

    async def _collect(
        self, choices: list[ChoiceState], events: asyncio.Queue, n: int
    ) -> AsyncIterator[tuple[ChoiceState, TokenStep | None]]:
        """Yield (choice, step) per token and (choice, None) when a choice finishes."""
        finished = 0
        while finished < n:
            index, item = await events.get()
            choice = choices[index]
            if isinstance(item, TokenStep):
                choice.token_ids.append(item.token_id)
                choice.text += item.text
                choice.steps.append(item)
                yield choice, item
            elif item.startswith("error: "):
                raise GenerationFailedError(item)
            else:
                choice.finish_reason = item
                finished += 1
                yield choice, None

    async def _stream(
        self,
        shape: ResponseShape,
        sequences: list[Sequence],
        choices: list[ChoiceState],
        events: asyncio.Queue,
        include_usage: bool,
        call_id: str | None,
    ) -> AsyncIterator[bytes]:
        def sse(obj: dict[str, Any]) -> bytes:
            return f"data: {json.dumps(obj)}\n\n".encode()

        try:
            for choice in choices:
                yield sse(shape.first_chunk(choice.index))
            # A token is sent once the next event says whether it was the choice's last, so
            # the finishing chunk carries both the last token and the finish reason.
            pending: dict[int, TokenStep] = {}
            async for choice, step in self._collect(choices, events, len(choices)):
                previous = pending.pop(choice.index, None)
                if step is not None:
                    if previous is not None:
                        yield sse(shape.token_chunk(choice, previous, None))
                    pending[choice.index] = step
                elif previous is not None:
                    yield sse(shape.token_chunk(choice, previous, choice.finish_reason))
                else:
                    yield sse(shape.finish_chunk(choice))
            if include_usage:
                yield sse(shape.usage_chunk(choices))
            yield b"data: [DONE]\n\n"
            self.requests.labels(shape.kind, "200").inc()
            self._log(shape.kind, shape, choices, call_id, self.policy_version)
        finally:
            for seq in sequences:
                seq.cancelled = True

    def _log(
        self,
        endpoint: str,
        shape: ResponseShape,
        choices: list[ChoiceState],
        call_id: str | None,
        version: int,
    ) -> None:
        """One line per answer: what it was and which weights produced it (the ground truth
        a test checks the gateway's records against)."""
        if self.response_log is None:
            return
        line = {
            "id": shape.id,
            "call_id": call_id,
            "endpoint": endpoint,
            "prompt_token_ids": shape.prompt_ids,
            "token_ids": [c.token_ids for c in choices],
            # The logprob of each token as generated (what the gateway must record).
            "logprobs": [[step.logprob for step in c.steps] for c in choices],
            "policy_version": version,
        }
        with self.response_log.open("a") as f:
            f.write(json.dumps(line) + "\n")

    # --- weights -------------------------------------------------------------------------

    async def reload_weights(self, path: Path, version: int) -> None:
        """Load weights from a checkpoint (a model directory or a .safetensors file) between
        two decode steps; raises BadRequestError when there is none or it does not fit."""
        state = await asyncio.to_thread(_read_checkpoint, path)
        done: Future[None] = Future()

        def load() -> None:
            try:
                _load_into(self.engine.model, state)
                self.policy_version = version
                done.set_result(None)
            except (ValueError, RuntimeError) as err:
                done.set_exception(err)

        self.engine.run_between_steps(load)
        await asyncio.wrap_future(done)
        await asyncio.to_thread(self._record_load, path, version)
