"""Replay's parts (rule 10): the canonical form a request is matched by, the normalizers, the
session that hands each recorded call out at most once, the outcome the close reports, a
recorded answer as a stream in every protocol, and what the token and the store carry."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from darl.gateway.calls.delivery import EventDelivery
from darl.gateway.calls.replay import (
    ReplayBook,
    ReplaySession,
    canonical_form,
    check_lineage,
    offered_calls,
    replay_outcome,
)
from darl.gateway.calls.replayer import Replayer
from darl.gateway.calls.rollouts import RolloutRegistry
from darl.gateway.errors import GatewayError
from darl.gateway.metrics import GatewayMetrics
from darl.gateway.protocols.chat.capture import StreamAssembler, answer_chunks
from darl.gateway.protocols.responses.translation import _previous as previous_conversation
from darl.gateway.protocols.responses.translation import answered_messages
from darl.gateway.store.codec import Tail, decode_record, encode_record
from darl.gateway.store.directory import DirectoryTrajectoryStore
from darl.gateway.store.record import CallRecord
from darl.workflows.contracts import ReplaySpec
from darl.workflows.replay_normalizers import Normalizer
from darl.workflows.rollout_token import (
    PrefixClaim,
    ReplayClaim,
    TokenClaims,
    mint_token,
    verify_token,
)
from tests.unit.test_protocol_streams import (
    ADD,
    CALL_ID,
    CASES,
    anthropic_reading,
    chat_chunks,
    messages_with_a_tool,
    openai_reading,
    responses_with_a_tool,
    translated,
    without_none,
)

CHAT = "chat.completions"


def request(*turns: str, **fields: Any) -> dict[str, Any]:
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)
    ]
    return {"model": "tiny", "messages": messages, "max_tokens": 8, **fields}


def record(call_id: str, req: dict[str, Any], attempt: int = 1, **fields: Any) -> CallRecord:
    return CallRecord(
        call_id=call_id,
        rollout_id=fields.pop("rollout_id", "r"),
        attempt=attempt,
        sequence=fields.pop("sequence", 0),
        endpoint=CHAT,
        upstream="http://policy",
        policy_version=3,
        created_at=0.0,
        latency_ms=1.0,
        retry_count=0,
        streamed=False,
        request=req,
        response={
            "id": f"chatcmpl-{call_id}",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": call_id},
                    "finish_reason": "stop",
                    "token_ids": [7],
                    "logprobs": {"content": [{"token": "x", "logprob": -0.1}]},
                }
            ],
            "prompt_token_ids": [1, 2],
        },
        prompt_token_ids=[1, 2],
        **fields,
    )


# --- the canonical form ----------------------------------------------------------------


def test_key_order_spacing_model_and_streaming_do_not_count() -> None:
    a = request("hi", temperature=1.0, top_p=0.9)
    b = {k: a[k] for k in reversed(list(a))} | {"model": "other", "stream": True}
    b["stream_options"] = {"include_usage": True}
    assert canonical_form("chat.completions", CHAT, a) == canonical_form(
        "chat.completions", CHAT, b
    )


@pytest.mark.parametrize(
    "change",
    [
        {"max_tokens": 9},
        {"top_p": 0.5},
        {"tool_choice": "required"},
        {"tools": [{"type": "function", "function": {"name": "add", "parameters": ADD}}]},
        {"messages": [{"role": "user", "content": "hi "}]},
    ],
)
def test_every_field_the_agent_sets_counts(change: dict[str, Any]) -> None:
    a = request("hi")
    assert canonical_form(CHAT, CHAT, a) != canonical_form(CHAT, CHAT, {**a, **change})


def test_the_protocol_counts() -> None:
    a = request("hi")
    assert canonical_form(CHAT, CHAT, a) != canonical_form("responses", CHAT, a)


def test_a_normalizer_blanks_only_its_spans_in_message_text() -> None:
    durations = Normalizer(("durations",))
    a = request("=== 3 passed in 0.53s ===")
    b = request("=== 3 passed in 1.20s ===")
    c = request("=== 4 passed in 0.53s ===")
    parts = request("x")
    parts["messages"][0]["content"] = [{"type": "text", "text": "took 12 ms"}]
    parts_later = copy.deepcopy(parts)
    parts_later["messages"][0]["content"][0]["text"] = "took 9 ms"
    assert canonical_form(CHAT, CHAT, a) != canonical_form(CHAT, CHAT, b)
    assert canonical_form(CHAT, CHAT, a, durations) == canonical_form(CHAT, CHAT, b, durations)
    assert canonical_form(CHAT, CHAT, a, durations) != canonical_form(CHAT, CHAT, c, durations)
    assert canonical_form(CHAT, CHAT, parts, durations) == canonical_form(
        CHAT, CHAT, parts_later, durations
    )


@pytest.mark.parametrize(
    ("preset", "first", "second"),
    [
        ("iso_timestamps", "at 2026-12-03T07:38:41.123Z", "at 2026-12-04 01:02:03+00:00"),
        ("temp_paths", "wrote /tmp/pytest-of-root/pytest-3/a", "wrote /tmp/tmpa1b2c3/a"),
        ("hex_ids", "object at 0x7f3a9c2e", "object at 0x55d1"),
        ("pids", "worker pid 4242 up", "worker pid 17 up"),
    ],
)
def test_the_presets(preset: str, first: str, second: str) -> None:
    normalizer = Normalizer((preset,))
    assert normalizer.apply(first) == normalizer.apply(second)
    assert normalizer.apply("3 passed") == "3 passed"


def test_a_spec_names_known_presets_and_compiling_patterns() -> None:
    assert ReplaySpec(normalize=["durations"], patterns=[r"run-\d+"]).patterns == [r"run-\d+"]
    with pytest.raises(ValidationError, match="unknown normalizer"):
        ReplaySpec(normalize=["timestamps"])
    with pytest.raises(ValidationError, match="does not compile"):
        ReplaySpec(patterns=["(unclosed"])
    with pytest.raises(ValidationError, match="at most"):
        ReplaySpec(patterns=["x"] * 17)


# --- the session -------------------------------------------------------------------------


def session(source: list[CallRecord], done: list[CallRecord] | None = None, **claim: Any):
    return ReplaySession(ReplayClaim(sources=(1,), **claim), source, done or [])


def test_each_recorded_call_is_used_once_first_unused_first() -> None:
    same = request("hi")
    replay = session([record("a", same), record("b", same, sequence=1)])
    assert replay.take(CHAT, CHAT, same).recorded.record.call_id == "a"
    assert replay.take(CHAT, CHAT, same).recorded.record.call_id == "b"
    # The record is used up: the third goes live, and that is no divergence.
    assert replay.take(CHAT, CHAT, same) is None and not replay.diverged


def test_concurrent_requests_match_by_content_not_by_position() -> None:
    left, right = request("left"), request("right")
    replay = session([record("l", left), record("r", right, sequence=1)])
    assert replay.take(CHAT, CHAT, right).recorded.record.call_id == "r"
    assert replay.take(CHAT, CHAT, left).recorded.record.call_id == "l"


def test_a_request_the_record_lacks_diverges_and_a_live_answer_ends_the_replay() -> None:
    replay = session([record("a", request("a")), record("b", request("b"), sequence=1)])
    assert replay.take(CHAT, CHAT, request("clock 12:01")) is None
    assert replay.diverged
    # A sibling already sent (before any live answer) still matches its record...
    assert replay.take(CHAT, CHAT, request("a")) is not None
    # ... but once a live answer reached the agent, nothing more is served from the record.
    replay.end_replay()
    assert replay.take(CHAT, CHAT, request("b")) is None


def test_a_call_that_could_not_be_recorded_is_offered_again() -> None:
    replay = session([record("a", request("a"))])
    match = replay.take(CHAT, CHAT, request("a"))
    assert match is not None and replay.take(CHAT, CHAT, request("a")) is None
    replay.give_back(match)
    assert replay.take(CHAT, CHAT, request("a")).recorded.record.call_id == "a"


def test_a_session_carries_on_from_what_the_store_holds() -> None:
    """A restarted gateway or another replica: the attempt's records say which recorded calls
    are used, and whether a live call was answered."""
    source = [record("a", request("a")), record("b", request("b"), sequence=1)]
    used = [record("x", request("a"), attempt=2, replayed_from="a")]
    replay = session(source, used)
    assert replay.take(CHAT, CHAT, request("a")) is None
    assert replay.take(CHAT, CHAT, request("b")).recorded.record.call_id == "b"
    live = [*used, record("y", request("z"), attempt=2, sequence=1)]
    assert session(source, live).take(CHAT, CHAT, request("b")) is None


def test_under_a_normalizer_a_strictly_equal_record_goes_first() -> None:
    first, second = request("passed in 0.50s"), request("passed in 0.70s")
    replay = session(
        [record("a", first), record("b", second, sequence=1)], normalize=("durations",)
    )
    match = replay.take(CHAT, CHAT, second)
    assert match.recorded.record.call_id == "b" and not match.normalized
    match = replay.take(CHAT, CHAT, request("passed in 0.90s"))
    assert match.recorded.record.call_id == "a" and match.normalized


async def test_the_outcome_says_where_the_replay_ended(tmp_path: Path) -> None:
    store = DirectoryTrajectoryStore(tmp_path)
    for i, name in enumerate("abc"):
        await store.append(record(name, request(name), sequence=i))
    used_all = [
        record(f"n{n}", request(n), 2, sequence=i, replayed_from=n) for i, n in enumerate("abc")
    ]
    outcome = await replay_outcome(
        store, "r", [1], [*used_all, record("live", request("d"), 2, sequence=3)]
    )
    assert (outcome.recorded, outcome.replayed, outcome.diverged_at) == (3, 3, None)
    diverged = [*used_all[:2], record("live", request("zz"), 2, sequence=2)]
    outcome = await replay_outcome(store, "r", [1], diverged)
    assert (outcome.replayed, outcome.diverged_at) == (2, 2)
    # An agent that ended with recorded calls unused diverged after its last call.
    assert (await replay_outcome(store, "r", [1], used_all[:1])).diverged_at == 1


# --- a recorded answer, streamed ----------------------------------------------------------


def assembled(chunks: list[dict[str, Any]], endpoint: str = CHAT) -> dict[str, Any]:
    assembler = StreamAssembler(endpoint)  # type: ignore[arg-type]
    for chunk in chunks:
        assembler.add(chunk)
    assert assembler.finished
    response = assembler.response()
    if endpoint == CHAT and response["prompt_token_ids"] is None:
        # The "empty" case's chunks carry no prompt (vLLM's first chunk always does).
        response["prompt_token_ids"] = [1, 2, 3]
    return response


@pytest.mark.parametrize("case", list(CASES))
def test_a_recorded_chat_answer_streams_back_to_itself(case: str) -> None:
    recorded = assembled(chat_chunks(*CASES[case]))
    again = assembled(answer_chunks(CHAT, recorded, include_usage=True, with_prompt_ids=True))
    assert again.pop("usage") == {
        "prompt_tokens": 3,
        "completion_tokens": len(recorded["choices"][0]["token_ids"]),
        "total_tokens": 3 + len(recorded["choices"][0]["token_ids"]),
    }
    assert again == recorded


def test_a_recorded_completion_with_two_choices_streams_back_to_itself() -> None:
    def choice(i: int) -> dict[str, Any]:
        return {
            "index": i,
            "text": f"answer {i}",
            "finish_reason": "length",
            "token_ids": [5 + i, 6],
            "prompt_token_ids": [1, 2, 3],
            "logprobs": {
                "tokens": ["a", "b"],
                "token_logprobs": [-0.5, -1.0],
                "top_logprobs": [],
                "text_offset": [0, 1],
            },
        }

    recorded = {
        "id": "cmpl-1",
        "created": 1,
        "model": "tiny",
        "object": "text_completion",
        "choices": [choice(0), choice(1)],
    }
    again = assembled(
        answer_chunks("completions", recorded, include_usage=False, with_prompt_ids=True),
        "completions",
    )
    assert again == recorded


@pytest.mark.parametrize("case", list(CASES))
def test_a_recorded_answer_streams_in_the_responses_protocol(case: str) -> None:
    recorded = assembled(chat_chunks(*CASES[case]))
    translation = responses_with_a_tool()
    body, _ = translated(
        translation, answer_chunks(CHAT, recorded, include_usage=False, with_prompt_ids=True)
    )
    with openai_reading(body).responses.stream(model="m", input="hi") as stream:
        events = list(stream)
    final = events[-1].response  # type: ignore[union-attr]
    whole = translation.answer(recorded, CALL_ID)
    got = [o.model_dump(mode="json", by_alias=True) for o in final.output]
    assert without_none(got) == without_none(whole["output"])
    assert final.id == whole["id"]


@pytest.mark.parametrize("case", list(CASES))
def test_a_recorded_answer_streams_in_the_messages_protocol(case: str) -> None:
    recorded = assembled(chat_chunks(*CASES[case]))
    translation = messages_with_a_tool()
    body, _ = translated(
        translation, answer_chunks(CHAT, recorded, include_usage=False, with_prompt_ids=True)
    )
    with anthropic_reading(body).messages.stream(
        model="m", max_tokens=10, messages=[{"role": "user", "content": "hi"}]
    ) as events:
        final = events.get_final_message()
    whole = translation.answer(recorded, CALL_ID)
    assert without_none([b.model_dump(mode="json") for b in final.content]) == without_none(
        whole["content"]
    )
    assert (final.id, final.stop_reason) == (whole["id"], whole["stop_reason"])


# --- what the token and the store carry ---------------------------------------------------


def test_the_token_carries_the_replay_claim() -> None:
    claim = ReplayClaim(sources=(2, 1), normalize=("durations",), patterns=(r"run-\d+",))
    claims = TokenClaims("r", 3, "train", 2_000_000_000, replay=claim)
    assert verify_token(b"s", mint_token(b"s", claims), 0).replay == claim
    plain = TokenClaims("r", 1, "train", 2_000_000_000)
    assert verify_token(b"s", mint_token(b"s", plain), 0).replay is None
    branch = ReplayClaim(sources=(), prefix=PrefixClaim("seed", 2, 5))
    claims = TokenClaims("r", 1, "train", 2_000_000_000, replay=branch)
    assert verify_token(b"s", mint_token(b"s", claims), 0).replay == branch


def test_the_store_keeps_what_a_record_reproduces() -> None:
    replayed = record("n", request("a"), 2, replayed_from="a", replay_normalized=True)
    line = encode_record(replayed, Tail())
    assert decode_record(line, Tail()) == replayed
    plain = encode_record(record("a", request("a")), Tail())
    assert "replayed_from" not in plain and "replay_normalized" not in plain
    assert decode_record(plain, Tail()).replayed_from is None


async def test_an_attempt_lost_mid_replay_hands_on_what_it_had_yet_to_replay(
    tmp_path: Path,
) -> None:
    """Attempt 1 made 3 calls; attempt 2 replayed the first and was lost: attempt 3 is offered
    attempt 2's call and attempt 1's other two. Had attempt 2 gone live, attempt 1's leftovers
    would belong to a run that no longer exists."""
    store = DirectoryTrajectoryStore(tmp_path)
    for i, name in enumerate("abc"):
        await store.append(record(name, request(name), sequence=i))
    await store.append(record("a2", request("a"), 2, replayed_from="a"))
    offered = await offered_calls(store, "r", [2, 1])
    assert [r.call_id for r in offered] == ["a2", "b", "c"]
    outcome = await replay_outcome(store, "r", [2, 1], [])
    assert (outcome.sources, outcome.recorded, outcome.diverged_at) == ([2, 1], 3, 0)
    await store.append(record("live", request("x"), 2, sequence=1))
    assert [r.call_id for r in await offered_calls(store, "r", [2, 1])] == ["a2", "live"]


@pytest.mark.parametrize("sources", [[], [1, 2], [3, 1], [0], [2, 2]])
def test_a_lineage_names_distinct_earlier_attempts_newest_first(sources: list[int]) -> None:
    with pytest.raises(GatewayError, match="cannot replay"):
        check_lineage(sources, 3)
    check_lineage([2, 1], 3)
    if sources:
        with pytest.raises(GatewayError, match="cannot replay"):
            check_lineage(sources, 3, PrefixClaim("seed", 1, 2))
    # A branch's first attempt replays only the prefix it starts from.
    check_lineage([], 1, PrefixClaim("seed", 1, 2))


def seed_record(call_id: str, text: str, sequence: int) -> CallRecord:
    return record(call_id, request(text), sequence=sequence, rollout_id="seed")


async def test_a_branch_is_offered_the_first_calls_of_the_rollout_it_starts_from(
    tmp_path: Path,
) -> None:
    """Its first attempt gets the seed's first k calls; the close counts how many of the
    branch's first calls reproduce them, and where it left them early."""
    store = DirectoryTrajectoryStore(tmp_path)
    for i, name in enumerate("abcd"):
        await store.append(seed_record(name, name, i))
    prefix = PrefixClaim("seed", 1, 3)
    assert [r.call_id for r in await offered_calls(store, "r", [], prefix)] == ["a", "b", "c"]
    whole = [record(f"n{n}", request(n), sequence=i, replayed_from=n) for i, n in enumerate("abc")]
    live = record("live", request("z"), sequence=3)
    outcome = await replay_outcome(store, "r", [], [*whole, live], prefix)
    assert (outcome.recorded, outcome.replayed, outcome.diverged_at) == (3, 3, None)
    assert outcome.prefix_calls == 3
    left_early = [*whole[:2], record("live", request("z"), sequence=2)]
    outcome = await replay_outcome(store, "r", [], left_early, prefix)
    assert (outcome.prefix_calls, outcome.diverged_at) == (2, 2)
    # A prefix longer than the seed's record offers what there is.
    assert len(await offered_calls(store, "r", [], PrefixClaim("seed", 1, 9))) == 4
    assert await offered_calls(store, "r", [], PrefixClaim("gone", 1, 2)) == []


