"""What a model call is made of, read from vLLM's response fields (the reference policy server
speaks the same): prompt and completion token ids, logprobs, and the assembly of a streamed
answer into the same record a non-streamed one would have given."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from darl.gateway import json_codec
from darl.gateway.protocols.chat.prompt_ids import CaptureError as CaptureError
from darl.gateway.protocols.chat.prompt_ids import RawTokenIds, null_prompt_ids
from darl.gateway.protocols.chat.protocol import CHAT, Endpoint


def prompt_token_ids(endpoint: Endpoint, response: dict[str, Any]) -> Sequence[int]:
    """The prompt's token ids: a list, or the bytes the policy server sent (see `prompt_ids`)."""
    if endpoint == CHAT:
        ids = response.get("prompt_token_ids")
    else:
        choices = response.get("choices") or [{}]
        ids = choices[0].get("prompt_token_ids")
    if not isinstance(ids, list | RawTokenIds):
        raise CaptureError("upstream response has no prompt_token_ids (is return_token_ids on?)")
    return ids


def with_prompt_token_ids(
    endpoint: Endpoint, response: dict[str, Any], ids: Sequence[int] | None
) -> dict[str, Any]:
    """`response` with `ids` as its prompt's token ids, where the endpoint carries them."""
    if endpoint == CHAT:
        return {**response, "prompt_token_ids": ids}
    choices = [{**choice, "prompt_token_ids": ids} for choice in response.get("choices") or []]
    return {**response, "choices": choices}


def asked_for_prompt_ids(body: dict[str, Any]) -> bool:
    """Whether the agent's own request asked for the prompt's token ids (`return_token_ids`).
    DARL forces the flag upstream for the store whatever the agent says, but gives the prompt's
    ids back only to an agent that asked, as vLLM does: they grow with the conversation (a 48k
    token prompt is ~200 KB on every call), and an agent that never reads them would pay for
    them on every call."""
    return body.get("return_token_ids") is True


def answer_as_asked(
    endpoint: Endpoint, body: bytes, answer: dict[str, Any], *, asked: bool, event: bool = False
) -> bytes:
    """What the agent gets of the policy server's `body` (an answer, or with `event` one SSE
    event), which `answer_of` read as `answer`: the bytes as they came, except that an agent
    that did not ask for the prompt's token ids gets them `null` (see `asked_for_prompt_ids`).
    A chat answer's ids are cut out of the bytes; an answer that needs more (a completion's, on
    each choice) is written again from `answer`."""
    if asked or not _holds_prompt_ids(endpoint, answer):
        return body
    if isinstance(answer.get("prompt_token_ids"), RawTokenIds):
        nulled = null_prompt_ids(body)
        if nulled is not None:
            return nulled
    written = json_codec.dumps(with_prompt_token_ids(endpoint, answer, None))
    return b"data: " + written + b"\n\n" if event else written


def _holds_prompt_ids(endpoint: Endpoint, answer: dict[str, Any]) -> bool:
    if endpoint == CHAT:
        return answer.get("prompt_token_ids") is not None
    choices = answer.get("choices") or []
    return any(isinstance(c, dict) and c.get("prompt_token_ids") is not None for c in choices)


def completion_token_ids(response: dict[str, Any], choice: int = 0) -> list[int]:
    ids = response["choices"][choice].get("token_ids")
    if not isinstance(ids, list):
        raise CaptureError("upstream response has no choices[].token_ids")
    return ids


def completion_logprobs(
    endpoint: Endpoint, response: dict[str, Any], choice: int = 0
) -> list[float] | None:
    logprobs = response["choices"][choice].get("logprobs")
    if not logprobs:
        return None
    if endpoint == CHAT:
        return [entry["logprob"] for entry in logprobs.get("content") or []]
    return list(logprobs.get("token_logprobs") or [])


def finish_reason(response: dict[str, Any]) -> str | None:
    choices = response.get("choices") or []
    return choices[0].get("finish_reason") if choices else None


def require_token_ids(endpoint: Endpoint, response: dict[str, Any]) -> Sequence[int]:
    """The prompt's token ids, once every choice is known to carry its completion's: an answer
    without them cannot be trained on, so it is refused (CaptureError) before it is recorded."""
    for i in range(len(response["choices"])):
        completion_token_ids(response, i)
    return prompt_token_ids(endpoint, response)


