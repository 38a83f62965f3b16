"""The gateway's journal on real files: its admin state comes back whole in a new journal
object, a start after a SIGKILL or a stop records the outage it ended (shared by gateways on
one directory, each with a lifecycle of its own), and the outages near an attempt are found;
and the trajectory store's incidents and closed marks, per attempt, across store objects."""

from __future__ import annotations

import os
from pathlib import Path

from darl.gateway.journal.base import OUTAGE_MARGIN_SECONDS, AdminState, GatewayJournal, Outage
from darl.gateway.journal.directory import OUTAGES_FILE
from darl.gateway.store.directory import DirectoryTrajectoryStore


def test_admin_state_is_loaded_back_whole_by_a_new_journal(tmp_path: Path) -> None:
    state = AdminState(
        policy_version=7,
        paused=True,
        mode="drain",
        upstreams=("http://a:1", "http://b:2"),
        configured=("http://c:3",),
    )
    GatewayJournal(tmp_path).save_admin_state(state)
    assert GatewayJournal(tmp_path).load_admin_state() == state
    later = AdminState(policy_version=8, upstreams=("http://a:1",))
    GatewayJournal(tmp_path).save_admin_state(later)
    assert GatewayJournal(tmp_path).load_admin_state() == later


def test_without_a_state_file_there_is_no_admin_state(tmp_path: Path) -> None:
    assert GatewayJournal(tmp_path / "fresh").load_admin_state() is None


def test_a_first_start_records_no_outage(tmp_path: Path) -> None:
    journal = GatewayJournal(tmp_path)
    assert journal.came_up(100.0) is None
    assert not (tmp_path / OUTAGES_FILE).exists()
    assert journal.outages_overlapping(0.0, 1e12) == []


def test_a_start_after_a_kill_records_the_outage_since_it_was_last_alive(
    tmp_path: Path,
) -> None:
    first = GatewayJournal(tmp_path)
    first.came_up(100.0)
    first.alive(105.0)  # then SIGKILLed: no went_down
    outage = GatewayJournal(tmp_path).came_up(120.0)
    assert outage == Outage("gateway", since=105.0, until=120.0, killed=True)
    assert "was killed" in outage.describe() and "15.0s" in outage.describe()


def test_a_start_after_a_stop_records_the_outage_since_it_stopped(tmp_path: Path) -> None:
    first = GatewayJournal(tmp_path)
    first.came_up(100.0)
    first.alive(104.0)
    first.went_down(106.0)
    outage = GatewayJournal(tmp_path).came_up(130.0)
    assert outage == Outage("gateway", since=106.0, until=130.0, killed=False)
    assert "was stopped" in outage.describe()


def test_a_gateway_killed_right_after_it_started_was_down_since_that_start(
    tmp_path: Path,
) -> None:
    GatewayJournal(tmp_path).came_up(100.0)
    GatewayJournal(tmp_path).went_down(110.0)
    GatewayJournal(tmp_path).came_up(120.0)  # then SIGKILLed before its first alive tick
    outage = GatewayJournal(tmp_path).came_up(130.0)
    assert outage == Outage("gateway", since=120.0, until=130.0, killed=True)


def test_outages_persist_for_every_later_journal(tmp_path: Path) -> None:
    GatewayJournal(tmp_path).came_up(100.0)
    GatewayJournal(tmp_path).alive(110.0)
    killed = GatewayJournal(tmp_path).came_up(120.0)
    GatewayJournal(tmp_path).went_down(150.0)
    stopped = GatewayJournal(tmp_path).came_up(160.0)
    assert killed is not None and stopped is not None
    assert GatewayJournal(tmp_path).outages_overlapping(0.0, 1e12) == [killed, stopped]


def test_only_outages_within_the_margin_of_an_attempt_overlap_it(tmp_path: Path) -> None:
    journal = GatewayJournal(tmp_path)
    journal.came_up(0.0)
    journal.alive(100.0)
    outage = journal.came_up(110.0)  # down over [100, 110]
    margin = OUTAGE_MARGIN_SECONDS
    assert journal.outages_overlapping(102.0, 108.0) == [outage]  # inside it
    assert journal.outages_overlapping(50.0, 101.0) == [outage]  # ends in it
    assert journal.outages_overlapping(110.0 + margin - 0.1, 200.0) == [outage]  # just after
    assert journal.outages_overlapping(50.0, 100.0 - margin + 0.1) == [outage]  # just before
    assert journal.outages_overlapping(110.0 + margin + 0.1, 200.0) == []
    assert journal.outages_overlapping(50.0, 100.0 - margin - 0.1) == []