async def test_a_branch_lost_mid_prefix_hands_on_its_record_and_the_rest_of_the_prefix(
    tmp_path: Path,
) -> None:
    """Attempt 1 of a branch replayed 2 of the seed's 3 prefix calls and was lost: attempt 2
    is offered those 2 and the third; once attempt 1 had a live call, its record alone. The
    close follows the chain back: attempt 2's calls that replay attempt 1's prefix calls
    reproduce the prefix too, a replayed live call does not."""
    store = DirectoryTrajectoryStore(tmp_path)
    for i, name in enumerate("abcd"):
        await store.append(seed_record(name, name, i))
    prefix = PrefixClaim("seed", 1, 3)
    for i, name in enumerate("ab"):
        await store.append(record(f"{name}1", request(name), sequence=i, replayed_from=name))
    offered = await offered_calls(store, "r", [1], prefix)
    assert [r.call_id for r in offered] == ["a1", "b1", "c"]
    await store.append(record("c1", request("c"), sequence=2, replayed_from="c"))
    await store.append(record("x1", request("x"), sequence=3))
    offered = await offered_calls(store, "r", [1], prefix)
    assert [r.call_id for r in offered] == ["a1", "b1", "c1", "x1"]
    again = [
        record(f"{r.call_id}2", request(r.call_id), 2, sequence=i, replayed_from=r.call_id)
        for i, r in enumerate(offered)
    ]
    outcome = await replay_outcome(store, "r", [1], again, prefix)
    assert (outcome.replayed, outcome.prefix_calls, outcome.diverged_at) == (4, 3, None)


