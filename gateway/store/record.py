"""The record of a model call as the trajectory store keeps it: `CallRecord`, a call whole
(request, response, token ids of both), and `FailedCall`, a call that got no answer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from darl.gateway.protocols.chat.capture import (
    completion_logprobs,
    completion_token_ids,
    finish_reason,
)
from darl.gateway.protocols.chat.protocol import Endpoint
from darl.gateway.protocols.chat.sent_messages import SentMessages


@dataclass(frozen=True)
class CallRecord:
    """One model call, whole: what was sent, what came back, and the token ids of both."""

    call_id: str
    rollout_id: str
    attempt: int
    sequence: int
    endpoint: Endpoint
    upstream: str
    policy_version: int
    created_at: float
    latency_ms: float
    retry_count: int
    streamed: bool
    request: dict[str, Any]
    response: dict[str, Any]
    # A list, or on a live call the bytes the policy server sent (`RawTokenIds`, equal to
    # the list it holds): the store reads back lists.
    prompt_token_ids: Sequence[int]
    # The protocol the agent spoke (the Responses or Messages API, translated to a chat call;
    # see `translation`): the endpoint's own unless said.
    protocol: str = ""
    # What the protocol's answer needs of the call later: the ids it answered under, whether
    # it carried instructions (`previous_response_id` drops them).
    exchange: dict[str, Any] = field(default_factory=dict)
    # The call of an earlier attempt this record reproduces (rule 10): its answer, tokens,
    # logprobs and policy version are that call's; the request is what the agent sent now.
    replayed_from: str | None = None
    # Matched its record only under the rollout's normalizers: the prompt differs from the
    # recorded one in spans they ignore (slightly off-policy, as a stale call is).
    replay_normalized: bool = False
    # An answer its agent never received: the agent went away, or its attempt ended, while the
    # call was at the policy server. Not part of the attempt's trajectory (no event, never
    # trained), kept so the next attempt's identical request replays it (rule 10).
    unreceived: bool = False
    # The `Idempotency-Key` the agent's request came with: a retry of the request with it is
    # answered from this record (`calls.idempotency`).
    idempotency_key: str | None = None
    # On a live chat call, the request's messages as the JSON the agent sent them in
    # (`SentMessages`), which `request["messages"]` may be itself, or their reading where a
    # replay read them; for the store to compare with the next call's, never stored as such.
    sent_messages: SentMessages | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.protocol:
            object.__setattr__(self, "protocol", self.endpoint)

    def completion_token_ids(self, choice: int = 0) -> list[int]:
        return completion_token_ids(self.response, choice)

    def completion_logprobs(self, choice: int = 0) -> list[float] | None:
        return completion_logprobs(self.endpoint, self.response, choice)

    def finish_reason(self) -> str | None:
        return finish_reason(self.response)


@dataclass(frozen=True)
class FailedCall:
    """A model call that got no answer: refused (a prompt too long: 400), failed at the policy
    server, or broken mid-stream. Kept so a user sees why an agent got nothing; never trained
    on."""

    call_id: str
    rollout_id: str
    attempt: int
    protocol: str
    status: int
    error: str
    latency_ms: float
    retry_count: int
    upstream: str | None
    created_at: float

    def summary(self) -> str:
        return f"{self.status} ({self.protocol}): {self.error[:300]}"
