"""Training rows from captured model calls: the committed calls of each finished rollout become
verl rows (prompt ids, response ids, a mask of the tokens the model produced, their rollout
logprobs, the reward), and a batch of rows becomes the `DataProto` verl's actor trains on.

Two modes. `transition`: one row per call. `trajectory`: calls whose prompt extends the row so
far (prompt + response) are merged into it; the tokens between (tool output, the next user
turn, template tokens) join the response with mask 0, so one forward pass covers the whole
conversation. A call that does not extend the row (the agent rewrote its history) starts a new
row. Every row of a rollout carries the rollout's reward on its last model token: each row is
a separate sequence for the loss, and a row without the reward would be trained towards the
group mean. Rows of one rollout share its GRPO `uid`, so a rollout split into k rows weighs k
times in its group's statistics; `merge_mismatches` shows how often that happens.

A rollout's first `masked_calls` calls (a branch's replayed prefix) are context only and make
no row in either mode: the first call after them sends them in its prompt, so its row starts
with them as context (cut from the left at `max_prompt_length`, as any prompt is) and they
take no room from the trained tokens in the response.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from verl import DataProto

from darl.gateway.store.record import CallRecord
from darl.trainer.errors import TrainerError
from darl.workflows.training_config import AggregationSpec


class AggregationError(TrainerError, ValueError):
    """The calls cannot be turned into training rows."""


class MissingLogprobsError(AggregationError):
    """A call came back without logprobs (or with fewer than tokens). The gateway forces
    logprobs on every call, so this is a bug or a misconfigured upstream, not a data issue."""


class EmptyBatchError(AggregationError):
    """No row survived (every response was empty): there is nothing to train on."""

    def __init__(self, message: str, counters: AggregationCounters | None = None) -> None:
        super().__init__(message)
        self.counters = counters


class AggregationSettings(AggregationSpec):
    """The run's `AggregationSpec` (its defaults and bounds) and the backend's pad token."""

    pad_token_id: int = 0


@dataclass(frozen=True)
class RolloutSample:
    """One finished rollout, as the trainer knows it."""

    rollout_id: str
    group_id: str
    """The GRPO group (rollouts of the same task); becomes verl's `uid`."""
    reward: float
    records: Sequence[CallRecord]
    """The committed calls of its final attempt, in order."""
    masked_calls: int = 0
    """How many of its first calls are context only, never trained (a branch's replayed
    prefix, for one)."""


@dataclass
class AggregationCounters:
    """What aggregation did to the calls; reported in the step metrics."""

    rollouts: int = 0
    rows: int = 0
    calls: int = 0
    merged_calls: int = 0
    """Calls appended to an earlier call's row (trajectory mode)."""
    merge_mismatches: int = 0
    """Calls that did not extend their row and started a new one (trajectory mode)."""
    truncated_prompts: int = 0
    truncated_responses: int = 0
    empty_rows: int = 0
    """Rows dropped because no model token was left in them."""
    calls_without_logprobs: int = 0
    length_finished_calls: int = 0
    """Calls the server stopped at its max_tokens (finish_reason "length")."""
    replayed_calls: int = 0
    """Calls a resumed attempt answered from an earlier attempt's record (rule 10)."""
    replay_normalized_calls: int = 0
    """Of them, those matched only under the rollout's normalizers (`replay_normalized`
    `drop`: their tokens are not trained)."""
    prefix_masked_calls: int = 0
    """Calls a rollout's `masked_calls` kept out of training (context in the next row's
    prompt)."""

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class TrainingRow:
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    """1 on tokens the model produced (trained on), 0 on tokens inserted between calls."""
    rollout_logprobs: list[float]
    """The sampling logprob of each response token; 0.0 where the mask is 0."""
    reward: float
    uid: str
    rollout_id: str


