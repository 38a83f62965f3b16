"""Weight sync (docs/architecture.md, "Weight sync"): pause the gateway, drain or keep the calls
in flight, load the new weights on every policy server, resume with the new policy version.

`PolicyServerControl` is the one interface the trainer drives; DARL's reference server is one
implementation, a vLLM server (its `/pause`, `/resume` and weight endpoints) is another. Every
operation is idempotent, so a retried sync after a crash just does it again.
`policy_server_control` makes the right one from a `PolicyServerSpec`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

import httpx

from darl.trainer.errors import TrainerError
from darl.workflows.training_config import (
    InflightMode,
    PauseMode,
    PolicyServerSpec,
    ServerPauseMode,
    check_keep,
)

log = logging.getLogger(__name__)


class WeightSyncError(TrainerError, RuntimeError):
    """A gateway or policy server refused a step of the sync (4xx): retrying will not help."""


def _checked(response: httpx.Response, what: str) -> httpx.Response:
    if response.status_code >= 500:
        # Retryable: the activity fails and Temporal tries again.
        response.raise_for_status()
    if response.status_code >= 400:
        raise WeightSyncError(f"{what}: {response.status_code} {response.text[:300]}")
    return response


class PolicyServerControl(Protocol):
    url: str

    @property
    def keeps_inflight_across_load(self) -> bool:
        """False for a server that restarts to load: calls in flight cannot survive it."""
        ...

    async def pause(self, mode: ServerPauseMode) -> None: ...

    async def load_weights(self, path: str, version: int) -> None: ...

    async def resume(self) -> None: ...

    async def loaded_version(self) -> int | None:
        """The policy version of the weights the server holds now (None: no version, a vLLM
        that restarted without DARL)."""
        ...


@dataclass
class ReferencePolicyServer:
    """DARL's reference server: vLLM's `/pause?mode=` and `/resume`, and `/reload_weights`
    from a checkpoint directory (in place, between two decode steps)."""

    url: str
    client: httpx.AsyncClient

    @property
    def keeps_inflight_across_load(self) -> bool:
        return True

    async def pause(self, mode: ServerPauseMode) -> None:
        _checked(
            await self.client.post(f"{self.url}/pause", params={"mode": mode}),
            f"pausing {self.url}",
        )

    async def load_weights(self, path: str, version: int) -> None:
        _checked(
            await self.client.post(
                f"{self.url}/reload_weights", json={"path": path, "version": version}
            ),
            f"loading {path} on {self.url}",
        )

    async def resume(self) -> None:
        _checked(await self.client.post(f"{self.url}/resume"), f"resuming {self.url}")

    async def loaded_version(self) -> int | None:
        response = _checked(await self.client.get(f"{self.url}/version"), f"asking {self.url}")
        return int(response.json()["policy_version"])


@dataclass
class VllmPolicyServer:
    """A vLLM OpenAI server started with `VLLM_SERVER_DEV_MODE=1` (same endpoints in vLLM
    0.24, verl 0.9.1's, and 0.32). Without `launcher_url` the weights are reloaded in place
    (`/collective_rpc` `reload_weights`, then the prefix cache is reset, preempting frozen
    calls so they recompute their KV cache on the new weights). With `launcher_url` (`darl
    vllm-server`) the launcher restarts vLLM on the checkpoint, as its CPU build needs: no call
    survives that, so `keep` is refused."""

    url: str
    client: httpx.AsyncClient
    launcher_url: str | None = None
    load_timeout_seconds: float = 600.0

    @property
    def keeps_inflight_across_load(self) -> bool:
        return self.launcher_url is None

    async def pause(self, mode: ServerPauseMode) -> None:
        _checked(
            await self.client.post(
                f"{self.url}/pause", params={"mode": mode}, timeout=self.load_timeout_seconds
            ),
            f"pausing {self.url}",
        )

    async def load_weights(self, path: str, version: int) -> None:
        if self.launcher_url is not None:
            _checked(
                await self.client.post(
                    f"{self.launcher_url}/load_weights",
                    json={"path": path, "version": version},
                    timeout=self.load_timeout_seconds,
                ),
                f"restarting {self.url} on {path}",
            )
            return
        _checked(
            await self.client.post(
                f"{self.url}/collective_rpc",
                json={"method": "reload_weights", "kwargs": {"weights_path": path}},
                timeout=self.load_timeout_seconds,
            ),
            f"reloading {path} on {self.url}",
        )
        reset = _checked(
            await self.client.post(
                f"{self.url}/reset_prefix_cache", params={"reset_running_requests": "true"}
            ),
            f"resetting the prefix cache of {self.url}",
        )
        if reset.json().get("success") is False:
            log.warning("%s kept its prefix cache: blocks computed before the load", self.url)
        # vLLM's own weight version, which the gateway reads to prove which weights answered.
        _checked(
            await self.client.post(
                f"{self.url}/update_weight_version", json={"new_version": str(version)}
            ),
            f"labelling the weights of {self.url} as version {version}",
        )

    async def resume(self) -> None:
        _checked(await self.client.post(f"{self.url}/resume"), f"resuming {self.url}")

    async def loaded_version(self) -> int | None:
        """vLLM's own weight version, which DARL labels with the policy version."""
        response = _checked(await self.client.get(f"{self.url}/weight_info"), f"asking {self.url}")
        try:
            return int(response.json()["weight_version"])
        except (TypeError, ValueError):
            return None


def policy_server_control(spec: PolicyServerSpec, client: httpx.AsyncClient) -> PolicyServerControl:
    """The control for one configured policy server (a WeightSyncError for a spec that makes
    no sense: retrying will not fix it)."""
    url = spec.url.rstrip("/")
    if spec.kind == "vllm":
        launcher = spec.launcher_url.rstrip("/") if spec.launcher_url else None
        return VllmPolicyServer(url, client, launcher)
    if spec.launcher_url is not None:
        raise WeightSyncError(f"{spec.url}: a reference server has no launcher (kind 'vllm'?)")
    return ReferencePolicyServer(url, client)


class GatewayAdmin(Protocol):
    """What a weight sync asks of the gateway: one (`GatewayControl`) or all its replicas
    (`trainer/gateway_replicas.py`)."""

    async def pause(self, mode: PauseMode, drain_seconds: float | None) -> bool: ...

    async def set_upstreams(self, urls: list[str]) -> None: ...

    async def resume(self, policy_version: int) -> None: ...


@dataclass
class GatewayControl:
    """One gateway's admin API (the admin key never reaches an agent)."""

    url: str
    admin_key: str
    client: httpx.AsyncClient

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"}

    async def pause(self, mode: PauseMode, drain_seconds: float | None) -> bool:
        """Pause; with `drain_seconds`, answer once the calls in flight have finished (or the
        time is up: False)."""
        body: dict = {"mode": mode}
        if drain_seconds is not None:
            body["drain_timeout_seconds"] = drain_seconds
        response = _checked(
            await self.client.post(
                f"{self.url}/admin/pause",
                json=body,
                headers=self._headers(),
                timeout=(drain_seconds or 0) + 30,
            ),
            "pausing the gateway",
        )
        return bool(response.json().get("drained", True))

    async def set_upstreams(self, urls: list[str]) -> None:
        """The policy servers the gateway forwards to, replacing its list."""
        _checked(
            await self.client.put(
                f"{self.url}/admin/upstreams", json={"upstreams": urls}, headers=self._headers()
            ),
            "registering the gateway's upstreams",
        )

    async def resume(self, policy_version: int) -> None:
        _checked(
            await self.client.post(
                f"{self.url}/admin/resume",
                json={"policy_version": policy_version},
                headers=self._headers(),
            ),
            "resuming the gateway",
        )


async def restore_weights(servers: list[PolicyServerControl], path: str, version: int) -> list[str]:
    """Load `path` (the weights of `version`) on every server that holds older ones; returns
    their URLs. No pause: the gateway records no call from a server behind the run, so it
    has been serving none. Idempotent: a server at `version` (or later) is left alone."""
    restored = []
    for server in servers:
        try:
            held = await server.loaded_version()
        except httpx.HTTPError as err:
            # Down or restarting: the next round looks again (a sync must not wait on it).
            log.info("%s does not say which weights it holds: %r", server.url, err)
            continue
        if held is None or held < version:
            log.warning(
                "%s holds version %s, the run %d: loading %s", server.url, held, version, path
            )
            await server.load_weights(path, version)
            restored.append(server.url)
    return restored


@dataclass(frozen=True)
class SyncOutcome:
    paused_seconds: float
    drained: bool | None


async def sync_weights(
    gateway: GatewayAdmin,
    servers: list[PolicyServerControl],
    path: str,
    version: int,
    inflight: InflightMode,
    drain_seconds: float,
    *,
    pause_mode: PauseMode,
    register_upstreams: bool,
) -> SyncOutcome:
    """New calls wait at the gateway while the weights change. `drain`: calls in flight
    finish on the old weights first. `keep`: they are frozen on the servers and continue on
    the new weights (a call records the version the gateway admitted it under). `keep` with
    a server that restarts to load raises WeightSyncError before anything is paused. With
    `register_upstreams`, the servers become the gateway's upstreams before it resumes. With
    replicas, every one is paused before any weights load and every one resumed after."""
    try:
        check_keep(inflight, [s.url for s in servers if not s.keeps_inflight_across_load])
    except ValueError as err:
        raise WeightSyncError(str(err)) from err
    started = time.monotonic()
    drained = await gateway.pause(pause_mode, drain_seconds if inflight == "drain" else None)
    if inflight == "keep":
        for server in servers:
            await server.pause("keep")
    for server in servers:
        await server.load_weights(path, version)
    if inflight == "keep":
        for server in servers:
            await server.resume()
    if register_upstreams:
        await gateway.set_upstreams([server.url for server in servers])
    await gateway.resume(version)
    return SyncOutcome(
        paused_seconds=time.monotonic() - started,
        drained=drained if inflight == "drain" else None,
    )
