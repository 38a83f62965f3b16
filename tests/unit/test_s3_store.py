"""The S3 trajectory store and the journal's S3 storage against moto's S3 emulator
(tests/s3_emulator.py), and what several writers sharing one attempt need of both stores:
unique, gap-free sequences, every record whole, a delivered mark that never goes back."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
from dataclasses import replace
from pathlib import Path

import boto3
import pytest
import typer
from botocore.exceptions import ClientError
from typer.testing import CliRunner

from darl.deploy.cli import app
from darl.deploy.store_options import open_checked_store, store_location
from darl.gateway.journal.base import AdminState, GatewayJournal, Outage
from darl.gateway.journal.s3 import S3Journal
from darl.gateway.store.base import TrajectoryStore
from darl.gateway.store.directory import DirectoryTrajectoryStore
from darl.gateway.store.record import CallRecord, FailedCall
from darl.gateway.store.s3 import S3TrajectoryStore
from darl.gateway.store.url import StoreUrlError, journal_storage, open_store, parse_store_url
from tests.concurrent_writers import (
    CALLS_EACH,
    WRITERS,
    append_all,
    directory_writer,
    writer_calls,
)
from tests.s3_emulator import S3Emulator
from tests.unit.test_trajectory_store import conversation


def assert_whole_and_gap_free(read: list[CallRecord]) -> None:
    assert [r.sequence for r in read] == list(range(WRITERS * CALLS_EACH))
    sent = {r.call_id: r for w in range(WRITERS) for r in writer_calls(f"w{w}")}
    assert sorted(r.call_id for r in read) == sorted(sent)
    for got in read:
        want = sent[got.call_id]
        assert got.prompt_token_ids == want.prompt_token_ids
        assert got.request == want.request
        assert got.response == want.response


def test_the_emulator_refuses_a_second_put_if_none_match(
    s3_bucket: str, s3_emulator: S3Emulator
) -> None:
    """What the S3 store's sequences rest on: `If-None-Match: *` on an existing key is 412."""
    s3 = boto3.client("s3", endpoint_url=s3_emulator.endpoint_url)
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"1", IfNoneMatch="*")
    with pytest.raises(ClientError) as refused:
        s3.put_object(Bucket=s3_bucket, Key="k", Body=b"2", IfNoneMatch="*")
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert s3.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == b"1"


def test_two_s3_stores_appending_to_one_attempt_share_its_sequences(s3_bucket: str) -> None:
    """Two replicas, each with its own client and tail cache, writing one attempt at once."""

    async def write() -> None:
        stores = [S3TrajectoryStore(s3_bucket, "p") for _ in range(WRITERS)]
        await asyncio.gather(*(append_all(s, f"w{i}") for i, s in enumerate(stores)))

    asyncio.run(write())
    assert_whole_and_gap_free(S3TrajectoryStore(s3_bucket, "p").read_sync("r1"))


def test_two_processes_appending_to_one_directory_attempt_share_its_sequences(
    tmp_path: Path,
) -> None:
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(WRITERS)
    writers = [
        context.Process(target=directory_writer, args=(str(tmp_path), f"w{i}", start))
        for i in range(WRITERS)
    ]
    for process in writers:
        process.start()
    for process in writers:
        process.join(timeout=120)
        assert process.exitcode == 0
    assert_whole_and_gap_free(DirectoryTrajectoryStore(tmp_path).read_sync("r1"))


def test_a_put_whose_answer_was_lost_is_not_stored_twice(s3_bucket: str) -> None:
    """A PUT that succeeded, retried by the client into a 412, is found to be the writer's own."""
    first, second = conversation([(True, [1], [2]), (True, [3], [4])])

    async def write() -> CallRecord:
        a, b = S3TrajectoryStore(s3_bucket), S3TrajectoryStore(s3_bucket)
        await a.append(first)
        await b.append(second)  # b takes sequence 1; a's tail still says 1 is next
        return await a.append(second)

    again = asyncio.run(write())
    assert again.sequence == 1
    read = S3TrajectoryStore(s3_bucket).read_sync("r1")
    assert [(r.call_id, r.sequence) for r in read] == [("c0", 0), ("c1", 1)]
    assert read[1].prompt_token_ids == [1, 2, 3]


def test_a_record_is_in_the_store_once_append_returns(s3_bucket: str) -> None:
    (record,) = conversation([(True, [5, 6], [7])])
    stored = asyncio.run(S3TrajectoryStore(s3_bucket, "d").append(record))
    assert S3TrajectoryStore(s3_bucket, "d").read_sync("r1") == [stored]
    ref = S3TrajectoryStore(s3_bucket, "d").ref(stored)
    assert ref == f"s3://{s3_bucket}/d/r1/calls/attempt-1/0000000000.json"


def test_prompts_are_stored_as_deltas_in_s3(s3_bucket: str, s3_emulator: S3Emulator) -> None:
    records = conversation([(True, list(range(20)), list(range(10)))] * 5)

    async def write() -> None:
        store = S3TrajectoryStore(s3_bucket)
        for record in records:
            await store.append(record)

    asyncio.run(write())
    s3 = boto3.client("s3", endpoint_url=s3_emulator.endpoint_url)
    stored = [
        json.loads(
            s3.get_object(Bucket=s3_bucket, Key=f"r1/calls/attempt-1/{n:010d}.json")["Body"].read()
        )
        for n in range(len(records))
    ]
    assert [len(line["prompt_ids"]["ids"]) for line in stored] == [20] * 5