def test_gateways_sharing_a_journal_have_their_own_lifecycles_and_see_all_outages(
    tmp_path: Path,
) -> None:
    a = GatewayJournal(tmp_path, instance="a")
    b = GatewayJournal(tmp_path, instance="b")
    assert a.came_up(100.0) is None
    assert b.came_up(101.0) is None  # a's lifecycle is not b's
    a.alive(110.0)  # a is killed; b keeps running
    b.alive(140.0)
    a_outage = GatewayJournal(tmp_path, instance="a").came_up(130.0)
    assert a_outage == Outage("a", since=110.0, until=130.0, killed=True)
    b.went_down(150.0)
    b_outage = GatewayJournal(tmp_path, instance="b").came_up(155.0)
    assert b_outage == Outage("b", since=150.0, until=155.0, killed=False)
    assert a.outages_overlapping(0.0, 1e12) == [a_outage, b_outage]
    assert b.outages_overlapping(120.0, 125.0) == [a_outage]


def test_outages_appended_after_a_journal_last_read_are_seen(tmp_path: Path) -> None:
    reader = GatewayJournal(tmp_path, instance="reader")
    assert reader.outages_overlapping(0.0, 1e12) == []  # no file yet
    other = GatewayJournal(tmp_path, instance="other")
    other.came_up(10.0)
    other.alive(20.0)
    first = GatewayJournal(tmp_path, instance="other").came_up(30.0)
    assert reader.outages_overlapping(0.0, 1e12) == [first]  # the file appeared
    path = tmp_path / OUTAGES_FILE
    read_at = path.stat().st_mtime_ns
    GatewayJournal(tmp_path, instance="other").alive(40.0)
    second = GatewayJournal(tmp_path, instance="other").came_up(50.0)
    # The same mtime as the first read (a coarse clock): the size alone must refresh the cache.
    os.utime(path, ns=(read_at, read_at))
    assert reader.outages_overlapping(0.0, 1e12) == [first, second]


async def test_incidents_are_kept_per_attempt_in_order_and_a_torn_line_is_ignored(
    tmp_path: Path,
) -> None:
    store = DirectoryTrajectoryStore(tmp_path)
    assert await store.incidents("r1", 1) == []
    await store.record_incident("r1", 1, "503 upstream_stale")
    await store.record_incident("r1", 2, "502 upstream down")
    await store.record_incident("r1", 1, "500 capture failed")
    with (tmp_path / "r1" / "attempt-1.incidents").open("a") as f:
        f.write('{"at": 1.0, "what": "half a li')  # a crash mid-write
    later = DirectoryTrajectoryStore(tmp_path)  # another gateway closes the attempt
    assert await later.incidents("r1", 1) == ["503 upstream_stale", "500 capture failed"]
    assert await later.incidents("r1", 2) == ["502 upstream down"]
    assert await later.incidents("r2", 1) == []


async def test_an_incident_recorded_after_a_torn_line_is_kept(tmp_path: Path) -> None:
    await DirectoryTrajectoryStore(tmp_path).record_incident("r1", 1, "503 upstream_stale")
    with (tmp_path / "r1" / "attempt-1.incidents").open("a") as f:
        f.write('{"at": 1.0, "what": "half a li')  # the gateway died mid-write
    await DirectoryTrajectoryStore(tmp_path).record_incident("r1", 1, "502 upstream down")
    assert await DirectoryTrajectoryStore(tmp_path).incidents("r1", 1) == [
        "503 upstream_stale",
        "502 upstream down",
    ]


async def test_a_closed_attempt_stays_closed_for_a_later_store(tmp_path: Path) -> None:
    store = DirectoryTrajectoryStore(tmp_path)
    assert not await store.is_closed("r1", 1)
    await store.mark_closed("r1", 1)
    await store.mark_closed("r1", 1)  # idempotent
    later = DirectoryTrajectoryStore(tmp_path)
    assert await later.is_closed("r1", 1)
    assert not await later.is_closed("r1", 2)
    assert not await later.is_closed("r2", 1)


async def test_agent_events_are_kept_per_attempt_in_order_past_a_torn_line(
    tmp_path: Path,
) -> None:
    store = DirectoryTrajectoryStore(tmp_path, fsync=True)
    assert await store.events("r1", 1) == []
    first = await store.record_event("r1", 1, {"event_type": "span", "data": {"n": 1}})
    assert first["event_type"] == "span" and isinstance(first["timestamp"], float)
    await store.record_event("r1", 2, {"event_type": "log", "data": {}})
    with store.events_path("r1", 1).open("a") as f:
        f.write('{"event_type": "span", "da')  # the gateway died mid-write, never answered
    later = DirectoryTrajectoryStore(tmp_path)
    await later.record_event("r1", 1, {"event_type": "span", "data": {"n": 2}})
    assert [e["data"]["n"] for e in await later.events("r1", 1)] == [1, 2]
    assert [e["event_type"] for e in await later.events("r1", 2)] == ["log"]
    # The events are not model calls: reading the rollout's calls does not trip over them.
    assert later.read_sync("r1") == []
