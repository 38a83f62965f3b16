"""The trajectory stores: whatever is appended reads back whole and in order, across a
restart, while prompts are stored as deltas. The contract tests run against both backends: the
directory store and the S3 store (against moto's S3 emulator, tests/s3_emulator.py)."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from darl.gateway import json_codec
from darl.gateway.protocols.chat.sent_messages import SentMessages, read_chat
from darl.gateway.store.base import TrajectoryStore
from darl.gateway.store.codec import Tail, encode_record, new_messages
from darl.gateway.store.directory import DirectoryTrajectoryStore
from darl.gateway.store.record import CallRecord
from darl.gateway.store.s3 import S3TrajectoryStore

token_lists = st.lists(st.integers(0, 200), max_size=12)


@dataclass
class Backend:
    """Opens stores of one backend: `fresh()` names a new empty place, `open(place)` a store
    over it (a second `open` of the same place is a restarted or another gateway)."""

    name: str
    fresh: Callable[[], Any]
    open: Callable[..., TrajectoryStore]


@pytest.fixture(scope="module", params=["directory", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Backend:
    if request.param == "directory":
        return Backend(
            "directory",
            lambda: tmp_path_factory.mktemp("store"),
            lambda root, **kw: DirectoryTrajectoryStore(root, **kw),
        )
    bucket = request.getfixturevalue("s3_emulator").new_bucket()
    prefixes = (f"store-{n}" for n in itertools.count())

    def open_s3(prefix: str, fsync: bool = False, **kw: Any) -> TrajectoryStore:
        # Every S3 PUT is durable when it returns: no fsync.
        return S3TrajectoryStore(bucket, prefix, **kw)

    return Backend("s3", lambda: next(prefixes), open_s3)


def chat_record(
    call: int, prompt: list[int], answer: list[int], messages: list[dict]
) -> CallRecord:
    return CallRecord(
        call_id=f"c{call}",
        rollout_id="r1",
        attempt=1,
        sequence=-1,
        endpoint="chat.completions",
        upstream="http://u",
        policy_version=3,
        created_at=1.0 + call,
        latency_ms=2.5,
        retry_count=0,
        streamed=False,
        request={"model": "m", "messages": messages, "temperature": 1.0},
        response={
            "id": f"x{call}",
            "prompt_token_ids": prompt,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "t"},
                    "token_ids": answer,
                    "logprobs": {"content": [{"token": "t", "logprob": -0.5}] * len(answer)},
                }
            ],
        },
        prompt_token_ids=prompt,
    )


def conversation(steps: list[tuple[bool, list[int], list[int]]]) -> list[CallRecord]:
    """Calls where each prompt usually extends the previous prompt + answer (a multi-turn
    agent), and sometimes starts over (a mismatch)."""
    records: list[CallRecord] = []
    prompt: list[int] = []
    messages: list[dict] = []
    for call, (extends, new_tokens, answer) in enumerate(steps):
        if extends and records:
            prev = records[-1]
            prompt = prev.prompt_token_ids + prev.completion_token_ids() + new_tokens
            messages = [*messages, {"role": "user", "content": f"turn {call}"}]
        else:
            prompt = new_tokens
            messages = [{"role": "user", "content": f"fresh {call}"}]
        records.append(chat_record(call, prompt, answer, messages))
    return records


# How another client writes a conversation: other spacing, or indented over many lines.
WRITTEN = {
    "compact": {"separators": (",", ":")},
    "spaced": {"separators": (", ", ": ")},
    "indented": {"indent": 2},
}


def as_sent(record: CallRecord, written: str = "compact") -> CallRecord:
    """`record` as the gateway makes it of a chat call that came as the agent sent it: with
    its messages as the JSON they were read from, `written` as in WRITTEN."""
    request = read_chat(json.dumps(record.request, **WRITTEN[written]).encode())
    assert request is not None and isinstance(request["messages"], SentMessages)
    return replace(record, request=request, sent_messages=request["messages"])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), token_lists, token_lists), min_size=1, max_size=8),
    st.integers(0, 8),
    st.lists(st.sampled_from([None, *WRITTEN]), min_size=8, max_size=8),
)
def test_records_read_back_whole_across_a_restart(
    backend: Backend, steps: list, restart_at: int, sent: list[str | None]
) -> None:
    """Whatever the calls: extending or starting over, read or sent (in either spacing), with
    a restart anywhere."""
    root = backend.fresh()
    records = [
        record if how is None else as_sent(record, how)
        for record, how in zip(conversation(steps), sent, strict=False)
    ]

    async def write() -> None:
        store = backend.open(root)
        for i, record in enumerate(records):
            if i == restart_at:
                store = backend.open(root)  # a gateway restart: cold tail cache
            stored = await store.append(record)
            assert stored.sequence == i

    asyncio.run(write())
    read = backend.open(root).read_sync("r1")
    assert [r.sequence for r in read] == list(range(len(records)))
    for got, want in zip(read, records, strict=True):
        assert got.prompt_token_ids == want.prompt_token_ids
        assert got.completion_token_ids() == want.completion_token_ids()
        assert got.completion_logprobs() == [-0.5] * len(want.completion_token_ids())
        assert got.request == want.request
        assert got.response == want.response


def test_what_the_policy_server_wrote_reads_back_as_written(backend: Backend) -> None:
    """A logprob of -Infinity (valid to Python's json, not to JSON) and non-ASCII text, as a
    policy server's answer carries them, survive the store's JSON (orjson, which would write
    the infinity as null)."""
    answer = json_codec.loads(
        b'{"id": "x0", "prompt_token_ids": [1, 2], "choices": [{"index": 0, "message": '
        b'{"role": "assistant", "content": "\\u00e9t\\u00e9"}, "token_ids": [7], "logprobs": '
        b'{"content": [{"token": "\\u00e9", "logprob": -Infinity}]}}]}'
    )
    record = replace(chat_record(0, [1, 2], [7], []), response=answer)
    root = backend.fresh()
    asyncio.run(backend.open(root).append(record))
    [got] = backend.open(root).read_sync("r1")
    assert got.completion_logprobs() == [float("-inf")]
    assert got.response["choices"][0]["message"]["content"] == "été"


def test_storage_grows_with_the_trajectory_not_with_turns_times_prompt(tmp_path: Path) -> None:
    turns = 40
    records = conversation([(True, list(range(20)), list(range(10)))] * turns)
    store = DirectoryTrajectoryStore(tmp_path)

    async def write() -> None:
        for record in records:
            await store.append(record)

    asyncio.run(write())
    lines = store.path("r1", 1).read_text().splitlines()
    stored_prompt_ids = sum(len(json.loads(line)["prompt_ids"]["ids"]) for line in lines)
    full_prompt_ids = sum(len(r.prompt_token_ids) for r in records)
    assert stored_prompt_ids == 20 * turns  # only the new tokens of each turn
    assert full_prompt_ids > 10 * stored_prompt_ids
    stored_messages = sum(len(json.loads(line)["messages"]["items"]) for line in lines)
    assert stored_messages == 1 + turns - 1


def test_a_conversation_as_sent_is_compared_as_sent(tmp_path: Path) -> None:
    """Messages sent again byte for byte are kept from the previous line, as equal dicts are;
    sent again in other bytes (another spacing), they are stored again; a call between read
    and sent ones is compared message by message. Every call reads back whole."""
    compact = conversation([(True, [1], [2])] * 5)
    records = [
        as_sent(compact[0]),
        as_sent(compact[1]),
        as_sent(compact[2], "spaced"),
        compact[3],  # a translated call: no bytes of its messages
        as_sent(compact[4]),
    ]
    store = DirectoryTrajectoryStore(tmp_path)

    async def write() -> None:
        for record in records:
            await store.append(record)

    asyncio.run(write())
    lines = [json.loads(line) for line in store.path("r1", 1).read_text().splitlines()]
    assert [line["messages"]["base"] for line in lines] == [0, 1, 0, 3, 4]
    assert [len(line["messages"]["items"]) for line in lines] == [1, 1, 3, 1, 1]
    read = store.read_sync("r1")
    assert [r.request for r in read] == [r.request for r in compact]


def test_a_replica_whose_tail_holds_bytes_catches_up_on_anothers_calls(
    backend: Backend,
) -> None:
    """Two gateways append to one attempt, each call sent as it came: the one whose tail holds
    the bytes of its last call reads the other's call against them (the directory store on
    its next append, the S3 store when its write finds the sequence taken), and every call
    reads back whole."""
    records = [as_sent(r) for r in conversation([(True, [1], [2])] * 4)]
    root = backend.fresh()
    one, other = backend.open(root), backend.open(root)

    async def write() -> None:
        for store, record in zip((one, other, one, other), records, strict=True):
            await store.append(record)

    asyncio.run(write())
    read = backend.open(root).read_sync("r1")
    assert [r.sequence for r in read] == [0, 1, 2, 3]
    assert [r.request for r in read] == [r.request for r in records]
    if backend.name == "directory":  # and each line kept all of the call before it
        lines = DirectoryTrajectoryStore(root).path("r1", 1).read_text().splitlines()
        assert [json.loads(line)["messages"]["base"] for line in lines] == [0, 1, 2, 3]


def test_a_conversation_that_extends_the_previous_one_is_found_in_its_bytes() -> None:
    """Messages sent again byte for byte, then more, are the previous call's and the new ones;
    any other change (a message edited, one dropped, other spacing) is found message by
    message, and what the two share is kept whatever their bytes."""

    def sent(*contents: str, spaced: bool = False) -> SentMessages:
        messages = [{"role": "user", "content": c} for c in contents]
        separators = (", ", ": ") if spaced else (",", ":")
        request = read_chat(json.dumps({"messages": messages}, separators=separators).encode())
        assert request is not None and isinstance(request["messages"], SentMessages)
        return request["messages"]

    def new(messages: SentMessages, prev: SentMessages) -> tuple[int, list[Any]]:
        tail = Tail()
        tail.sent_messages = prev
        kept, items = new_messages(tail, messages, messages)
        return kept, [json.loads(bytes(item)) for item in items]

    a, b = {"role": "user", "content": "a"}, {"role": "user", "content": "b"}
    assert sent("a", "b").extension(sent("a")) == [msgspec.Raw(b'{"role":"user","content":"b"}')]
    assert sent("a").extension(sent("a")) == []
    assert new(sent("a", "b"), sent("a")) == (1, [b])
    assert new(sent("a", "b"), sent("a", "b")) == (2, [])
    for differs in (sent("x", "b"), sent("b"), sent("a", "b", spaced=True)):
        assert differs.extension(sent("a")) is None
    assert new(sent("a", "x"), sent("a", "b")) == (1, [{"role": "user", "content": "x"}])
    assert new(sent("a"), sent("a", "b")) == (1, [])
    assert new(sent("a", "b", spaced=True), sent("a")) == (0, [a, b])


def test_a_tail_keeps_the_bytes_of_a_conversation_sent_not_its_dicts() -> None:
    """The previous call's messages as sent are all a tail needs: their dicts go with their
    request (a coding agent's ~950 a call, freed cold a call later otherwise); read from the
    bytes when a call that was not sent needs them."""
    first, second = conversation([(True, [1], [2])] * 2)
    tail = Tail()
    tail.advance(as_sent(first))
    assert tail.messages == []
    assert tail.previous_messages() == first.request["messages"]
    line = encode_record(second, tail)
    assert line["messages"] == {"base": 1, "items": second.request["messages"][1:]}
    tail.advance(second)
    assert tail.sent_messages is None
    assert tail.messages == second.request["messages"]


def test_a_call_as_sent_keeps_no_reading_of_its_messages_in_the_tail() -> None:
    """With nothing before it, or a previous call read back from the store, a call's messages
    as sent are stored as sent and compared as read, without their reading kept: the tail
    holds them for the next call, a coding agent's ~950 a call."""
    first, second = conversation([(True, [1], [2])] * 2)
    fresh = as_sent(first)
    line = encode_record(fresh, Tail())
    assert fresh.sent_messages is not None
    assert line["messages"] == {"base": 0, "items": fresh.sent_messages.each()}
    after_read = Tail()
    after_read.advance(first)  # read back from the store: dicts
    sent = as_sent(second)
    line = encode_record(sent, after_read)
    assert line["messages"]["base"] == 1
    items = json.loads(json_codec.dumps(line["messages"]["items"]))
    assert items == second.request["messages"][1:]
    for record in (fresh, sent):
        assert record.sent_messages is not None and record.sent_messages._read is None


def test_a_torn_last_line_is_skipped_and_earlier_ones_kept(tmp_path: Path) -> None:
    store = DirectoryTrajectoryStore(tmp_path)
    records = conversation([(True, [1, 2], [3]), (True, [4], [5])])
    for record in records:
        asyncio.run(store.append(record))
    with store.path("r1", 1).open("a") as f:
        f.write('{"v": 1, "call_id": "half')
    assert [r.call_id for r in DirectoryTrajectoryStore(tmp_path).read_sync("r1")] == ["c0", "c1"]


def test_a_line_torn_inside_a_character_is_skipped_too(tmp_path: Path) -> None:
    """Lines are UTF-8 (not \\u escapes): a crash can cut one inside a character."""
    store = DirectoryTrajectoryStore(tmp_path)
    asyncio.run(store.append(conversation([(True, [1, 2], [3])])[0]))
    with store.path("r1", 1).open("ab") as f:
        f.write('{"v": 1, "call_id": "c1", "text": "é'.encode()[:-1])
    assert [r.call_id for r in DirectoryTrajectoryStore(tmp_path).read_sync("r1")] == ["c0"]


def test_read_by_call_ids_returns_only_committed_calls(backend: Backend) -> None:
    store = backend.open(backend.fresh())

    async def write() -> None:
        for record in conversation([(True, [1], [2]), (True, [3], [4]), (True, [5], [6])]):
            await store.append(record)

    asyncio.run(write())
    picked = store.read_sync("r1", call_ids=["c2", "c0"])
    assert [r.call_id for r in picked] == ["c0", "c2"]
    assert picked[1].prompt_token_ids == [1, 2, 3, 4, 5]


def test_appending_after_a_torn_line_keeps_the_file_readable(tmp_path: Path) -> None:
    records = conversation([(True, [1], [2]), (True, [3], [4])])
    asyncio.run(DirectoryTrajectoryStore(tmp_path).append(records[0]))
    path = DirectoryTrajectoryStore(tmp_path).path("r1", 1)
    with path.open("a") as f:
        f.write('{"v": 1, "call_id": "torn')
    asyncio.run(DirectoryTrajectoryStore(tmp_path).append(records[1]))
    read = DirectoryTrajectoryStore(tmp_path).read_sync("r1")
    assert [(r.call_id, r.sequence) for r in read] == [("c0", 0), ("c1", 1)]
    assert read[1].prompt_token_ids == [1, 2, 3]


def test_a_tiny_tail_cache_under_concurrent_appends_keeps_sequences(backend: Backend) -> None:
    """Tails are evicted and reloaded constantly here (one cached attempt, three written at
    once, each append a thread hop with fsync): sequences must stay whole and unique."""
    root = backend.fresh()
    store = backend.open(root, fsync=True, cached_attempts=1)

    def record(rollout: str, call: int) -> CallRecord:
        base = chat_record(call, [1, 2, call], [7], [{"role": "user", "content": str(call)}])
        return replace(base, rollout_id=rollout, call_id=f"{rollout}-{call}")

    async def write() -> None:
        await asyncio.gather(*(store.append(record(f"r{i % 3}", i)) for i in range(30)))

    asyncio.run(write())
    for rollout in ("r0", "r1", "r2"):
        read = backend.open(root).read_sync(rollout)
        assert [r.sequence for r in read] == list(range(10))
        assert len({r.call_id for r in read}) == 10