@pytest.mark.parametrize("kind", ["directory", "s3"])
def test_the_delivered_mark_never_moves_back(kind: str, tmp_path: Path, request) -> None:
    def make() -> TrajectoryStore:
        if kind == "directory":
            return DirectoryTrajectoryStore(tmp_path)
        return S3TrajectoryStore(request.getfixturevalue("s3_bucket"), "m")

    async def mark() -> tuple[int, int, int]:
        a = make()
        before = await a.delivered("r1", 1)
        b = make()  # another replica
        await a.mark_delivered("r1", 1, 7)
        await b.mark_delivered("r1", 1, 3)  # a late, older mark
        await asyncio.gather(*(b.mark_delivered("r1", 1, n) for n in range(5)))
        return before, await a.delivered("r1", 1), await make().delivered("r1", 1)

    assert asyncio.run(mark()) == (-1, 7, 7)


def test_side_data_and_attempts_round_trip_in_s3(s3_bucket: str) -> None:
    failure = FailedCall("f1", "r1", 2, "chat.completions", 502, "down", 1.0, 0, None, 3.0)

    async def write_then_read() -> tuple:
        store = S3TrajectoryStore(s3_bucket, "side")
        for record in conversation([(True, [1], [2])]):
            await store.append(record)
            await store.append(replace(record, attempt=3, call_id="later"))
        await store.record_incident("r1", 2, "502 upstream down")
        await store.record_incident("r1", 2, "503 upstream_stale")
        event = await store.record_event("r1", 2, {"type": "note", "value": 1})
        await store.record_failed_call(failure)
        await store.mark_closed("r1", 2)
        other = S3TrajectoryStore(s3_bucket, "side")
        return (
            await other.incidents("r1", 2),
            await other.events("r1", 2),
            await other.failed_calls("r1", 2),
            (await other.is_closed("r1", 2), await other.is_closed("r1", 1)),
            await other.attempts("r1"),
            await other.attempts("nobody"),
            [r.call_id for r in await other.read("r1")],
            event,
        )

    incidents, events, failed, closed, attempts, none, calls, event = asyncio.run(write_then_read())
    assert incidents == ["502 upstream down", "503 upstream_stale"]
    assert events == [event] and event["value"] == 1
    assert failed == [failure]
    assert closed == (True, False)
    assert (attempts, none, calls) == ([1, 3], [], ["c0", "later"])


def test_the_gateway_journal_round_trips_in_s3(s3_bucket: str) -> None:
    def journal(instance: str) -> GatewayJournal:
        return GatewayJournal(S3Journal(s3_bucket, "run"), instance)

    state = AdminState(policy_version=4, paused=True, mode="reject", upstreams=("http://u",))
    assert journal("a").load_admin_state() is None
    journal("a").save_admin_state(state)
    assert journal("b").load_admin_state() == state
    journal("a").came_up(100.0)
    journal("a").alive(110.0)
    killed = journal("a").came_up(120.0)
    journal("b").came_up(125.0)
    journal("b").went_down(130.0)
    stopped = journal("b").came_up(140.0)
    assert killed == Outage("a", 110.0, 120.0, killed=True)
    assert stopped == Outage("b", 130.0, 140.0, killed=False)
    reader = journal("reader")
    assert reader.storage.outages() == reader.storage.outages()  # the cached read agrees
    assert [Outage(**o) for o in reader.storage.outages()] == [killed, stopped]
    assert reader.storage.names("lifecycle-") == ["lifecycle-a.json", "lifecycle-b.json"]


def test_store_urls_name_their_store(tmp_path: Path, s3_emulator: S3Emulator) -> None:
    assert parse_store_url("s3://bucket/a/b/").bucket == "bucket"
    assert parse_store_url("s3://bucket/a/b/").prefix == "a/b"
    assert parse_store_url(f"file://{tmp_path}").directory == tmp_path
    assert parse_store_url("relative/dir").directory == Path("relative/dir")
    assert isinstance(open_store(f"file://{tmp_path}"), DirectoryTrajectoryStore)
    s3 = open_store("s3://bucket/p")
    assert isinstance(s3, S3TrajectoryStore) and s3.where("r1") == "s3://bucket/p/r1/"
    assert journal_storage(tmp_path) == tmp_path / "_gateway"
    assert isinstance(journal_storage("s3://bucket/p"), S3Journal)
    for bad, says in [
        ("ftp://host/x", "unknown store scheme 'ftp'"),
        ("s3:///prefix", "needs a bucket"),
        ("file://elsewhere/x", "local path"),
    ]:
        with pytest.raises(StoreUrlError, match=says):
            parse_store_url(bad)
        with pytest.raises(typer.BadParameter, match=says):
            store_location(bad, tmp_path)


def test_the_gateway_refuses_a_bad_store_url_before_it_starts(s3_emulator: S3Emulator) -> None:
    runner = CliRunner()
    bad = runner.invoke(app, ["gateway", "--store-url", "ftp://host/x"])
    assert bad.exit_code == 2
    assert "unknown store scheme 'ftp'" in bad.output
    missing = runner.invoke(app, ["gateway", "--store-url", "s3://no-such-bucket-here/x"])
    assert missing.exit_code == 2
    assert "cannot list s3://no-such-bucket-here/x/" in missing.output
    assert "does the bucket exist" in missing.output


def test_a_missing_bucket_is_one_clear_error(s3_emulator: S3Emulator) -> None:
    with pytest.raises(typer.Exit):
        open_checked_store(store_location("s3://absent-bucket/p", Path()))
