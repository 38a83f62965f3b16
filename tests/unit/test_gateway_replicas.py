"""Gateway replicas, piece by piece: the config's two forms of the admin API; the trainer's
fan-out (every replica paused before it returns, one that appeared meanwhile paused too, an
unreachable one failing the step, DNS resolved to one URL per address); the journal's view of
a sibling replica killed a moment ago; a replica refusing an attempt another one closed; the
same upstream picked for a rollout on every replica."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from darl.gateway.calls.rollouts import RolloutRegistry
from darl.gateway.calls.traffic import UpstreamPool
from darl.gateway.errors import RolloutFinishedError
from darl.gateway.journal.base import SILENT_AFTER_SECONDS, GatewayJournal
from darl.gateway.store.directory import DirectoryTrajectoryStore
from darl.trainer.gateway_replicas import GatewayReplicas
from darl.trainer.policy_control import WeightSyncError
from darl.workflows.contracts import ModelCallEvent
from darl.workflows.training_config import WeightSyncSettings

SERVERS = ["http://p"]


# --- the config ------------------------------------------------------------------------------


def test_one_gateway_or_its_replicas_but_not_both_nor_neither() -> None:
    one = WeightSyncSettings(gateway_admin_url="http://g:8100/", policy_servers=SERVERS)
    assert one.admin_urls == ["http://g:8100"]
    many = WeightSyncSettings(
        gateway_admin_urls=["http://a:8100", "dns+http://gw.darl.svc:8100"], policy_servers=SERVERS
    )
    assert many.admin_urls == ["http://a:8100", "dns+http://gw.darl.svc:8100"]
    with pytest.raises(ValidationError, match="not both"):
        WeightSyncSettings(
            gateway_admin_url="http://g", gateway_admin_urls=["http://a"], policy_servers=SERVERS
        )
    with pytest.raises(ValidationError, match="needs the gateway's admin API"):
        WeightSyncSettings(policy_servers=SERVERS)
    with pytest.raises(ValidationError, match="expected http"):
        WeightSyncSettings(gateway_admin_urls=["gw.darl.svc:8100"], policy_servers=SERVERS)
    # A history written before the list existed still reads.
    old = WeightSyncSettings.model_validate_json(
        json.dumps({"gateway_admin_url": "http://g", "policy_servers": SERVERS})
    )
    assert old.admin_urls == ["http://g"]


# --- the trainer's fan-out ---------------------------------------------------------------------


class Replicas:
    """Fake replicas behind an httpx MockTransport: what each was asked, and which answer."""

    def __init__(self, hosts: list[str]) -> None:
        self.hosts = list(hosts)
        self.asked: list[tuple[str, str]] = []
        self.down: set[str] = set()
        self.on_pause = lambda: None

    def handle(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.down:
            raise httpx.ConnectError("refused", request=request)
        self.asked.append((host, request.url.path))
        if request.url.path == "/admin/pause":
            self.on_pause()
            return httpx.Response(200, json={"paused": True, "drained": True})
        return httpx.Response(200, json={})

    async def resolve(self, name: str, port: int) -> list[str]:
        assert (name, port) == ("gw.darl.svc", 8100)
        return list(self.hosts)


def fleet(replicas: Replicas, client: httpx.AsyncClient) -> GatewayReplicas:
    return GatewayReplicas(["dns+http://gw.darl.svc:8100"], "key", client, resolve=replicas.resolve)


async def test_pause_reaches_every_replica_and_one_that_appears_meanwhile() -> None:
    replicas = Replicas(["10.0.0.1", "10.0.0.2"])
    # The first round of pauses sees a third replica come up.
    replicas.on_pause = lambda: (
        replicas.hosts.append("10.0.0.3") if len(replicas.hosts) < 3 else None
    )
    async with httpx.AsyncClient(transport=httpx.MockTransport(replicas.handle)) as client:
        gateway = fleet(replicas, client)
        assert await gateway.pause("hold", 5.0) is True
        paused = sorted(h for h, path in replicas.asked if path == "/admin/pause")
        assert paused == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
        replicas.asked.clear()
        await gateway.set_upstreams(["http://p"])
        await gateway.resume(7)
    resumed = sorted(h for h, path in replicas.asked if path == "/admin/resume")
    assert resumed == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]


async def test_an_unreachable_replica_fails_the_step_after_the_others_were_asked() -> None:
    replicas = Replicas(["10.0.0.1", "10.0.0.2"])
    replicas.down.add("10.0.0.2")
    async with httpx.AsyncClient(transport=httpx.MockTransport(replicas.handle)) as client:
        with pytest.raises(httpx.ConnectError):
            await fleet(replicas, client).pause("hold", None)
        assert ("10.0.0.1", "/admin/pause") in replicas.asked
        # Gone from DNS: the retry's pause succeeds without it.
        replicas.hosts.remove("10.0.0.2")
        assert await fleet(replicas, client).pause("hold", None) is True


async def test_a_refusal_is_not_retried_and_names_the_replica() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, json={"error": "bad key"})

    async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as client:
        with pytest.raises(WeightSyncError, match="401"):
            await GatewayReplicas(["http://a:1", "http://b:1"], "key", client).pause("hold", None)


async def test_dns_addresses_become_one_url_each_ipv6_bracketed() -> None:
    async def resolve(name: str, port: int) -> list[str]:
        return ["10.0.0.2", "fd00::1", "10.0.0.1"]

    async with httpx.AsyncClient() as client:
        gateway = GatewayReplicas(
            ["dns+http://gw.darl.svc:8100", "http://10.0.0.1:8100/"], "k", client, resolve=resolve
        )
        assert await gateway.urls() == [
            "http://10.0.0.1:8100",
            "http://10.0.0.2:8100",
            "http://[fd00::1]:8100",
        ]


async def test_a_name_that_resolves_to_nothing_is_retryable() -> None:
    async with httpx.AsyncClient() as client:
        gateway = GatewayReplicas(["dns+http://no-such-name.invalid:8100"], "k", client)
        with pytest.raises(ConnectionError):
            await gateway.urls()


# --- the gateway side --------------------------------------------------------------------------


def test_a_sibling_killed_a_moment_ago_is_unconfirmed_then_silent(tmp_path: Path) -> None:
    a = GatewayJournal(tmp_path, instance="a")
    b = GatewayJournal(tmp_path, instance="b")
    now = time.time()
    a.came_up(now - 0.5)  # a's last word, then a is killed
    b.came_up(now)
    # b closes an attempt now: whether a was up is not known yet (b must wait for a word).
    assert b.unconfirmed_siblings(now) == ["a"]
    assert b.silent_outages(now) == []
    # No word from a for SILENT_AFTER_SECONDS: down since its last word.
    later = now + SILENT_AFTER_SECONDS
    [outage] = b.silent_outages(later)
    assert (outage.instance, outage.since, outage.killed) == ("a", now - 0.5, True)
    assert b.outages_overlapping(now - 10, later, silent_at=later) == [outage]
    assert b.outages_overlapping(now - 10, later) == []  # none recorded yet
    # A sibling that speaks is confirmed; one that stopped drained first and is no outage.
    a.alive(later)
    assert b.unconfirmed_siblings(later) == [] and b.silent_outages(later) == []
    a.went_down(later)
    assert b.silent_outages(later + 100) == []


class NoTemporal:
    def get_workflow_handle(self, workflow_id: str) -> object:
        raise AssertionError("not asked in this test")


async def test_a_replica_refuses_an_attempt_another_closed(tmp_path: Path) -> None:
    store = DirectoryTrajectoryStore(tmp_path)
    a = RolloutRegistry(NoTemporal(), store)  # type: ignore[arg-type]
    b = RolloutRegistry(NoTemporal(), store)  # type: ignore[arg-type]
    assert not await b.ended("r", 1)  # b has seen the attempt open
    a.close_attempt("r", 1)
    await store.mark_closed("r", 1)
    assert await b.ended("r", 1)
    # With a recheck interval (a store where looking costs a request), "open" is believed
    # that long.
    c = RolloutRegistry(NoTemporal(), store, closed_recheck_seconds=60)  # type: ignore[arg-type]
    assert not await c.ended("r", 2)
    await store.mark_closed("r", 2)
    assert not await c.ended("r", 2)


async def test_an_attempt_the_worker_opened_asks_temporal_nothing(tmp_path: Path) -> None:
    store = DirectoryTrajectoryStore(tmp_path)
    registry = RolloutRegistry(NoTemporal(), store)  # type: ignore[arg-type]
    assert not await registry.opened("r", 1)
    await registry.check_open("r", 1)  # NoTemporal: a describe would fail the test
    # An attempt closed (here by another replica) is not opened again: its calls stay refused.
    await store.mark_closed("s", 1)
    assert await registry.opened("s", 1)
    with pytest.raises(RolloutFinishedError):
        await registry.check_open("s", 1)
    # Nor does opening one attempt reopen another the gateway closed.
    registry.close_attempt("r", 1)
    assert await registry.opened("r", 1)
    with pytest.raises(RolloutFinishedError):
        await registry.check_open("r", 1)
    # The opening looks at the store itself, not at a recent look (the worker's rule 7 check
    # depends on its answer): an attempt another replica closed a moment ago is closed.
    lazy = RolloutRegistry(NoTemporal(), store, closed_recheck_seconds=60)  # type: ignore[arg-type]
    assert not await lazy.ended("t", 1)
    await store.mark_closed("t", 1)
    assert not await lazy.ended("t", 1)  # believed open for closed_recheck_seconds
    assert await lazy.opened("t", 1)


def test_every_replica_pins_a_rollout_to_the_same_upstream() -> None:
    urls = ["http://p3:1", "http://p1:1/", "http://p2:1"]
    a, b = UpstreamPool(urls), UpstreamPool(list(reversed(urls)))
    for i in range(200):
        assert a.pick(f"run.e0.t{i}.0") == b.pick(f"run.e0.t{i}.0")


class Signals:
    """A Temporal client that only records the signals sent."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def get_workflow_handle(self, workflow_id: str) -> Signals:
        return self

    async def signal(self, name: str, payload: object) -> None:
        self.sent.append(name)


async def test_events_of_an_attempt_another_replica_closed_are_not_signalled_late(
    tmp_path: Path,
) -> None:
    store = DirectoryTrajectoryStore(tmp_path)
    event = ModelCallEvent.model_construct(rollout_id="r", attempt=1, call_id="c")
    recorder, closer = Signals(), Signals()
    a = RolloutRegistry(recorder, store)  # type: ignore[arg-type]
    b = RolloutRegistry(closer, store)  # type: ignore[arg-type]
    await a.signal_calls("r", [event])  # open: delivered
    assert recorder.sent == ["model_calls"]
    b.close_attempt("r", 1)  # closed through b, which hands the events over itself
    await store.mark_closed("r", 1)
    await b.signal_calls("r", [event])
    assert closer.sent == ["model_calls"]
    await a.signal_calls("r", [event])  # a's late flush: b's close delivered it
    assert recorder.sent == ["model_calls"]