def count_tokens(endpoint: Endpoint, response: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, completion tokens over all choices), from the ids themselves."""
    prompt = len(prompt_token_ids(endpoint, response))
    completion = sum(
        len(completion_token_ids(response, i)) for i in range(len(response["choices"]))
    )
    return prompt, completion


# --- streaming -------------------------------------------------------------------------


def split_sse(buffer: bytearray) -> Iterator[bytes]:
    """Pop complete SSE events (terminated by a blank line) off the front of `buffer`."""
    while True:
        end = buffer.find(b"\n\n")
        if end < 0:
            return
        event = bytes(buffer[: end + 2])
        del buffer[: end + 2]
        yield event


def sse_data(event: bytes) -> str | None:
    """The event's data: its `data:` lines, joined. Lines end where SSE ends them (CRLF, LF or
    CR), not where `str.splitlines` would: a policy server may write U+2028 or U+0085 unescaped
    inside a JSON string (pydantic does), and cutting there would lose the chunk."""
    text = event.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    lines = [line[5:].lstrip() for line in text.split("\n") if line.startswith("data:")]
    return "\n".join(lines) if lines else None


class StreamAssembler:
    """Folds the chunks of a streamed chat or text completion into one response object with the
    shape of a non-streamed one (`prompt_token_ids`, `choices[].token_ids`, logprobs)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._head: dict[str, Any] = {}
        self._choices: dict[int, dict[str, Any]] = {}
        self._prompt_ids: Sequence[int] | None = None
        self._usage: dict[str, Any] | None = None
        self.finished = False

    def add(self, chunk: dict[str, Any]) -> bool:
        """Fold one chunk in; True when the chunk ends a choice or carries the usage (the part
        held back from the agent until the call is recorded)."""
        if "error" in chunk:
            raise CaptureError(f"upstream stream failed: {json.dumps(chunk['error'])[:500]}")
        if not self._head:
            self._head = {k: chunk[k] for k in ("id", "created", "model") if k in chunk}
        if self.endpoint == CHAT and chunk.get("prompt_token_ids") is not None:
            ids = chunk["prompt_token_ids"]
            self._prompt_ids = ids if isinstance(ids, RawTokenIds) else list(ids)
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        ends = bool(chunk.get("usage"))
        for part in chunk.get("choices") or []:
            choice = self._choices.setdefault(part.get("index", 0), self._new_choice())
            self._add_part(choice, part)
            if part.get("finish_reason") is not None:
                choice["finish_reason"] = part["finish_reason"]
                ends = True
            if part.get("stop_reason") is not None:
                # vLLM's: the stop string (or token id) that ended the answer.
                choice["stop_reason"] = part["stop_reason"]
        self.finished = self.finished or ends
        return ends

    def response(self) -> dict[str, Any]:
        choices = [self._finish_choice(i, self._choices[i]) for i in sorted(self._choices)]
        obj = "chat.completion" if self.endpoint == CHAT else "text_completion"
        response: dict[str, Any] = {**self._head, "object": obj, "choices": choices}
        if self.endpoint == CHAT:
            response["prompt_token_ids"] = self._prompt_ids
        if self._usage is not None:
            response["usage"] = self._usage
        return response

    def _new_choice(self) -> dict[str, Any]:
        return {
            "text": [],
            "token_ids": [],
            "logprobs": [],
            "tool_calls": {},
            "role": None,
            "finish_reason": None,
            "stop_reason": None,
            "prompt_token_ids": None,
            "top": [],
            "offsets": [],
            "tokens": [],
            "has_logprobs": False,
        }

    def _add_part(self, choice: dict[str, Any], part: dict[str, Any]) -> None:
        """Add a chunk's part of one choice (its delta, ids and logprobs) to the choice."""
        choice["token_ids"].extend(part.get("token_ids") or [])
        if part.get("prompt_token_ids") is not None:
            choice["prompt_token_ids"] = list(part["prompt_token_ids"])
        logprobs = part.get("logprobs")
        if self.endpoint == CHAT:
            delta = part.get("delta") or {}
            choice["role"] = choice["role"] or delta.get("role")
            if delta.get("content"):
                choice["text"].append(delta["content"])
            for call in delta.get("tool_calls") or []:
                self._fold_tool_call(choice["tool_calls"], call)
            if logprobs:
                choice["has_logprobs"] = True
                choice["logprobs"].extend(logprobs.get("content") or [])
        else:
            if part.get("text"):
                choice["text"].append(part["text"])
            if logprobs:
                choice["has_logprobs"] = True
                choice["tokens"].extend(logprobs.get("tokens") or [])
                choice["logprobs"].extend(logprobs.get("token_logprobs") or [])
                choice["top"].extend(logprobs.get("top_logprobs") or [])
                choice["offsets"].extend(logprobs.get("text_offset") or [])

    @staticmethod
    def _fold_tool_call(calls: dict[int, dict[str, Any]], part: dict[str, Any]) -> None:
        call = calls.setdefault(
            part.get("index", 0),
            {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
        )
        call["id"] = call["id"] or part.get("id")
        function = part.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""

    def _finish_choice(self, index: int, choice: dict[str, Any]) -> dict[str, Any]:
        text = "".join(choice["text"])
        out: dict[str, Any] = {
            "index": index,
            "finish_reason": choice["finish_reason"],
            "token_ids": choice["token_ids"],
        }
        if choice["stop_reason"] is not None:
            out["stop_reason"] = choice["stop_reason"]
        if self.endpoint == CHAT:
            message: dict[str, Any] = {"role": choice["role"] or "assistant", "content": text}
            if choice["tool_calls"]:
                message["tool_calls"] = [
                    choice["tool_calls"][i] for i in sorted(choice["tool_calls"])
                ]
            out["message"] = message
            out["logprobs"] = {"content": choice["logprobs"]} if choice["has_logprobs"] else None
        else:
            out["text"] = text
            out["prompt_token_ids"] = choice["prompt_token_ids"]
            out["logprobs"] = (
                {
                    "tokens": choice["tokens"],
                    "token_logprobs": choice["logprobs"],
                    "top_logprobs": choice["top"],
                    "text_offset": choice["offsets"],
                }
                if choice["has_logprobs"]
                else None
            )
        return out


def answer_chunks(
    endpoint: Endpoint, response: dict[str, Any], include_usage: bool, with_prompt_ids: bool
) -> list[dict[str, Any]]:
    """A whole answer as the chunks of a stream, the inverse of `StreamAssembler` (a recorded
    answer replayed to an agent that streams): per choice an opening chunk (the role, and the
    prompt's token ids as vLLM sends them, `null` unless `with_prompt_ids`, as
    `answer_as_asked` gives a live stream to an agent that did not ask) and one with all its
    tokens, text, tool calls, logprobs and finish reason; then the usage, if asked for."""
    chat = endpoint == CHAT
    head: dict[str, Any] = {k: response[k] for k in ("id", "created", "model") if k in response}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    prompt_ids = prompt_token_ids(endpoint, response) if with_prompt_ids else None
    chunks: list[dict[str, Any]] = []
    for choice in response.get("choices") or []:
        index = choice.get("index", 0)
        body: dict[str, Any] = {
            "index": index,
            "logprobs": choice.get("logprobs"),
            "finish_reason": choice.get("finish_reason"),
            "token_ids": list(choice.get("token_ids") or []),
        }
        if choice.get("stop_reason") is not None:
            body["stop_reason"] = choice["stop_reason"]
        if chat:
            message = choice.get("message") or {}
            opening: dict[str, Any] = {
                **head,
                "choices": [
                    {
                        "index": index,
                        "delta": {"role": message.get("role") or "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            if not chunks:
                opening["prompt_token_ids"] = prompt_ids
            delta: dict[str, Any] = {}
            if message.get("reasoning_content"):
                delta["reasoning_content"] = message["reasoning_content"]
            if message.get("content"):
                delta["content"] = message["content"]
            if message.get("tool_calls"):
                delta["tool_calls"] = [
                    {"index": i, **call} for i, call in enumerate(message["tool_calls"])
                ]
            body["delta"] = delta
        else:
            opening = {
                **head,
                "choices": [
                    {
                        "index": index,
                        "text": "",
                        "logprobs": None,
                        "finish_reason": None,
                        "prompt_token_ids": prompt_ids,
                        "token_ids": [],
                    }
                ],
            }
            body["text"] = choice.get("text") or ""
        chunks += [opening, {**head, "choices": [body]}]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": usage_of(endpoint, response)})
    return chunks


def usage_of(endpoint: Endpoint, response: dict[str, Any]) -> dict[str, Any]:
    """The answer's usage, or what it is from its token ids when it carries none (an answer
    assembled from a stream that did not ask for it)."""
    if response.get("usage"):
        return dict(response["usage"])
    prompt, completion = count_tokens(endpoint, response)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