@dataclass
class _Draft:
    """A row being built, before truncation."""

    prompt: list[int]
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def extended_by(self, prompt: list[int]) -> bool:
        """Whether `prompt` starts with this row's prompt followed by its response."""
        p, r = len(self.prompt), len(self.response)
        return (
            len(prompt) >= p + r
            and prompt[:p] == self.prompt
            and prompt[p : p + r] == self.response
        )

    def append(self, tokens: list[int], mask: int, logprobs: list[float]) -> None:
        self.response += tokens
        self.mask += [mask] * len(tokens)
        self.logprobs += logprobs


def _completion(record: CallRecord, counters: AggregationCounters) -> tuple[list[int], list[float]]:
    """The call's completion ids and their logprobs; raises MissingLogprobsError."""
    ids = list(record.completion_token_ids())
    logprobs = record.completion_logprobs()
    if logprobs is None or len(logprobs) != len(ids):
        counters.calls_without_logprobs += 1
        got = "no logprobs" if logprobs is None else f"{len(logprobs)} logprobs"
        raise MissingLogprobsError(
            f"call {record.call_id} of rollout {record.rollout_id} has {got} for {len(ids)} "
            "completion tokens; training needs the sampling logprob of every token "
            "(the gateway requests them: check the upstream server's logprobs support)"
        )
    return ids, [float(x) for x in logprobs]


def _drafts(
    sample: RolloutSample, settings: AggregationSpec, counters: AggregationCounters
) -> list[_Draft]:
    mode = settings.mode
    drafts: list[_Draft] = []
    for index, record in enumerate(sample.records):
        counters.calls += 1
        if record.finish_reason() == "length":
            counters.length_finished_calls += 1
        counters.replayed_calls += record.replayed_from is not None
        counters.replay_normalized_calls += record.replay_normalized
        ids, logprobs = _completion(record, counters)
        if index < sample.masked_calls:
            counters.prefix_masked_calls += 1
            continue
        trained = 1
        if record.replay_normalized and settings.replay_normalized == "drop":
            trained, logprobs = 0, [0.0] * len(ids)
        prompt = list(record.prompt_token_ids)
        current = drafts[-1] if drafts and mode == "trajectory" else None
        if current is not None and current.extended_by(prompt):
            counters.merged_calls += 1
            between = prompt[len(current.prompt) + len(current.response) :]
            current.append(between, 0, [0.0] * len(between))
        else:
            if current is not None:
                counters.merge_mismatches += 1
            current = _Draft(prompt=prompt)
            drafts.append(current)
        current.append(ids, trained, logprobs)
    return drafts


def _finish(
    draft: _Draft,
    sample: RolloutSample,
    settings: AggregationSettings,
    counters: AggregationCounters,
) -> TrainingRow | None:
    """The draft truncated to the settings' limits; None when no model token is left."""
    prompt = draft.prompt
    if len(prompt) > settings.max_prompt_length:
        counters.truncated_prompts += 1
        prompt = prompt[-settings.max_prompt_length :]
    keep = settings.max_response_length
    if len(draft.response) > keep:
        counters.truncated_responses += 1
    mask = draft.mask[:keep]
    if not any(mask):
        counters.empty_rows += 1
        return None
    return TrainingRow(
        prompt_ids=prompt,
        response_ids=draft.response[:keep],
        response_mask=mask,
        rollout_logprobs=draft.logprobs[:keep],
        reward=float(sample.reward),
        uid=sample.group_id,
        rollout_id=sample.rollout_id,
    )


def rollout_rows(
    sample: RolloutSample, settings: AggregationSettings, counters: AggregationCounters
) -> list[TrainingRow]:
    """The training rows of one rollout, counted into `counters`. Raises MissingLogprobsError
    when a call has no logprobs. Rows with no model token left are dropped (`empty_rows`)."""
    counters.rollouts += 1
    rows = []
    for draft in _drafts(sample, settings, counters):
        row = _finish(draft, sample, settings, counters)
        if row is not None:
            rows.append(row)
    counters.rows += len(rows)
    return rows


