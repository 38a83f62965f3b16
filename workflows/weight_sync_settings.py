"""A training run's weight sync settings: the policy servers it syncs weights into, the gateway
it pauses meanwhile, and how calls are held and kept across a sync (`WeightSyncSettings`,
part of the TrainingConfig)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from darl.workflows.contracts import Contract

PauseMode = Literal["hold", "reject"]
"""How the gateway holds new calls while the weights change: `hold` makes them wait, `reject`
answers 429 with Retry-After."""
InflightMode = Literal["drain", "keep"]
"""What happens to calls in flight at a sync: `drain` lets them finish on the old weights,
`keep` freezes them on the policy server and continues them on the new weights."""
ServerPauseMode = Literal["keep", "wait", "abort"]
"""How a policy server pauses (vLLM's `/pause?mode=`): `keep` freezes decoding to continue
it after the load, `wait` finishes what is running, `abort` ends it with finish reason
`abort`."""


class PolicyServerSpec(Contract):
    """One policy server the gateway forwards to and the trainer syncs weights into.

    `reference`: DARL's CPU server (reloads a checkpoint in place). `vllm`: a vLLM OpenAI
    server started with `VLLM_SERVER_DEV_MODE=1`; without `launcher_url` its weights are
    reloaded in place (`/collective_rpc reload_weights`, right on GPU); with `launcher_url`
    (`darl vllm-server`) the launcher restarts it on the new weights, as CPU builds need."""

    kind: Literal["reference", "vllm"] = "reference"
    """`reference` (the default): DARL's CPU server. `vllm`: a vLLM OpenAI server."""
    url: str
    """The server's base URL (`http://host:port`), as the trainer and the gateway reach it."""
    launcher_url: str | None = None
    """The `darl vllm-server` launcher that restarts the server on new weights; None (the
    default): the weights are reloaded in place."""

    @property
    def restarts_to_load(self) -> bool:
        """Whether the server restarts to load new weights (it has a `launcher_url`)."""
        return self.launcher_url is not None


GATEWAY_ADMIN_SCHEMES = ("http", "https", "dns+http", "dns+https")
"""The schemes of a gateway admin URL. `dns+`: every A/AAAA record of the name is a gateway
replica (resolved at each sync)."""


class WeightSyncSettings(Contract):
    """How new weights reach the policy servers after each step (docs/architecture.md, "Weight
    sync").

    `inflight` `drain` lets calls in flight finish (at most `drain_timeout_seconds`) before
    the weights change; `keep` pauses their decoding on the policy server instead and
    continues it on the new weights after the resume (not possible on a server that restarts
    to load). A policy server given as a plain URL is a `reference` one. With
    `register_upstreams` each sync makes `policy_servers` the gateway's upstreams (so the
    config is the one list of servers); turn it off when the gateway reaches them by other
    addresses than the trainer does.

    The gateway's admin API is `gateway_admin_url` (one gateway) or `gateway_admin_urls`
    (every replica: each `http(s)://host:port`, or `dns+http(s)://name:port` for every
    address of a name, a Kubernetes headless Service's). A sync pauses every replica before
    the weights load and resumes every one after; agents reach the replicas through a load
    balancer, never these addresses."""

    gateway_admin_url: str | None = None
    """The admin API of the one gateway (`http://host:port`); None when
    `gateway_admin_urls` gives the replicas. One of the two is required."""
    gateway_admin_urls: list[str] = Field(default_factory=list)
    """The admin API of every gateway replica: `http(s)://host:port` each, or
    `dns+http(s)://name:port` for every address of a name. Empty with `gateway_admin_url`."""
    policy_servers: list[PolicyServerSpec] = Field(min_length=1)
    """The policy servers the weights are loaded into (one at least); a plain URL is a
    `reference` server."""
    inflight: InflightMode = "drain"
    """What happens to calls in flight at a sync: `drain` (the default) lets them finish on
    the old weights; `keep` freezes them on the policy server and continues them on the new
    weights."""
    drain_timeout_seconds: float = Field(default=60.0, ge=0, le=3600)
    """Seconds a `drain` sync waits for the calls in flight before the weights change
    anyway (60 by default, 3600 at most)."""
    pause_mode: PauseMode = "hold"
    """How the gateway treats new calls while the weights change: `hold` (the default)
    makes them wait; `reject` answers 429 with Retry-After."""
    register_upstreams: bool = True
    """Whether each sync makes `policy_servers` the gateway's upstreams (True by default);
    turn it off when the gateway reaches them by other addresses than the trainer does."""
    check_every_seconds: float = Field(default=30.0, gt=0)
    """Seconds between the trainer's checks, between syncs, that every policy server still
    holds the run's weights; one that does not (it restarted on other weights) is loaded
    again, and the gateway records no call from it meanwhile. 30 by default."""

    @model_validator(mode="after")
    def _the_gateway_is_given_once(self) -> WeightSyncSettings:
        if self.gateway_admin_url is not None and self.gateway_admin_urls:
            raise ValueError(
                "give the gateway's admin API once: gateway_admin_url (one gateway) or "
                "gateway_admin_urls (its replicas), not both"
            )
        if not self.admin_urls:
            raise ValueError(
                "weight_sync needs the gateway's admin API: gateway_admin_url (one gateway) or "
                "gateway_admin_urls (each replica, or dns+http://<headless service>:<port>)"
            )
        for url in self.admin_urls:
            scheme, sep, rest = url.partition("://")
            if not sep or scheme not in GATEWAY_ADMIN_SCHEMES or not rest:
                raise ValueError(
                    f"gateway admin URL {url!r}: expected http(s)://host:port or "
                    "dns+http(s)://name:port"
                )
        return self

    @property
    def admin_urls(self) -> list[str]:
        """The gateway's admin addresses, whichever field gave them (`gateway_replicas`)."""
        given = [self.gateway_admin_url] if self.gateway_admin_url else self.gateway_admin_urls
        return [url.rstrip("/") for url in given]

    @field_validator("policy_servers", mode="before")
    @classmethod
    def _plain_urls_are_reference_servers(cls, servers: Any) -> Any:
        if not isinstance(servers, list):
            return servers
        return [{"url": s} if isinstance(s, str) else s for s in servers]

    @model_validator(mode="after")
    def _keep_needs_servers_that_load_in_place(self) -> WeightSyncSettings:
        check_keep(self.inflight, [s.url for s in self.policy_servers if s.restarts_to_load])
        return self


def check_keep(inflight: InflightMode, restarting: list[str]) -> None:
    """The one rule of `inflight: keep`: calls frozen on a policy server continue on its new
    weights, which a server that restarts to load cannot do. ValueError otherwise."""
    if inflight == "keep" and restarting:
        raise ValueError(
            f"inflight 'keep' cannot hold calls across a restart: {restarting} restart to load "
            "weights (use inflight 'drain')"
        )
