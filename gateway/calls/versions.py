"""Which weights a policy server serves, proven rather than assumed (rule 8).

A DARL reference server reports the policy version of the weights that produced an answer in
the answer's `X-Darl-Policy-Version` header, and its current one at `/version`. A vLLM
carries vLLM's own weight version, which DARL sets to the policy version at every load
(`/update_weight_version`) and reads at `/weight_info`; a vLLM that restarted without DARL
reports `default`, which is no version. When an answer carries no version, the gateway reads
the server's version after the answer arrived: one read, shared by every answer that arrived
before it started. An upstream found behind the run's version is stale: no call is recorded
from it until it reports the run's version again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import aiohttp

from darl.gateway.calls.forwarding import Forwarder
from darl.gateway.errors import APIError, UpstreamStaleError, UpstreamUnversionedError

log = logging.getLogger(__name__)

VERSION_HEADER = "X-Darl-Policy-Version"
POLL_SECONDS = 0.5

ServerKind = Literal["darl", "vllm"]


def unversioned(upstream: str, why: str) -> UpstreamUnversionedError:
    return UpstreamUnversionedError(
        f"cannot tell which weights policy server {upstream} serves ({why}): DARL needs a "
        "DARL reference server or a vLLM started with VLLM_SERVER_DEV_MODE=1",
    )


def version_in(headers: Mapping[str, str]) -> int | None:
    value = headers.get(VERSION_HEADER)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


@dataclass
class _VersionRead:
    """A read of an upstream's version under way, shared by the calls that wait for it, and
    when it started (monotonic)."""

    started: float
    read: asyncio.Future[int | None]


class UpstreamVersions:
    """Reads upstreams' versions (each read shared by the calls that wait for it) and keeps
    the set found stale."""

    def __init__(self, forwarder: Forwarder) -> None:
        self._forwarder = forwarder
        self._kinds: dict[str, ServerKind] = {}
        self._reads: dict[str, _VersionRead] = {}
        self.stale: set[str] = set()

    async def version_after(self, upstream: str, since: float) -> int | None:
        """The upstream's version as a read begun at or after `since` found it
        (time.monotonic()); None for a vLLM no one has labelled (it restarted on its own)."""
        under_way = self._reads.get(upstream)
        if under_way is None or under_way.started < since:
            # A task of its own: a caller that goes away does not take the read with it.
            read = asyncio.ensure_future(self._read(upstream))
            under_way = self._reads[upstream] = _VersionRead(time.monotonic(), read)
        return await asyncio.shield(under_way.read)

    def note(self, upstream: str, version: int | None, wanted: int) -> bool:
        """Record what an answer or a read of the version said; True when the upstream is
        behind `wanted`."""
        behind = version is None or version < wanted
        if behind and upstream not in self.stale:
            log.warning(
                "policy server %s serves version %s, behind %d: no call is recorded from it "
                "until it serves %d",
                upstream,
                version,
                wanted,
                wanted,
            )
            self.stale.add(upstream)
        elif not behind and upstream in self.stale:
            log.info("policy server %s serves version %s again", upstream, version)
            self.stale.discard(upstream)
        return behind

    async def wait_until_current(self, upstream: str, wanted: int, seconds: float) -> None:
        """Poll until the upstream serves at least `wanted`; APIError 503 after
        `seconds` (the call fails as an infra failure, never as the agent's)."""
        deadline = time.monotonic() + seconds
        version: int | None = None
        while True:
            try:
                version = await self.version_after(upstream, time.monotonic())
            except (APIError, aiohttp.ClientError, TimeoutError) as err:
                log.info("policy server %s not answering its version yet: %r", upstream, err)
            else:
                if not self.note(upstream, version, wanted):
                    return
            if time.monotonic() + POLL_SECONDS > deadline:
                raise UpstreamStaleError(
                    f"policy server {upstream} serves the weights of version {version}, behind "
                    f"the run's version {wanted}, and did not catch up within {seconds:g}s"
                )
            await asyncio.sleep(POLL_SECONDS)

    async def _read(self, upstream: str) -> int | None:
        kind = self._kinds.get(upstream)
        if kind in (None, "darl"):
            # vLLM has a /version too (its own release): a DARL server's names the policy.
            try:
                data = await self._forwarder.get_json(f"{upstream}/version")
            except aiohttp.ClientResponseError as err:
                if err.status != 404 or kind == "darl":
                    raise
            else:
                if isinstance(data, dict) and "policy_version" in data:
                    self._kinds[upstream] = "darl"
                    return int(data["policy_version"])
        try:
            data = await self._forwarder.get_json(f"{upstream}/weight_info")
        except aiohttp.ClientResponseError as err:
            if err.status == 404:
                raise unversioned(upstream, "no /version nor /weight_info") from err
            raise
        self._kinds[upstream] = "vllm"
        label = data.get("weight_version")
        try:
            return int(label)
        except (TypeError, ValueError):
            return None
