"""The gateway's own durable state, beside the trajectory store (a directory, or objects under
`<prefix>/_gateway/` of the store's bucket): its admin state
(policy version, upstreams, pause) and its lifecycle (when it was last alive), so that a
restarted gateway comes back as it left (rule 8) and knows when agents could not reach it
(rule 7: an agent that failed while the gateway was down failed because of DARL).

A SIGKILLed gateway leaves its last `alive_at`, written every `ALIVE_INTERVAL_SECONDS`; a
stopped one its `stopped_at`. The next start records the gap as an outage.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from darl.gateway.journal.directory import DirectoryJournal
from darl.workflows.training_config import PauseMode

log = logging.getLogger(__name__)

ALIVE_INTERVAL_SECONDS = 1.0
# Clocks of the worker that asks and of the gateway, and the moments between a kill and the
# last write: an outage counts for an attempt that ran this close to it.
OUTAGE_MARGIN_SECONDS = 2.0
# A replica that has not said it is alive for this long is taken for down (it says so every
# ALIVE_INTERVAL_SECONDS): its outage is not recorded until it restarts, yet its calls in
# flight failed agents, which the other replicas must count as DARL's doing (rule 7).
SILENT_AFTER_SECONDS = ALIVE_INTERVAL_SECONDS + 1.5
# The longest a silent replica's outage counts: by then a load balancer has long stopped
# sending it calls (and a replica that never returns, a replaced pod, is no outage forever).
SILENT_OUTAGE_SECONDS = 60.0
STATE_FILE = "admin-state.json"


@dataclass(frozen=True)
class AdminState:
    """What the trainer set through the admin API and a restart must not forget."""

    policy_version: int = 0
    paused: bool = False
    mode: PauseMode = "hold"
    upstreams: tuple[str, ...] = ()
    # The `--upstream`s the gateway was started with when `upstreams` replaced them.
    configured: tuple[str, ...] = ()


@dataclass(frozen=True)
class Outage:
    """A stretch during which this gateway answered nothing."""

    instance: str
    since: float
    until: float
    killed: bool

    def describe(self) -> str:
        how = "was killed" if self.killed else "was stopped"
        when = time.strftime("%H:%M:%S", time.localtime(self.since))
        down = self.until - self.since
        return f"the gateway {self.instance} {how} and was down {down:.1f}s from {when}"


class JournalStorage(Protocol):
    """Where a journal keeps its few named documents and its outages (synchronous: the
    gateway calls the journal on a thread)."""

    def read(self, name: str) -> dict[str, Any] | None: ...

    def write(self, name: str, data: dict[str, Any]) -> None:
        """Replace the document whole (readers see the old one or the new one)."""

    def add_outage(self, outage: dict[str, Any]) -> None: ...

    def outages(self) -> list[dict[str, Any]]:
        """Every outage recorded by any gateway sharing the storage, oldest first."""

    def names(self, prefix: str) -> list[str]:
        """The documents whose names start with `prefix` (every replica's lifecycle)."""


@dataclass
class GatewayJournal:
    """`admin-state.json`, `lifecycle-<instance>.json` and the outages, in `root` (a
    directory, or a `JournalStorage` such as `S3Journal`)."""

    root: Path | JournalStorage
    instance: str = "gateway"
    storage: JournalStorage = field(init=False)

    def __post_init__(self) -> None:
        self.storage = DirectoryJournal(self.root) if isinstance(self.root, Path) else self.root

    @property
    def _lifecycle(self) -> str:
        return f"lifecycle-{self.instance}.json"

    # --- admin state -------------------------------------------------------------------

    def load_admin_state(self) -> AdminState | None:
        data = self.storage.read(STATE_FILE)
        if data is None:
            return None
        return AdminState(
            policy_version=int(data["policy_version"]),
            paused=bool(data["paused"]),
            mode=data["mode"],
            upstreams=tuple(data["upstreams"]),
            configured=tuple(data.get("configured", ())),
        )

    def save_admin_state(self, state: AdminState) -> None:
        self.storage.write(STATE_FILE, asdict(state))

    # --- lifecycle ---------------------------------------------------------------------

    def came_up(self, now: float | None = None) -> Outage | None:
        """Record this start; returns the outage that ended with it (None on a first start)."""
        now = time.time() if now is None else now
        last = self.storage.read(self._lifecycle)
        outage = None
        if last is not None:
            stopped = last.get("stopped_at")
            since = float(stopped if stopped is not None else last["alive_at"])
            outage = Outage(self.instance, since, now, killed=stopped is None)
            self.storage.add_outage(asdict(outage))
            log.warning("%s", outage.describe())
        self.alive(now)
        return outage

    def alive(self, now: float | None = None) -> None:
        self.storage.write(self._lifecycle, {"alive_at": time.time() if now is None else now})

    def went_down(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self.storage.write(self._lifecycle, {"alive_at": now, "stopped_at": now})

    def outages_overlapping(
        self, start: float, end: float, silent_at: float | None = None
    ) -> list[Outage]:
        """Outages of any gateway sharing this journal within [start, end] (with a margin);
        with `silent_at`, also those of the replicas silent then, which no restart has
        recorded yet."""
        margin = OUTAGE_MARGIN_SECONDS
        silent = self.silent_outages(silent_at) if silent_at is not None else []
        return [
            o
            for o in self._read_outages() + silent
            if o.since - margin <= end and o.until + margin >= start
        ]

    # --- the other replicas sharing the journal ----------------------------------------

    def _siblings_alive_at(self) -> dict[str, float]:
        """When each other running instance last said it was alive (a stopped one is left
        out: it drained its calls before it went)."""
        found = {}
        for name in self.storage.names("lifecycle-"):
            instance = name.removeprefix("lifecycle-").removesuffix(".json")
            data = self.storage.read(name) if instance != self.instance else None
            if data is not None and "stopped_at" not in data:
                found[instance] = float(data["alive_at"])
        return found

    def silent_outages(self, now: float) -> list[Outage]:
        """The other replicas silent for SILENT_AFTER_SECONDS: down since their last word."""
        return [
            Outage(instance, at, min(now, at + SILENT_OUTAGE_SECONDS), killed=True)
            for instance, at in self._siblings_alive_at().items()
            if at < now - SILENT_AFTER_SECONDS
        ]

    def unconfirmed_siblings(self, since: float) -> list[str]:
        """Replicas that have not said they are alive since `since` and are not silent yet:
        whether they were up at `since` is known once they speak or fall silent."""
        return [
            instance
            for instance, at in self._siblings_alive_at().items()
            if since - SILENT_AFTER_SECONDS <= at < since
        ]

    def _read_outages(self) -> list[Outage]:
        return [Outage(**entry) for entry in self.storage.outages()]