def _last_model_token(row: TrainingRow) -> int:
    for i in range(len(row.response_mask) - 1, -1, -1):
        if row.response_mask[i]:
            return i
    raise AggregationError(f"a row of rollout {row.rollout_id} has no model token")


def to_data_proto(
    rows: Sequence[TrainingRow],
    settings: AggregationSettings,
    meta_info: dict[str, int] | None = None,
) -> DataProto:
    """The rows as the batch verl's actor and `core_algos` read.

    Prompts are left-padded and responses right-padded with `pad_token_id`, to the longest of
    the batch. Tensors: `prompts` [B,P], `responses` [B,R], `input_ids` [B,P+R],
    `attention_mask` and `position_ids` [B,P+R], `response_mask` [B,R] (int64, like
    `attention_mask` and verl's agent loop), `rollout_log_probs` and `old_log_probs` [B,R]
    float32 (the behaviour policy is the rollout policy), `token_level_scores` and
    `token_level_rewards` [B,R] float32 (the reward on the last model token). Non-tensors:
    `uid`, `rollout_id`. Raises EmptyBatchError for no rows.
    """
    if not rows:
        raise EmptyBatchError("no training rows")
    batch = len(rows)
    p = max(len(row.prompt_ids) for row in rows)
    r = max(len(row.response_ids) for row in rows)
    prompts = torch.full((batch, p), settings.pad_token_id, dtype=torch.int64)
    prompt_attention = torch.zeros((batch, p), dtype=torch.int64)
    responses = torch.full((batch, r), settings.pad_token_id, dtype=torch.int64)
    response_attention = torch.zeros((batch, r), dtype=torch.int64)
    response_mask = torch.zeros((batch, r), dtype=torch.int64)
    logprobs = torch.zeros((batch, r), dtype=torch.float32)
    scores = torch.zeros((batch, r), dtype=torch.float32)
    for i, row in enumerate(rows):
        n, m = len(row.prompt_ids), len(row.response_ids)
        if len(row.response_mask) != m or len(row.rollout_logprobs) != m:
            raise AggregationError(f"a row of rollout {row.rollout_id} has ragged response lists")
        if n:
            prompts[i, p - n :] = torch.tensor(row.prompt_ids, dtype=torch.int64)
            prompt_attention[i, p - n :] = 1
        responses[i, :m] = torch.tensor(row.response_ids, dtype=torch.int64)
        response_attention[i, :m] = 1
        response_mask[i, :m] = torch.tensor(row.response_mask, dtype=torch.int64)
        logprobs[i, :m] = torch.tensor(row.rollout_logprobs, dtype=torch.float32)
        scores[i, _last_model_token(row)] = row.reward
    attention_mask = torch.cat([prompt_attention, response_attention], dim=1)
    return DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0),
            "response_mask": response_mask,
            "rollout_log_probs": logprobs,
            "old_log_probs": logprobs.clone(),
            "token_level_scores": scores,
            "token_level_rewards": scores.clone(),
        },
        non_tensors={
            "uid": np.array([row.uid for row in rows], dtype=object),
            "rollout_id": np.array([row.rollout_id for row in rows], dtype=object),
        },
        meta_info=dict(meta_info or {}),
    )


def aggregate(
    samples: Sequence[RolloutSample], settings: AggregationSettings
) -> tuple[DataProto, AggregationCounters]:
    """One training batch from finished rollouts, with what aggregation did to them (also in
    the batch's `meta_info`). Raises MissingLogprobsError, and EmptyBatchError (carrying the
    counters) when no row is left."""
    counters = AggregationCounters()
    rows = [row for sample in samples for row in rollout_rows(sample, settings, counters)]
    if not rows:
        raise EmptyBatchError(
            f"no training rows from {len(samples)} rollouts ({counters.as_dict()})", counters
        )
    return to_data_proto(rows, settings, meta_info=counters.as_dict()), counters
