"""OpenAI-compatible request parsing and response shapes with vLLM's extra fields
(`prompt_token_ids`, `choices[].token_ids`), for the reference policy server."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedTokenizerFast

from darl.serving.generation import GenerationRejectedError, SamplingParams, TokenStep
from darl.serving.tool_calls import ToolCallStream, ToolChoice, split_tool_calls


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=10.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    # vLLM's bound (a 64-bit integer).
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool = False
    ignore_eos: bool = False

    def sampling(self, default_max_tokens: int, top_logprobs: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=self.max_tokens or default_max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            seed=self.seed,
            stop=tuple(s for s in stop if s),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            top_logprobs=top_logprobs,
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def output_budget(self) -> tuple[str, int | None]:
        """The field that bounds the completion and its value."""
        return "max_tokens", self.max_tokens

    def check_output_budget(self, max_model_len: int) -> None:
        """Refuse a completion budget over the whole context, as vLLM does before it renders
        the prompt (one within it is cut to the room the prompt leaves, `engine.submit`)."""
        name, value = self.output_budget()
        if value is not None and value > max_model_len:
            raise GenerationRejectedError(
                f"{name}={value} cannot be greater than max_model_len={max_model_len}. "
                "Please request fewer output tokens.",
                param=name,
                value=value,
            )


class ChatRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def output_budget(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


class TokenizeRequest(BaseModel):
    """vLLM's `/tokenize`: chat messages (with tools) or a prompt."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[dict[str, Any]] | None = Field(default=None, min_length=1)
    tools: list[dict[str, Any]] | None = None
    prompt: str | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    """vLLM's `/detokenize`: token ids back to text."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


class CompletionRequest(_Request):
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Literal[False] = False


def message_text(content: Any) -> str:
    """OpenAI message content: a string, None, or a list of text parts. Any other part (an
    image, audio) raises ValueError: the tiny model takes text only, and dropping a part would
    answer a question the client did not ask."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type", "text") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"a content part of type {kind!r}: this model takes text only")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise ValueError("message content must be a string or a list of parts")


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A request message as the chat template reads it: role, text content, and an
    assistant's tool calls (name and arguments; a string of arguments is kept verbatim).
    Raises ValueError for content or calls it cannot render."""
    role = str(message.get("role", "user"))
    out: dict[str, Any] = {"role": role, "content": message_text(message.get("content"))}
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise ValueError("tool_calls must be a list")
        out["tool_calls"] = [_template_call(call) for call in calls]
    return out


def _template_call(call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError("a tool call needs function.name")
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str | dict):
        raise ValueError("a tool call's function.arguments must be a JSON string or object")
    return {"function": {"name": function["name"], "arguments": arguments}}


@dataclass
class ChoiceState:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    steps: list[TokenStep] = field(default_factory=list)
    finish_reason: str | None = None
    # Splits the streamed text into content and tool calls (a chat with tools to parse).
    tool_stream: ToolCallStream | None = None


def _token_str(tokenizer: PreTrainedTokenizerFast, token_id: int) -> str:
    # A list of ids decodes to one str (the annotation also covers batches).
    return str(tokenizer.decode([token_id]))


def chat_logprob_entry(tokenizer: PreTrainedTokenizerFast, step: TokenStep) -> dict[str, Any]:
    token = _token_str(tokenizer, step.token_id)
    return {
        "token": token,
        "logprob": step.logprob,
        "bytes": list(token.encode("utf-8")),
        "top_logprobs": [
            {
                "token": (t := _token_str(tokenizer, tid)),
                "logprob": lp,
                "bytes": list(t.encode("utf-8")),
            }
            for tid, lp in step.top
        ],
    }


def completion_logprobs(
    tokenizer: PreTrainedTokenizerFast, steps: list[TokenStep], offset: int = 0
) -> dict[str, Any]:
    tokens, token_logprobs, top, offsets = [], [], [], []
    for step in steps:
        token = _token_str(tokenizer, step.token_id)
        tokens.append(token)
        token_logprobs.append(step.logprob)
        top.append(
            {_token_str(tokenizer, tid): lp for tid, lp in step.top} or {token: step.logprob}
        )
        offsets.append(offset)
        offset += len(step.text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


@dataclass
class ResponseShape:
    """Builds the chat / text completion objects (whole or chunked) of one request."""

    kind: Literal["chat", "completion"]
    model: str
    tokenizer: PreTrainedTokenizerFast
    prompt_ids: list[int]
    with_logprobs: bool
    with_token_ids: bool
    tools: ToolChoice | None = None  # a chat whose answers are parsed for tool calls
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, chunk: bool) -> dict[str, Any]:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
            return {
                "id": f"chatcmpl-{self.id}",
                "object": obj,
                "created": self.created,
                "model": self.model,
            }
        return {
            "id": f"cmpl-{self.id}",
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
        }

    def usage(self, choices: list[ChoiceState]) -> dict[str, int]:
        completion = sum(len(c.token_ids) for c in choices)
        return {
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": completion,
            "total_tokens": len(self.prompt_ids) + completion,
        }

    def whole(self, choices: list[ChoiceState]) -> dict[str, Any]:
        out = self._head(chunk=False)
        out["choices"] = [self._whole_choice(c) for c in choices]
        out["usage"] = self.usage(choices)
        if self.kind == "chat" and self.with_token_ids:
            out["prompt_token_ids"] = self.prompt_ids
        return out

    def _whole_choice(self, c: ChoiceState) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": c.index,
            "finish_reason": c.finish_reason,
            "stop_reason": None,
        }
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": c.text}
            if self.tools is not None:
                content, calls = split_tool_calls(c.text)
                empty = self.tools.empty_content() if calls else ""
                choice["message"] = {
                    "role": "assistant",
                    "content": content or empty,
                    "tool_calls": calls,
                }
                choice["finish_reason"] = self.tools.finish_reason(bool(calls), c.finish_reason)
            choice["logprobs"] = (
                {"content": [chat_logprob_entry(self.tokenizer, s) for s in c.steps]}
                if self.with_logprobs
                else None
            )
        else:
            choice["text"] = c.text
            choice["logprobs"] = (
                completion_logprobs(self.tokenizer, c.steps) if self.with_logprobs else None
            )
            if self.with_token_ids:
                choice["prompt_token_ids"] = self.prompt_ids
        if self.with_token_ids:
            choice["token_ids"] = c.token_ids
        return choice

    def first_chunk(self, index: int) -> dict[str, Any]:
        """The opening chunk of a choice: the role (chat) and the prompt's token ids."""
        out = self._head(chunk=True)
        if self.kind == "chat":
            out["choices"] = [
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
            if self.with_token_ids:
                out["prompt_token_ids"] = self.prompt_ids
        else:
            choice: dict[str, Any] = {
                "index": index,
                "text": "",
                "logprobs": None,
                "finish_reason": None,
            }
            if self.with_token_ids:
                choice["prompt_token_ids"] = self.prompt_ids
                choice["token_ids"] = []
            out["choices"] = [choice]
        return out

    def token_chunk(
        self, c: ChoiceState, step: TokenStep, finish_reason: str | None
    ) -> dict[str, Any]:
        out = self._head(chunk=True)
        choice: dict[str, Any] = {"index": c.index, "finish_reason": finish_reason}
        if self.kind == "chat":
            choice["delta"] = {"content": step.text}
            if self.tools is not None:
                choice["delta"], choice["finish_reason"] = self._tool_delta(
                    c, step.text, finish_reason
                )
            choice["logprobs"] = (
                {"content": [chat_logprob_entry(self.tokenizer, step)]}
                if self.with_logprobs
                else None
            )
        else:
            choice["text"] = step.text
            offset = len(c.text) - len(step.text)
            choice["logprobs"] = (
                completion_logprobs(self.tokenizer, [step], offset) if self.with_logprobs else None
            )
        if self.with_token_ids:
            choice["token_ids"] = [step.token_id]
        out["choices"] = [choice]
        return out

    def _tool_delta(
        self, c: ChoiceState, text: str, finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """A chat chunk's delta and finish reason when tool calls are parsed: content outside
        `<tool_call>` blocks, each call whole in the chunk of the token that closes it
        (`{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}`), and
        `{}` while text is held back."""
        stream = c.tool_stream
        if stream is None:
            stream = c.tool_stream = ToolCallStream()
        content, calls = stream.feed(text, final=finish_reason is not None)
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        if finish_reason is not None and self.tools is not None:
            finish_reason = self.tools.finish_reason(bool(stream.calls), finish_reason)
        return delta, finish_reason

    def finish_chunk(self, c: ChoiceState) -> dict[str, Any]:
        """Ends a choice that finished without a new token (an abort)."""
        out = self._head(chunk=True)
        choice: dict[str, Any] = {
            "index": c.index,
            "finish_reason": c.finish_reason,
            "logprobs": None,
        }
        if self.kind == "chat":
            choice["delta"] = {}
            if self.tools is not None:
                choice["delta"], choice["finish_reason"] = self._tool_delta(c, "", c.finish_reason)
        else:
            choice["text"] = ""
        if self.with_token_ids:
            choice["token_ids"] = []
        out["choices"] = [choice]
        return out

    def usage_chunk(self, choices: list[ChoiceState]) -> dict[str, Any]:
        return {**self._head(chunk=True), "choices": [], "usage": self.usage(choices)}
