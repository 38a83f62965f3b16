"""A Stack whose gateway is several replicas behind HAProxy: real `darl gateway` processes
sharing one directory store and journal under distinct `--instance` names. Agents and the
rollout worker reach the balancer (`gateway_url`); the trainer is given every replica's
admin URL (`admin_urls`), as `gateway_admin_urls`."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import httpx
from temporalio.client import Client

from tests.haproxy import HAProxy
from tests.integration.stack import ADMIN_KEY, Stack


class ReplicatedStack(Stack):
    def __init__(self, root: Path, client: Client, replicas: int = 2) -> None:
        super().__init__(root, client)
        self.instances = [f"gateway-{chr(ord('a') + i)}" for i in range(replicas)]
        self.replica_urls: dict[str, str] = {}
        self.balancer: HAProxy | None = None

    def start_gateway(self, port: int = 0, signal_interval: float = 1.0) -> None:
        for instance in self.instances:
            self.start_replica(instance, 0, signal_interval)
        self.balancer = HAProxy(self.root / "haproxy", list(self.replica_urls.values())).start()
        self.gateway_url = self.balancer.url

    def start_replica(self, instance: str, port: int = 0, signal_interval: float = 1.0) -> None:
        info = self._start(
            instance,
            [
                "gateway",
                "--port",
                str(port),
                "--upstream",
                self.policy_url,
                "--store-dir",
                str(self.store_dir),
                "--signal-interval",
                str(signal_interval),
                "--instance",
                instance,
                *self.gateway_flags(),
            ],
        )
        self.replica_urls[instance] = info["url"]

    def restart_replica(
        self, instance: str, signal_interval: float = 1.0, kill: bool = True
    ) -> None:
        """SIGKILL (or stop) one replica and start it again on its port; the balancer and the
        other replicas serve meanwhile."""
        replica = self.processes.pop(instance)
        if kill:
            replica.kill()
        else:
            replica.stop()
        self.start_replica(
            instance, urlparse(self.replica_urls[instance]).port or 0, signal_interval
        )

    def restart_gateway(self, signal_interval: float = 1.0, kill: bool = False) -> None:
        """What the chaos tier's gateway kill does here: the first replica goes and returns."""
        self.restart_replica(self.instances[0], signal_interval, kill)

    def admin_urls(self) -> list[str]:
        return [self.replica_urls[i] for i in self.instances]

    def admin(self) -> httpx.Client:
        """The admin API of the first replica (the one the chaos tier kills)."""
        return self.replica_admin(self.instances[0])

    def replica_admin(self, instance: str) -> httpx.Client:
        return httpx.Client(
            base_url=self.replica_urls[instance],
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=30,
        )

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            if self.balancer is not None:
                self.balancer.stop()
                self.balancer = None
