"""The gateway's own durable state, in a directory beside the trajectory store: its admin state
(policy version, upstreams, pause) and its lifecycle (when it was last alive), so that a
restarted gateway comes back as it left (rule 8) and knows when agents could not reach it
(rule 7: an agent that failed while the gateway was down failed because of DARL).

A SIGKILLed gateway leaves its last `alive_at`, written every `ALIVE_INTERVAL_SECONDS`; a
stopped one its `stopped_at`. The next start records the gap as an outage.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from darl.workflows.training_config import PauseMode

log = logging.getLogger(__name__)

ALIVE_INTERVAL_SECONDS = 1.0
# Clocks of the worker that asks and of the gateway, and the moments between a kill and the
# last write: an outage counts for an attempt that ran this close to it.
OUTAGE_MARGIN_SECONDS = 2.0
STATE_FILE = "admin-state.json"
OUTAGES_FILE = "outages.jsonl"


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


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        # Written by an atomic rename, so never torn; anything else is not ours to guess at.
        log.error("%s is not JSON; ignoring it", path)
        return None
    return data


@dataclass
class GatewayJournal:
    """`root/admin-state.json`, `root/lifecycle-<instance>.json`, `root/outages.jsonl`."""

    root: Path
    instance: str = "gateway"
    _outages: list[Outage] = field(default_factory=list)
    _outages_read_at: tuple[int, int] = (-1, -1)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    @property
    def _lifecycle(self) -> Path:
        return self.root / f"lifecycle-{self.instance}.json"

    # --- admin state -------------------------------------------------------------------

    def load_admin_state(self) -> AdminState | None:
        data = _read(self.root / STATE_FILE)
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
        _write_atomic(self.root / STATE_FILE, asdict(state))

    # --- lifecycle ---------------------------------------------------------------------

    def came_up(self, now: float | None = None) -> Outage | None:
        """Record this start; returns the outage that ended with it (None on a first start)."""
        now = time.time() if now is None else now
        last = _read(self._lifecycle)
        outage = None
        if last is not None:
            stopped = last.get("stopped_at")
            since = float(stopped if stopped is not None else last["alive_at"])
            outage = Outage(self.instance, since, now, killed=stopped is None)
            with (self.root / OUTAGES_FILE).open("a") as f:
                f.write(json.dumps(asdict(outage)) + "\n")
            log.warning("%s", outage.describe())
        self.alive(now)
        return outage

    def alive(self, now: float | None = None) -> None:
        _write_atomic(self._lifecycle, {"alive_at": time.time() if now is None else now})

    def went_down(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        _write_atomic(self._lifecycle, {"alive_at": now, "stopped_at": now})

    def outages_overlapping(self, start: float, end: float) -> list[Outage]:
        """Outages of any gateway sharing this journal within [start, end] (with a margin)."""
        margin = OUTAGE_MARGIN_SECONDS
        return [
            o for o in self._read_outages() if o.since - margin <= end and o.until + margin >= start
        ]

    def _read_outages(self) -> list[Outage]:
        """Re-read only when the file changed: closes ask for every attempt."""
        path = self.root / OUTAGES_FILE
        try:
            stat = path.stat()
        except FileNotFoundError:
            return []
        changed = (stat.st_mtime_ns, stat.st_size)
        if changed != self._outages_read_at:
            lines = path.read_text().splitlines()
            self._outages = [Outage(**json.loads(line)) for line in lines if line.strip()]
            self._outages_read_at = changed
        return self._outages