def test_a_normalizer_applies_each_expression_on_its_own() -> None:
    """Inline flags, a group name twice, a backreference: each pattern is its own."""
    spec = ReplaySpec(patterns=[r"(?i)took \d+", r"(?P<n>\d+)-(?P=n)", r"(?P<n>x)y"])
    normalizer = Normalizer(tuple(spec.normalize), tuple(spec.patterns))
    assert normalizer.apply("TOOK 12, 7-7 and xy") == "␀, ␀ and ␀"


@pytest.mark.parametrize(
    ("preset", "kept"),
    [
        ("hex_ids", "pi is 31415926 to 8 digits"),
        ("pids", "arr[42] = 1"),
        ("durations", "the door is 5 m away"),
    ],
)
def test_the_presets_keep_what_changes_an_answer(preset: str, kept: str) -> None:
    assert Normalizer((preset,)).apply(kept) == kept


def replayer_over(store: DirectoryTrajectoryStore) -> Replayer:
    """A replayer on `store` that serves strict matches only (no policy server to tokenize)."""
    registry = RolloutRegistry(None, store)  # type: ignore[arg-type]
    metrics = GatewayMetrics()
    delivery = EventDelivery(registry, store, metrics, interval_seconds=3600)

    async def no_tokenizer(*_: Any) -> list[int]:
        raise AssertionError("a strict match needs no tokenizer")

    return Replayer(ReplayBook(store), store, registry, delivery, metrics, no_tokenizer)


