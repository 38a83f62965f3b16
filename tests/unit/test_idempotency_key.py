"""The parts of idempotent calls (`gateway/calls/idempotency.py`): the `Idempotency-Key` a
request may carry and what is refused, the key kept in a call's record by both stores (records
written without it still read), the store's rule that lets an attempt's own unreceived answer
be received once by a retry, what the next attempt is offered of such a call, and the wait for
a call with the key in flight."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from starlette.requests import Request

from darl.gateway.calls.idempotency import MAX_KEY_LENGTH, idempotency_key
from darl.gateway.calls.in_flight import CallsInFlight
from darl.gateway.calls.replay import offered_calls, received_live
from darl.gateway.errors import InvalidIdempotencyKeyError
from darl.gateway.store.base import AlreadyReplayedError, ReplayOverError
from darl.gateway.store.codec import Tail, decode_record, encode_record
from darl.gateway.store.record import CallRecord
from tests.unit.test_trajectory_store import Backend, backend, chat_record  # noqa: F401

KEY = "0f6e-run/activity-3/1"


def request_with(*values: bytes) -> Request:
    headers = [(b"idempotency-key", v) for v in values]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers})


@pytest.mark.parametrize(
    "value", [KEY.encode(), b"a", b"~" * MAX_KEY_LENGTH, b"!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}"]
)
def test_a_key_of_visible_ascii_is_taken_as_sent(value: bytes) -> None:
    assert idempotency_key(request_with(value)) == value.decode()


def test_a_request_without_the_header_has_no_key() -> None:
    assert idempotency_key(request_with()) is None


@pytest.mark.parametrize(
    "value",
    [b"", b"a" * (MAX_KEY_LENGTH + 1), b"two words", b"tab\there", "café".encode(), b"del\x7f"],
    ids=["empty", "too-long", "space", "tab", "non-ascii", "control"],
)
def test_a_malformed_key_is_a_400_saying_what_a_key_is(value: bytes) -> None:
    with pytest.raises(InvalidIdempotencyKeyError) as refused:
        idempotency_key(request_with(value))
    assert refused.value.status == 400
    assert refused.value.code == "invalid_idempotency_key"
    assert refused.value.param == "Idempotency-Key"
    assert "1 to 200 visible ASCII characters" in refused.value.message


def keyed(call: int, **fields: object) -> CallRecord:
    record = chat_record(call, [1, 2, 3 + call], [9], [{"role": "user", "content": f"q{call}"}])
    return replace(record, **fields)  # type: ignore[arg-type]


def test_the_codec_keeps_the_key_and_reads_a_record_written_without_it() -> None:
    record = keyed(0, idempotency_key=KEY, sequence=0)
    line = encode_record(record, Tail())
    assert line["idempotency_key"] == KEY
    assert decode_record(line, Tail()).idempotency_key == KEY
    older = encode_record(keyed(0, sequence=0), Tail())
    assert "idempotency_key" not in older
    assert decode_record(older, Tail()).idempotency_key is None


async def test_both_stores_keep_the_key_and_let_a_retry_receive_its_own_unreceived_answer(
    backend: Backend,  # noqa: F811
) -> None:
    """An attempt with a live received call, then an answer its agent never received: a call
    that reproduces that answer (a retry of its request) is appended despite the live call,
    once; a call that reproduces another attempt's call is still refused (replay is over)."""
    place = backend.fresh()
    store = backend.open(place)
    live = await store.append(keyed(0, idempotency_key="k0"))
    lost = await store.append(keyed(1, idempotency_key="k1", unreceived=True))
    retry = replace(keyed(2, idempotency_key="k1"), replayed_from=lost.call_id)
    received = await store.append(retry)
    with pytest.raises(AlreadyReplayedError):
        await store.append(replace(retry, call_id="c3"))
    with pytest.raises(ReplayOverError):
        await store.append(replace(keyed(4), replayed_from="a-call-of-attempt-0"))
    # A restarted gateway (a fresh tail) decides the same.
    reopened = backend.open(place)
    with pytest.raises(AlreadyReplayedError):
        await reopened.append(replace(retry, call_id="c5"))
    records = await reopened.read("r1", 1)
    assert [(r.call_id, r.idempotency_key) for r in records] == [
        (live.call_id, "k0"),
        (lost.call_id, "k1"),
        (received.call_id, "k1"),
    ]
    assert [r.call_id for r in received_live(records)] == [live.call_id, received.call_id]
    # The next attempt is offered the answer once: as the call that received it.
    offered = await offered_calls(reopened, "r1", [1])
    assert [r.call_id for r in offered] == [live.call_id, received.call_id]


async def test_a_retry_waits_for_the_call_with_its_key_in_flight() -> None:
    in_flight = CallsInFlight()
    assert await in_flight.key_free("r", 1, KEY, timeout=0)
    release = asyncio.Event()

    async def first_try() -> None:
        with in_flight.holding_key("r", 1, KEY):
            await release.wait()

    task = asyncio.ensure_future(first_try())
    await asyncio.sleep(0)
    assert not await in_flight.key_free("r", 1, KEY, timeout=0.05)
    # Another attempt's key, or another key, is not waited for.
    assert await in_flight.key_free("r", 2, KEY, timeout=0)
    assert await in_flight.key_free("r", 1, "another", timeout=0)
    waiting = asyncio.ensure_future(in_flight.key_free("r", 1, KEY, timeout=5))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    release.set()
    assert await asyncio.wait_for(waiting, 5)
    await task

    # A streamed call holds its key until its answer is read to the end.
    reading = asyncio.ensure_future(release.wait())
    release.clear()
    in_flight.hold_until_done("r", 1, reading, KEY)
    assert not await in_flight.key_free("r", 1, KEY, timeout=0.01)
    release.set()
    assert await in_flight.key_free("r", 1, KEY, timeout=5)
