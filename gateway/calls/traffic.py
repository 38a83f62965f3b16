"""Traffic control: which upstream serves a rollout, how many calls are in flight on each, and
the pause gate that holds (or refuses) new calls while weights are synced."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

from darl.gateway.errors import GatewayPausedError, GatewayRestartingError, PauseOutlastedError
from darl.workflows.training_config import PauseMode


class UpstreamPool:
    """Policy server base URLs. A rollout sticks to one upstream (its KV cache and its policy
    version stay consistent): sha256(rollout id) mod N over the sorted URLs."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.set(urls)

    def set(self, urls: Sequence[str]) -> None:
        cleaned = sorted({u.rstrip("/") for u in urls})
        if not cleaned:
            raise ValueError("at least one upstream is needed")
        self._urls = cleaned

    @property
    def urls(self) -> list[str]:
        return list(self._urls)

    def pick(self, rollout_id: str) -> str:
        digest = hashlib.sha256(rollout_id.encode()).hexdigest()[:8]
        return self._urls[int(digest, 16) % len(self._urls)]


@dataclass(frozen=True)
class Admission:
    upstream: str
    policy_version: int


class PauseGate:
    """Admits calls while running; while paused, holds them until resume (`hold`) or answers
    429 + Retry-After (`reject`). Counts in-flight calls per upstream so a pause can drain.

    Admission checks the pause flag and counts the call with no await in between, so no call
    slips past a pause unseen by `drain`. A gate starts as the gateway's journal left it: a
    gateway killed inside a weight sync comes back paused at the version it had.
    """

    def __init__(
        self,
        retry_after_seconds: int = 1,
        policy_version: int = 0,
        paused: bool = False,
        mode: PauseMode = "hold",
    ) -> None:
        self.retry_after_seconds = retry_after_seconds
        self.paused = paused
        self.mode: PauseMode = mode
        self.policy_version = policy_version
        self.paused_at: float | None = time.monotonic() if paused else None
        self.last_pause_seconds = 0.0
        self._resumed = asyncio.Event()
        if not paused:
            self._resumed.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._inflight: Counter[str] = Counter()
        self.held = 0
        # Set once a shutdown's grace for held calls has run out: they are answered 503.
        self._closed = False

    @asynccontextmanager
    async def admitted(self, upstream: str, hold_timeout: float) -> AsyncIterator[Admission]:
        await self._wait_until_open(hold_timeout)
        self._inflight[upstream] += 1
        self._idle.clear()
        try:
            yield Admission(upstream=upstream, policy_version=self.policy_version)
        finally:
            self._inflight[upstream] -= 1
            if self._inflight[upstream] <= 0:
                del self._inflight[upstream]
            if not self._inflight:
                self._idle.set()

    async def _wait_until_open(self, hold_timeout: float) -> None:
        while self.paused:
            if self._closed:
                raise GatewayRestartingError(
                    "the gateway is restarting while paused for a weight sync; retry",
                    headers={"Retry-After": str(self.retry_after_seconds)},
                )
            if self.mode == "reject":
                raise GatewayPausedError(
                    "the gateway is paused for a weight sync; retry after the Retry-After delay",
                    headers={
                        "Retry-After": str(self.retry_after_seconds),
                        "X-Darl-Paused": "true",
                        "X-Agl-Paused": "true",
                    },
                )
            self.held += 1
            try:
                async with asyncio.timeout(hold_timeout):
                    await self._resumed.wait()
            except TimeoutError as err:
                raise PauseOutlastedError(
                    f"the gateway stayed paused for more than {hold_timeout:g}s",
                    headers={"Retry-After": str(self.retry_after_seconds)},
                ) from err
            finally:
                self.held -= 1

    def pause(self, mode: PauseMode) -> None:
        self.mode = mode
        if not self.paused:
            self.paused = True
            self.paused_at = time.monotonic()
            self._resumed.clear()

    def resume(self, policy_version: int | None) -> None:
        if policy_version is not None:
            self.policy_version = policy_version
        if self.paused:
            self.last_pause_seconds = time.monotonic() - (self.paused_at or time.monotonic())
        self.paused = False
        self.paused_at = None
        self._resumed.set()

    async def drain(self, within_seconds: float) -> bool:
        """Wait until no call is in flight; False if `within_seconds` passed first."""
        try:
            async with asyncio.timeout(within_seconds):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def inflight(self) -> dict[str, int]:
        return dict(self._inflight)

    def close_held(self) -> None:
        """A stopping gateway's last word to calls it holds: they cannot wait for a resume
        that this process will not see, so each is answered 503 with Retry-After (a new call
        reaches the gateway once it is back). Calls in flight are not touched."""
        self._closed = True
        # Wakes every held call; each finds the gate closed and gives up.
        self._resumed.set()