async def test_a_call_whose_record_may_have_been_written_is_never_offered_again(
    tmp_path: Path,
) -> None:
    """A store that fails the append (it may have written the record: an S3 PUT whose answer
    was lost): the agent's retry goes live instead of getting the same recorded call twice."""
    store = DirectoryTrajectoryStore(tmp_path)
    await store.append(record("a", request("a")))

    class FailingAppends(DirectoryTrajectoryStore):
        async def append(self, record: CallRecord) -> CallRecord:
            raise OSError("the append's answer was lost")

    replayer = replayer_over(FailingAppends(tmp_path))
    claims = TokenClaims("r", 2, "train", 2**31, replay=ReplayClaim(sources=(1,)))
    forwarded = request("a")
    with pytest.raises(OSError):
        await replayer.answer(CHAT, claims, forwarded, None, stream=False, prompt_ids_asked=False)
    assert (
        await replayer.answer(CHAT, claims, forwarded, None, stream=False, prompt_ids_asked=False)
        is None
    )


async def test_a_replayed_answer_holds_the_prompt_ids_only_if_the_agent_asked(
    tmp_path: Path,
) -> None:
    """As live (see `answer_as_asked`): whole or streamed, the recorded prompt's ids go back
    only to an agent that asked for them; the store keeps them either way."""
    store = DirectoryTrajectoryStore(tmp_path)
    await store.append(record("a", request("a")))
    replayer = replayer_over(store)

    async def replayed(attempt: int, stream: bool, asked: bool) -> bytes:
        claims = TokenClaims("r", attempt, "train", 2**31, replay=ReplayClaim(sources=(1,)))
        answer = await replayer.answer(
            CHAT, claims, request("a"), None, stream=stream, prompt_ids_asked=asked
        )
        assert answer is not None
        if not stream:
            return bytes(answer.body)
        return b"".join([part async for part in answer.body_iterator])  # type: ignore[attr-defined]

    assert json.loads(await replayed(2, False, False))["prompt_token_ids"] is None
    assert json.loads(await replayed(3, False, True))["prompt_token_ids"] == [1, 2]
    for attempt, asked, ids in ((4, False, None), (5, True, [1, 2])):
        events = (await replayed(attempt, True, asked)).split(b"\n\n")
        first = json.loads(events[0].removeprefix(b"data: "))
        assert first["prompt_token_ids"] == ids
    kept = await store.read("r")
    assert [r.attempt for r in kept] == [1, 2, 3, 4, 5]
    assert all(r.prompt_token_ids == [1, 2] for r in kept)


