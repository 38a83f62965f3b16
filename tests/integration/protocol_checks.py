"""What the protocol tests check of every call, against the reference server and vLLM alike:
the record holds exactly the tokens the policy server generated, and a multi-turn rollout
merges into one training row wherever its prompts extend each other."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from darl.gateway.store.record import CallRecord
from darl.trainer.aggregation import (
    AggregationCounters,
    AggregationSettings,
    RolloutSample,
    rollout_rows,
)

# Two integers: the reference server's constrained decoding writes canonical JSON for them.
ADD_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}


def assert_token_exact(records: Sequence[CallRecord], served: list[dict[str, Any]]) -> None:
    """Each record's prompt and completion token ids (and one logprob per completion token)
    are what the policy server's own log says it generated for that call."""
    by_call = {line["call_id"]: line for line in served}
    assert records
    for record in records:
        line = by_call[record.call_id]
        assert record.prompt_token_ids == line["prompt_token_ids"], record.call_id
        assert record.completion_token_ids() == line["token_ids"][0], record.call_id
        assert record.completion_logprobs() == line["logprobs"][0], record.call_id


def extends(previous: CallRecord, following: CallRecord) -> bool:
    context = previous.prompt_token_ids + previous.completion_token_ids()
    return following.prompt_token_ids[: len(context)] == context


def trajectory_counters(records: Sequence[CallRecord]) -> AggregationCounters:
    counters = AggregationCounters()
    settings = AggregationSettings(
        mode="trajectory", max_prompt_length=4096, max_response_length=4096
    )
    rollout_rows(RolloutSample("r", "g", 1.0, records), settings, counters)
    return counters
