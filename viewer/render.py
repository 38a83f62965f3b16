"""Turning call records into what a page (or `darl trajectory`) shows: the messages new in each
call, the completion, and token runs shaded by logprob. Everything an agent or a model wrote is
escaped here or by the templates' autoescape, never trusted as markup."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from markupsafe import Markup
from markupsafe import escape as escape_text

from darl.gateway.store.record import CallRecord
from darl.viewer.trajectory import TokenText, returned_token_texts

if TYPE_CHECKING:
    from darl.trainer.aggregation import TrainingRow


@dataclass(frozen=True)
class Message:
    role: str
    text: str


@dataclass(frozen=True)
class CallView:
    record: CallRecord
    earlier_messages: int
    messages: list[Message]
    prompt: str | None
    completion: str
    completion_tokens: int
    logprobs: list[float] | None

    @property
    def finish_reason(self) -> str:
        return self.record.finish_reason() or "-"


def content_text(content: Any) -> str:
    """A chat message's content as text: a string, or its parts (text parts as themselves,
    any other part as JSON)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part.get("text", "")
            if isinstance(part, dict) and part.get("type") == "text"
            else json.dumps(part)
            for part in content
        )
    return json.dumps(content)


def message_of(raw: Any) -> Message:
    if not isinstance(raw, dict):
        return Message("?", json.dumps(raw))
    text = content_text(raw.get("content"))
    for call in raw.get("tool_calls") or []:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        text += f"\n[tool call {function.get('name', '?')}({function.get('arguments', '')})]"
    if raw.get("tool_call_id"):
        text = f"[result of {raw['tool_call_id']}] {text}"
    return Message(str(raw.get("role", "?")), text)


def completion_text(record: CallRecord) -> str:
    choices = record.response.get("choices") or [{}]
    choice = choices[0]
    if "message" in choice:
        return message_of(choice["message"]).text
    return str(choice.get("text") or "")


def _common_prefix(previous: list[Any], messages: list[Any]) -> int:
    # The usual call extends the last one's messages: one list comparison (C, and the store
    # shares the message objects between consecutive records), not a Python loop per message.
    if messages[: len(previous)] == previous:
        return len(previous)
    kept = 0
    while kept < min(len(previous), len(messages)) and previous[kept] == messages[kept]:
        kept += 1
    return kept


def call_views(records: Sequence[CallRecord]) -> list[CallView]:
    """Each call with the messages it added to the previous call's (a prompt that grows with
    the conversation is shown once, so a long trajectory stays a page of its own length)."""
    views = []
    previous: list[Any] = []
    for record in records:
        messages = record.request.get("messages")
        if isinstance(messages, list):
            kept = _common_prefix(previous, messages)
            shown = [message_of(m) for m in messages[kept:]]
            previous = messages
            prompt = None
        else:
            kept, shown = 0, []
            raw_prompt = record.request.get("prompt")
            prompt = raw_prompt if isinstance(raw_prompt, str) else json.dumps(raw_prompt)
        views.append(
            CallView(
                record=record,
                earlier_messages=kept,
                messages=shown,
                prompt=prompt,
                completion=completion_text(record),
                completion_tokens=len(record.completion_token_ids()),
                logprobs=record.completion_logprobs(),
            )
        )
    return views


def _shade(logprob: float | None, trained: bool = True) -> str:
    """A token's background: the less likely the sampled token, the redder."""
    if not trained:
        return "background:#e5e5e5;color:#666"
    if logprob is None:
        return ""
    p = math.exp(max(logprob, -50.0))
    return f"background:rgba(220,40,40,{(1 - p) * 0.85:.2f})"


def _span(token_id: int, text: str | None, logprob: float | None, trained: bool = True) -> str:
    shown = text if text else f"⟨{token_id}⟩"
    # The title holds numbers only: nothing in it to escape.
    title = f"id {token_id}" + (f", logprob {logprob:.3f}" if logprob is not None else "")
    if not trained:
        title += ", not trained on (mask 0)"
    return (
        f'<span class="tok" style="{_shade(logprob, trained)}" title="{title}">'
        f"{escape_text(shown)}</span>"
    )


def completion_tokens_html(record: CallRecord, text: TokenText) -> Markup:
    ids = record.completion_token_ids()
    logprobs = record.completion_logprobs() or []
    returned = returned_token_texts(record)
    spans = []
    for i, token_id in enumerate(ids):
        token = text.text(token_id) or (returned[i] if i < len(returned) else None)
        spans.append(_span(token_id, token, logprobs[i] if i < len(logprobs) else None))
    return Markup("".join(spans))


def row_tokens_html(row: TrainingRow, text: TokenText) -> Markup:
    """The row's response as the trainer sees it: model tokens shaded by their logprob,
    tokens inserted between calls (mask 0) grey."""
    spans = [
        _span(token_id, text.text(token_id), logprob if mask else None, bool(mask))
        for token_id, mask, logprob in zip(
            row.response_ids, row.response_mask, row.rollout_logprobs, strict=True
        )
    ]
    return Markup("".join(spans))


def ids_text(ids: Sequence[int], text: TokenText) -> str:
    """Token ids as text where they can be decoded, ⟨id⟩ where not."""
    return "".join(text.text(i) or f"⟨{i}⟩" for i in ids)