async def test_a_replayed_messages_stream_counts_its_prompt_whatever_the_agent_asked(
    tmp_path: Path,
) -> None:
    """A translation reads the prompt's size from the recorded ids: they reach it even though
    an Anthropic agent never asks for `return_token_ids`."""
    store = DirectoryTrajectoryStore(tmp_path)
    await store.append(replace(record("a", request("hi")), protocol="messages"))
    claims = TokenClaims("r", 2, "train", 2**31, replay=ReplayClaim(sources=(1,)))
    answer = await replayer_over(store).answer(
        CHAT, claims, request("hi"), messages_with_a_tool(), stream=True, prompt_ids_asked=False
    )
    assert answer is not None
    body = b"".join([part async for part in answer.body_iterator])  # type: ignore[attr-defined]
    with anthropic_reading(body).messages.stream(
        model="m", max_tokens=10, messages=[{"role": "user", "content": "hi"}]
    ) as events:
        started = next(e for e in events if e.type == "message_start")
    assert started.message.usage.input_tokens == 2  # the record's [1, 2]


async def test_a_branch_continues_a_responses_conversation_it_was_replayed(
    tmp_path: Path,
) -> None:
    """A branch's agent got a seed's Responses answer under the seed's response id: its next
    request's `previous_response_id` names it, and the conversation read back is the branch's
    own record of it (the seed's rollout is not the branch's)."""
    store = DirectoryTrajectoryStore(tmp_path)
    seed_id = "a" * 32
    seed = replace(seed_record(seed_id, "hello", 0), protocol="responses")
    mine = replace(
        record("b" * 32, request("hello"), replayed_from=seed_id),
        protocol="responses",
        exchange={"answered_as": seed_id},
    )
    await store.append(seed)
    await store.append(mine)
    branch = ReplayClaim(sources=(), prefix=PrefixClaim("seed", 1, 1))
    claims = TokenClaims("r", 1, "train", 2_000_000_000, replay=branch)
    history = await previous_conversation(store, claims, f"resp_{seed_id}")
    assert history == answered_messages(mine)
    with pytest.raises(GatewayError, match="not found in this rollout"):
        await previous_conversation(store, replace(claims, replay=None), f"resp_{seed_id}")
