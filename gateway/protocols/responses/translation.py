"""The OpenAI Responses API (`/rollouts/{id}/v1/responses`, what the OpenAI Agents SDK speaks) as
a chat completion to the policy server: input items become chat messages, function tools chat
tools, and the answer a Response (the `openai` package's own typed model), whole or as the
Responses event stream.

`previous_response_id` names an earlier call of the same rollout: its conversation is read back
from the trajectory store (the record holds its chat messages and its answer), so the gateway
keeps no state of its own. As in OpenAI's API, the earlier call's `instructions` are not
carried over.
"""

from __future__ import annotations

from typing import Any

from darl.gateway.errors import (
    BadRequestError,
    PreviousResponseNotFoundError,
    PreviousResponseNotStoredError,
)
from darl.gateway.protocols.responses.answer import output_items, response_of
from darl.gateway.protocols.responses.protocol import (
    CONTENT_PARTS,
    INPUT_ITEMS,
    RESPONSE_ID,
    FunctionCallItemParam,
    ImagePartParam,
    MessageItemParam,
    NamedFunctionParam,
    RefusalPartParam,
    ResponsesRequest,
)
from darl.gateway.protocols.responses.stream import ResponsesStream
from darl.gateway.protocols.stream import ChatAnswer, StreamTranslation
from darl.gateway.protocols.translation import (
    Translation,
    assistant_message,
    chat_tool,
    chat_tool_call,
    parse_request,
    unsupported,
)
from darl.gateway.store.base import TrajectoryStore
from darl.gateway.store.record import CallRecord
from darl.workflows.rollout_token import TokenClaims


def _content(parts: str | list[dict[str, Any]], where: str, joiner: str) -> Any:
    """A message's content parts as chat content: one string when they are all text (the
    policy server renders exactly that), else OpenAI chat parts."""
    if isinstance(parts, str):
        return parts
    texts: list[str] = []
    chat_parts: list[dict[str, Any]] = []
    for j, raw in enumerate(parts):
        kind = str(raw.get("type"))
        model = CONTENT_PARTS.get(kind)
        if model is None:
            raise unsupported(f"content part type {kind!r} ({where}.content.{j})")
        part = parse_request(model, raw, "responses", f"{where}.content.{j}")
        if isinstance(part, ImagePartParam):
            chat_parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
            continue
        text = part.refusal if isinstance(part, RefusalPartParam) else part.text
        texts.append(text)
        chat_parts.append({"type": "text", "text": text})
    if len(chat_parts) == len(texts):
        return joiner.join(texts)
    return chat_parts


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages: function calls join the assistant message
    before them (as the policy server answered them), their outputs become tool messages."""
    messages: list[dict[str, Any]] = []
    for i, raw in enumerate(items):
        kind = str(raw.get("type", "message"))
        model = INPUT_ITEMS.get(kind)
        if model is None:
            raise unsupported(f"input item type {kind!r} (input.{i})")
        item = parse_request(model, raw, "responses", f"input.{i}")
        if isinstance(item, MessageItemParam):
            if item.role == "assistant":
                messages.append(assistant_message(_content(item.content, f"input.{i}", ""), []))
            else:
                role = "system" if item.role == "developer" else item.role
                messages.append(
                    {"role": role, "content": _content(item.content, f"input.{i}", "\n")}
                )
        elif isinstance(item, FunctionCallItemParam):
            call = chat_tool_call(item.call_id, item.name, item.arguments)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append(assistant_message("", [call]))
        else:
            output = item.output
            text = output if isinstance(output, str) else _content(output, f"input.{i}", "\n")
            if not isinstance(text, str):
                raise unsupported(f"a function_call_output that is not text (input.{i})")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": text})
    return messages


def answered_messages(record: CallRecord) -> list[dict[str, Any]]:
    """The conversation of an earlier call, its answer included, without its instructions."""
    messages = list(record.request.get("messages") or [])
    if record.exchange.get("instructions"):
        messages = messages[1:]
    answer = ChatAnswer(record.response)
    messages.append(assistant_message(answer.text, answer.tool_calls))
    return messages


async def _previous(
    store: TrajectoryStore, claims: TokenClaims, response_id: str
) -> list[dict[str, Any]]:
    match = RESPONSE_ID.match(response_id)
    found: list[CallRecord] = []
    if match is not None:
        try:
            found = await store.read(claims.rollout_id, None, call_ids=[match.group(1)])
        except KeyError:
            found = []
        if not found and claims.replay is not None and claims.replay.prefix is not None:
            # A rollout that starts from a prefix was answered a call of the rollout it
            # branches from under that call's id: the conversation is its own record's.
            found = [
                r
                for r in await store.read(claims.rollout_id, claims.attempt)
                if r.exchange.get("answered_as") == match.group(1)
            ]
    if not found or found[0].protocol != ResponsesTranslation.protocol:
        raise PreviousResponseNotFoundError(
            f"previous response {response_id[:80]!r} not found in this rollout"
        )
    if found and found[0].attempt != claims.attempt:
        # An attempt that replayed the call answered under the same id (rule 10): the
        # conversation is its own (the prompt it sent, which a normalizer let differ).
        mine = [
            r
            for r in await store.read(claims.rollout_id, claims.attempt)
            if r.exchange.get("answered_as") == found[0].call_id
        ]
        found = mine or found
    if not found[0].exchange.get("store", True):
        raise PreviousResponseNotStoredError(
            f"previous response {response_id!r} was created with store=false"
        )
    return answered_messages(found[0])


# --- the translation ----------------------------------------------------------------------


class ResponsesTranslation(Translation):
    protocol = "responses"

    def __init__(self, request: ResponsesRequest, history: list[dict[str, Any]]) -> None:
        self.request = request
        items = (
            [{"role": "user", "content": request.input}]
            if isinstance(request.input, str)
            else request.input
        )
        messages = [*history, *chat_messages(items)]
        if request.instructions is not None:
            messages.insert(0, {"role": "system", "content": request.instructions})
        if not messages:
            raise BadRequestError("invalid responses request: input: no messages")
        chat: dict[str, Any] = {"messages": messages}
        if request.tools:
            chat["tools"] = [
                chat_tool(t.name, t.description, t.parameters, t.strict) for t in request.tools
            ]
        choice = request.tool_choice
        if isinstance(choice, NamedFunctionParam):
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice is not None:
            chat["tool_choice"] = choice
        optional = {
            "parallel_tool_calls": request.parallel_tool_calls,
            "max_tokens": request.max_output_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_logprobs": request.top_logprobs,
            "seed": request.seed,
        }
        chat.update({k: v for k, v in optional.items() if v is not None})
        if request.stream:
            chat["stream"] = True
        super().__init__(
            chat,
            {"instructions": request.instructions is not None, "store": request.store},
        )

    @classmethod
    async def of(
        cls, body: dict[str, Any], claims: TokenClaims, store: TrajectoryStore
    ) -> ResponsesTranslation:
        request: ResponsesRequest = parse_request(ResponsesRequest, body, "responses")
        history = (
            await _previous(store, claims, request.previous_response_id)
            if request.previous_response_id
            else []
        )
        return cls(request, history)

    def answer(self, response: dict[str, Any], call_id: str) -> dict[str, Any]:
        answer = ChatAnswer(response)
        output = output_items(self.request, answer, call_id)
        built = response_of(self.request, answer, call_id, output, "completed")
        return built.model_dump(mode="json", by_alias=True, warnings=False)

    def streaming(self, call_id: str) -> StreamTranslation:
        return ResponsesStream(self.request, call_id)
