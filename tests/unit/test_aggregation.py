"""Aggregation of captured calls into verl rows: every model token is trained on exactly once
with its own logprob, inserted tokens never are, limits hold, and the batch goes through verl's
own advantage and policy-loss code."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from verl.trainer.ppo import core_algos
from verl.workers.config.actor import FSDPActorConfig

from darl.gateway.store.directory import DirectoryTrajectoryStore
from darl.gateway.store.record import CallRecord
from darl.trainer.aggregation import (
    AggregationCounters,
    AggregationSettings,
    EmptyBatchError,
    MissingLogprobsError,
    RolloutSample,
    TrainingRow,
    aggregate,
    rollout_rows,
)

SENTINEL = 10_000  # prompts that start over begin with a token no other prompt holds
UNLIMITED = {"max_prompt_length": 100_000, "max_response_length": 100_000}

tokens = st.lists(st.integers(0, 999), max_size=10)
answers = st.lists(st.integers(0, 999), min_size=1, max_size=10)
# (how the prompt relates to the row so far, tokens before the answer, the answer)
kinds = st.sampled_from(["extend", "extend", "fresh", "rewrite", "reprompt"])
steps = st.lists(st.tuples(kinds, tokens, answers), min_size=1, max_size=8)
endpoints = st.sampled_from(["chat.completions", "completions"])


def record(
    call: int,
    prompt: list[int],
    answer: list[int],
    logprobs: list[float] | None,
    endpoint: str = "chat.completions",
    rollout: str = "r1",
    finish: str = "stop",
) -> CallRecord:
    choice: dict = {"index": 0, "token_ids": answer, "finish_reason": finish}
    if logprobs is not None and endpoint == "chat.completions":
        choice["logprobs"] = {"content": [{"token": "t", "logprob": x} for x in logprobs]}
    elif logprobs is not None:
        choice["logprobs"] = {"token_logprobs": logprobs}
    return CallRecord(
        call_id=f"{rollout}-c{call}",
        rollout_id=rollout,
        attempt=1,
        sequence=call,
        endpoint=endpoint,  # type: ignore[arg-type]
        upstream="http://u",
        policy_version=1,
        created_at=1.0 + call,
        latency_ms=1.0,
        retry_count=0,
        streamed=False,
        request={"model": "m", "messages": [{"role": "user", "content": str(call)}]},
        response={"id": f"x{call}", "prompt_token_ids": prompt, "choices": [choice]},
        prompt_token_ids=prompt,
    )


def conversation(
    plan: list[tuple[str, list[int], list[int]]],
    endpoint: str = "chat.completions",
    rollout: str = "r1",
) -> list[CallRecord]:
    """Calls that `extend` the previous prompt + answer by `extra` tokens, start over
    (`fresh`), keep the row's prompt but `rewrite` the turns after it, or keep the turns but
    change the row's first token (`reprompt`, a system prompt with a clock in it). Every answer
    token gets a logprob of its own, so a misplaced one is seen."""
    records: list[CallRecord] = []
    row_prompt: list[int] = []
    for call, (kind, extra, answer) in enumerate(plan):
        if records and kind == "extend":
            prev = records[-1]
            prompt = prev.prompt_token_ids + prev.completion_token_ids() + extra
        elif records and kind == "rewrite":  # the sentinel differs from any answer token
            prompt = row_prompt = [*row_prompt, SENTINEL + call, *extra]
        elif records and kind == "reprompt":
            prev = records[-1]
            turns = prev.prompt_token_ids[1:] + prev.completion_token_ids() + extra
            prompt = [SENTINEL + call, *turns]
            row_prompt = [SENTINEL + call, *row_prompt[1:]]
        else:
            prompt = row_prompt = [SENTINEL + call, *extra]
        logprobs = [-(call * 100 + i + 1) / 1000 for i in range(len(answer))]
        records.append(record(call, prompt, answer, logprobs, endpoint, rollout))
    return records


def sample(records: list[CallRecord], reward: float = 1.0, group: str = "g") -> RolloutSample:
    return RolloutSample(
        rollout_id=records[0].rollout_id, group_id=group, reward=reward, records=records
    )


def model_tokens(records: list[CallRecord]) -> list[tuple[int, float]]:
    return [
        pair
        for r in records
        for pair in zip(r.completion_token_ids(), r.completion_logprobs() or [], strict=True)
    ]


def tokens_of(row: TrainingRow) -> list[tuple[int, int, float]]:
    return list(zip(row.response_ids, row.response_mask, row.rollout_logprobs, strict=True))


@settings(max_examples=150, deadline=None)
@given(steps, endpoints)
def test_trajectory_rows_hold_every_model_token_once_and_only_inserted_tokens_masked(
    plan: list, endpoint: str
) -> None:
    records = conversation(plan, endpoint)
    counters = AggregationCounters()
    rows = rollout_rows(sample(records), AggregationSettings(**UNLIMITED), counters)

    assert [(t, lp) for row in rows for t, m, lp in tokens_of(row) if m] == model_tokens(records)
    inserted = [(t, lp) for row in rows for t, m, lp in tokens_of(row) if not m]
    merged = [step for i, step in enumerate(plan) if i and step[0] == "extend"]
    assert inserted == [(t, 0.0) for _, extra, _ in merged for t in extra]
    mismatches = sum(1 for i, step in enumerate(plan) if i and step[0] != "extend")
    assert len(rows) == 1 + mismatches
    assert counters.merge_mismatches == mismatches
    assert counters.merged_calls == len(plan) - 1 - mismatches
    assert (counters.rows, counters.calls) == (len(rows), len(plan))
    groups: list[list[CallRecord]] = []
    for i, rec in enumerate(records):
        if i == 0 or plan[i][0] != "extend":
            groups.append([])
        groups[-1].append(rec)
    for row, group in zip(rows, groups, strict=True):
        assert row.prompt_ids == group[0].prompt_token_ids
        # a row is what its last call saw, plus that call's answer
        last = group[-1]
        whole = last.prompt_token_ids + last.completion_token_ids()
        assert row.prompt_ids + row.response_ids == whole
        assert len(row.response_ids) == len(row.response_mask) == len(row.rollout_logprobs)


@settings(max_examples=100, deadline=None)
@given(steps, endpoints)
def test_transition_rows_are_the_calls(plan: list, endpoint: str) -> None:
    records = conversation(plan, endpoint)
    counters = AggregationCounters()
    rows = rollout_rows(
        sample(records), AggregationSettings(mode="transition", **UNLIMITED), counters
    )
    assert len(rows) == len(records) == counters.rows
    assert sum(len(r.response_ids) for r in rows) == sum(
        len(r.completion_token_ids()) for r in records
    )
    for row, rec in zip(rows, records, strict=True):
        assert row.prompt_ids == rec.prompt_token_ids
        assert row.response_ids == rec.completion_token_ids()
        assert row.rollout_logprobs == rec.completion_logprobs()
        assert set(row.response_mask) == {1}
    assert counters.merged_calls == counters.merge_mismatches == 0


@settings(max_examples=150, deadline=None)
@given(
    steps,
    st.sampled_from(["transition", "trajectory"]),
    st.integers(1, 12),
    st.integers(1, 12),
)
def test_truncation_keeps_the_prompt_end_and_the_response_start_and_counts(
    plan: list, mode: str, max_prompt: int, max_response: int
) -> None:
    records = conversation(plan)
    whole = rollout_rows(
        sample(records), AggregationSettings(mode=mode, **UNLIMITED), AggregationCounters()
    )
    limits = AggregationSettings(
        mode=mode, max_prompt_length=max_prompt, max_response_length=max_response
    )
    counters = AggregationCounters()
    rows = rollout_rows(sample(records), limits, counters)

    assert len(rows) == len(whole)  # every row starts with a model token: none is emptied
    for row, full in zip(rows, whole, strict=True):
        assert row.prompt_ids == full.prompt_ids[-max_prompt:]
        assert row.response_ids == full.response_ids[:max_response]
        assert row.response_mask == full.response_mask[:max_response]
        assert row.rollout_logprobs == full.rollout_logprobs[:max_response]
    assert counters.truncated_prompts == sum(len(r.prompt_ids) > max_prompt for r in whole)
    assert counters.truncated_responses == sum(len(r.response_ids) > max_response for r in whole)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(steps, st.floats(-3, 3, allow_nan=False), st.sampled_from("abc")),
        min_size=1,
        max_size=5,
    ),
    st.sampled_from(["transition", "trajectory"]),
    st.integers(0, 50),
    st.sampled_from([3, 8, 100_000]),
)
def test_the_batch_is_padded_masked_and_rewarded_as_verl_reads_it(
    rollouts: list, mode: str, pad: int, max_response: int
) -> None:
    samples = [
        sample(conversation(plan, rollout=f"r{i}"), reward, group)
        for i, (plan, reward, group) in enumerate(rollouts)
    ]
    config = AggregationSettings(
        mode=mode, pad_token_id=pad, max_prompt_length=100_000, max_response_length=max_response
    )
    proto, counters = aggregate(samples, config)
    rows = [row for s in samples for row in rollout_rows(s, config, AggregationCounters())]

    b = proto.batch
    p, r = b["prompts"].shape[1], b["responses"].shape[1]
    assert p == max(len(row.prompt_ids) for row in rows)
    assert r == max(len(row.response_ids) for row in rows)
    assert len(proto) == len(rows) == counters.rows
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], dim=1))
    expected_positions = torch.clamp(torch.cumsum(b["attention_mask"], dim=1) - 1, min=0)
    assert torch.equal(b["position_ids"], expected_positions)
    assert torch.equal(b["old_log_probs"], b["rollout_log_probs"])
    assert torch.equal(b["token_level_rewards"], b["token_level_scores"])
    assert b["response_mask"].dtype == b["attention_mask"].dtype == torch.int64
    assert b["rollout_log_probs"].dtype == b["token_level_scores"].dtype == torch.float32
    for i, row in enumerate(rows):
        n, m = len(row.prompt_ids), len(row.response_ids)
        assert b["prompts"][i, p - n :].tolist() == row.prompt_ids
        assert set(b["prompts"][i, : p - n].tolist()) <= {pad}
        assert b["responses"][i, :m].tolist() == row.response_ids
        assert set(b["responses"][i, m:].tolist()) <= {pad}
        assert b["attention_mask"][i].tolist() == [0] * (p - n) + [1] * (n + m) + [0] * (r - m)
        assert b["response_mask"][i].tolist() == row.response_mask + [0] * (r - m)
        assert b["rollout_log_probs"][i].tolist() == pytest.approx(
            row.rollout_logprobs + [0.0] * (r - m)
        )
        last = max(j for j, flag in enumerate(row.response_mask) if flag)
        scores = b["token_level_scores"][i].tolist()
        assert scores[last] == pytest.approx(row.reward)
        assert all(s == 0.0 for j, s in enumerate(scores) if j != last)
    assert list(proto.non_tensor_batch["uid"]) == [row.uid for row in rows]
    assert proto.non_tensor_batch["uid"].dtype == object
    assert list(proto.non_tensor_batch["rollout_id"]) == [row.rollout_id for row in rows]
    assert proto.meta_info == counters.as_dict()


def test_a_batch_goes_through_verl_grpo_and_the_vanilla_policy_loss() -> None:
    plan = [("extend", [1, 2], [3, 4]), ("extend", [5], [6, 7, 8]), ("extend", [9, 9], [10])]
    samples = [
        sample(conversation(plan, rollout="same-1"), 1.0, "same"),
        sample(conversation(plan[:2], rollout="same-2"), 1.0, "same"),
        sample(conversation(plan, rollout="diff-1"), 0.0, "diff"),
        sample(conversation(plan[:1], rollout="diff-2"), 1.0, "diff"),
    ]
    proto, _ = aggregate(samples, AggregationSettings())
    b = proto.batch
    advantages, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=b["token_level_rewards"],
        response_mask=b["response_mask"],
        index=proto.non_tensor_batch["uid"],
    )
    model = b["response_mask"] == 1
    same = torch.tensor(proto.non_tensor_batch["uid"] == "same")
    assert torch.all(advantages[same] == 0)
    assert torch.all(advantages[~same][model[~same]] != 0)
    assert torch.all(advantages[~model] == 0)

    actor = FSDPActorConfig(rollout_n=2, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4)
    log_prob = torch.nn.Parameter(b["old_log_probs"] + 0.05)
    loss_fn = core_algos.get_policy_loss_fn("vanilla")
    loss, metrics = loss_fn(
        old_log_prob=b["old_log_probs"],
        log_prob=log_prob,
        advantages=advantages,
        response_mask=b["response_mask"],
        loss_agg_mode=actor.loss_agg_mode,
        config=actor,
    )
    loss.backward()
    assert log_prob.grad is not None
    assert torch.isfinite(log_prob.grad).all() and math.isfinite(loss.item())
    assert log_prob.grad[~same].abs().sum() > 0
    assert torch.all(log_prob.grad[~model] == 0)
    assert "actor/ppo_kl" in metrics


def test_a_call_without_logprobs_is_an_error() -> None:
    records = conversation([("extend", [1], [2, 3]), ("extend", [4], [5])])
    records[1] = record(1, records[1].prompt_token_ids, [5], None)
    counters = AggregationCounters()
    with pytest.raises(MissingLogprobsError, match="r1-c1"):
        rollout_rows(sample(records), AggregationSettings(), counters)
    assert counters.calls_without_logprobs == 1
    short = [record(0, [1], [2, 3], [-0.1])]
    with pytest.raises(MissingLogprobsError, match="1 logprobs for 2"):
        aggregate([sample(short)], AggregationSettings())


def test_rows_without_model_tokens_are_dropped_and_counted() -> None:
    empty = [record(0, [1, 2], [], []), record(1, [7], [8], [-0.2], finish="length")]
    counters = AggregationCounters()
    rows = rollout_rows(sample(empty), AggregationSettings(mode="transition"), counters)
    assert [row.response_ids for row in rows] == [[8]]
    assert (counters.empty_rows, counters.rows, counters.length_finished_calls) == (1, 1, 1)
    silent = [
        record(0, [1], [], []),
        record(1, [1, 5, 6], [], []),
        record(2, [1, 5, 6, 7], [9], [-1]),
    ]
    counters = AggregationCounters()
    assert rollout_rows(sample(silent[:2]), AggregationSettings(), counters) == []
    assert counters.empty_rows == 1
    cut = AggregationSettings(max_response_length=3)  # only inserted tokens are left
    assert rollout_rows(sample(silent), cut, AggregationCounters()) == []
    with pytest.raises(EmptyBatchError) as caught:
        aggregate([sample(empty[:1])], AggregationSettings())
    assert caught.value.counters is not None and caught.value.counters.empty_rows == 1


def test_records_read_back_from_the_store_aggregate_like_the_originals(tmp_path: Path) -> None:
    records = conversation([("extend", [1, 2], [3]), ("extend", [4], [5, 6]), ("fresh", [7], [8])])
    store = DirectoryTrajectoryStore(tmp_path)
    for rec in records:
        asyncio.run(store.append(rec))
    read = store.read_sync("r1", attempt=1, call_ids=[r.call_id for r in records])
    config = AggregationSettings()
    got = rollout_rows(sample(read), config, AggregationCounters())
    assert got == rollout_rows(sample(records), config, AggregationCounters())
    assert np.array_equal(
        aggregate([sample(read)], config)[0].batch["input_ids"].numpy(),
        aggregate([sample(records)], config)[0].batch["input_ids"].numpy(),
    )


def test_a_replayed_trajectory_trains_as_the_calls_it_reproduces() -> None:
    """Rule 10: calls a resumed attempt replayed carry the recorded tokens and logprobs, so
    the rows equal those of the original calls plus the live ones, and are counted."""
    original = conversation([("fresh", [1], [2, 3]), ("extend", [4], [5]), ("extend", [6], [7])])
    replayed = [
        replace(r, call_id=f"again-{r.call_id}", attempt=2, replayed_from=r.call_id)
        for r in original[:2]
    ]
    settings = AggregationSettings(**UNLIMITED)
    counters = AggregationCounters()
    resumed = rollout_rows(sample([*replayed, original[2]]), settings, counters)
    assert resumed == rollout_rows(sample(original), settings, AggregationCounters())
    assert (counters.replayed_calls, counters.replay_normalized_calls) == (2, 0)


@pytest.mark.parametrize("mode", ["trajectory", "transition"])
def test_normalized_replays_are_kept_or_left_untrained(mode: str) -> None:
    calls = conversation([("fresh", [1], [2, 3]), ("extend", [4], [5, 6]), ("extend", [7], [8])])
    calls[1] = replace(calls[1], replayed_from="c", replay_normalized=True)
    keep = AggregationSettings(mode=mode, **UNLIMITED)
    drop = AggregationSettings(mode=mode, replay_normalized="drop", **UNLIMITED)
    kept = rollout_rows(sample(calls), keep, AggregationCounters())
    counters = AggregationCounters()
    dropped = rollout_rows(sample(calls), drop, counters)
    assert counters.replay_normalized_calls == 1
    trained = [
        t for row in dropped for t, m in zip(row.response_ids, row.response_mask, strict=True) if m
    ]
    assert trained == [2, 3, 8]
    assert sum(sum(row.response_mask) for row in kept) == 5
    if mode == "trajectory":
        # Left in the row as context: the same conversation, its tokens not trained.
        assert [r.response_ids for r in dropped] == [r.response_ids for r in kept]
    else:
        assert len(dropped) == 2 and counters.empty_rows == 1
