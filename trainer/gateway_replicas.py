"""The gateway's replicas as a weight sync sees them: every admin address the config names (a
URL per replica, or `dns+http://name:port` for every address of a headless Service's name),
resolved at each step of the sync, and the pause, upstreams and resume fanned out to all.

A pause counts once every replica has acknowledged it, including one that appeared while the
others were being paused (it starts with the journal's state, but only an acknowledgement
proves it holds calls). A replica that does not answer fails the step (retryable: the
activity's retry pauses again until it answers or has left the name's records).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

import httpx

from darl.trainer.errors import TrainerError
from darl.trainer.policy_control import GatewayControl, WeightSyncError
from darl.workflows.training_config import PauseMode

log = logging.getLogger(__name__)

DNS_PREFIX = "dns+"
# Rounds of "pause the replicas not yet paused, then look again" before the sync gives up
# (and its retry starts over): replicas that keep appearing are a rollout being scaled.
MAX_ROUNDS = 5

T = TypeVar("T")
Resolver = Callable[[str, int], Awaitable[list[str]]]


class ReplicasChangingError(TrainerError, RuntimeError):
    """New replicas kept appearing while the sync paused the others (retryable)."""


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every A and AAAA record of `host` (a headless Service's name has one per ready pod)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def _url(scheme: str, address: str, port: int, path: str) -> str:
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"{scheme}://{host}:{port}{path}"


@dataclass
class GatewayReplicas:
    """The admin API of every gateway replica; the same three operations as one
    `GatewayControl`, each done on all of them."""

    addresses: Sequence[str]
    admin_key: str
    client: httpx.AsyncClient
    resolve: Resolver = resolve_addresses

    async def urls(self) -> list[str]:
        """The replicas' admin URLs now (a name that resolves to nothing raises: retryable)."""
        found: set[str] = set()
        for address in self.addresses:
            if not address.startswith(DNS_PREFIX):
                found.add(address.rstrip("/"))
                continue
            parts = urlsplit(address.removeprefix(DNS_PREFIX))
            if parts.hostname is None:
                raise WeightSyncError(f"{address}: no name to resolve")
            port = parts.port or (443 if parts.scheme == "https" else 80)
            try:
                resolved = await self.resolve(parts.hostname, port)
            except socket.gaierror as err:
                raise ConnectionError(f"{address}: {err}") from err
            found.update(_url(parts.scheme, a, port, parts.path.rstrip("/")) for a in resolved)
        if not found:
            raise ConnectionError(f"no gateway replica behind {list(self.addresses)}")
        return sorted(found)

    def _control(self, url: str) -> GatewayControl:
        return GatewayControl(url, self.admin_key, self.client)

    async def pause(self, mode: PauseMode, drain_seconds: float | None) -> bool:
        """Pause every replica and, with `drain_seconds`, wait for each one's calls in flight;
        True if all drained in time. Looks again after each round for replicas that came up
        meanwhile, until a look finds none unpaused."""
        paused: set[str] = set()
        drained = True
        for _ in range(MAX_ROUNDS):
            new = [url for url in await self.urls() if url not in paused]
            if not new:
                return drained
            answers = await _on_all(
                new, lambda url: self._control(url).pause(mode, drain_seconds), "pausing"
            )
            drained = drained and all(answers)
            paused.update(new)
        raise ReplicasChangingError(f"gateway replicas kept appearing: {sorted(paused)}")

    async def set_upstreams(self, urls: list[str]) -> None:
        await _on_all(
            await self.urls(),
            lambda url: self._control(url).set_upstreams(urls),
            "registering upstreams",
        )

    async def resume(self, policy_version: int) -> None:
        """Resume every replica at `policy_version`, again for any that came up meanwhile."""
        resumed: set[str] = set()
        for _ in range(MAX_ROUNDS):
            new = [url for url in await self.urls() if url not in resumed]
            if not new:
                return
            await _on_all(new, lambda url: self._control(url).resume(policy_version), "resuming")
            resumed.update(new)
        raise ReplicasChangingError(f"gateway replicas kept appearing: {sorted(resumed)}")


async def _on_all(urls: list[str], step: Callable[[str], Awaitable[T]], what: str) -> list[T]:
    """`step` on every replica at once; every one is tried, then the first failure is raised
    (a refusal, WeightSyncError, before an unreachable replica)."""
    answers = await asyncio.gather(*(step(url) for url in urls), return_exceptions=True)
    failures = [
        (url, a) for url, a in zip(urls, answers, strict=True) if isinstance(a, BaseException)
    ]
    for url, failure in failures:
        log.warning("%s gateway replica %s failed: %r", what, url, failure)
    refused = [f for _, f in failures if isinstance(f, WeightSyncError)]
    if refused:
        raise refused[0]
    if failures:
        raise failures[0][1]
    return [a for a in answers if not isinstance(a, BaseException)]
