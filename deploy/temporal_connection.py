"""How every DARL component talks to Temporal: one data converter (pydantic JSON, so the
temporal CLI can send plain JSON) and tracing on every client and the workers built from it
(`darl.deploy.temporal_tracing`). For components, never called from workflow code."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.runtime import LoggingConfig, Runtime, TelemetryConfig, TelemetryFilter
from temporalio.service import TLSConfig

from darl.deploy.errors import DeployError
from darl.deploy.temporal_tracing import tracing_plugin

DATA_CONVERTER = pydantic_data_converter


# The dev server's address (`temporal server start-dev`, `darl dev`) and its namespace.
DEFAULT_ADDRESS = "127.0.0.1:7233"
DEFAULT_NAMESPACE = "default"


@dataclass(frozen=True)
class TemporalSettings:
    """Where Temporal is. Reads the temporal CLI's own variables: TEMPORAL_ADDRESS,
    TEMPORAL_NAMESPACE, TEMPORAL_API_KEY, TEMPORAL_TLS_CERT / TEMPORAL_TLS_KEY (mTLS)."""

    address: str = DEFAULT_ADDRESS
    namespace: str = DEFAULT_NAMESPACE
    api_key: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None

    @classmethod
    def from_env(cls, address: str | None = None, namespace: str | None = None) -> TemporalSettings:
        cert, key = os.environ.get("TEMPORAL_TLS_CERT"), os.environ.get("TEMPORAL_TLS_KEY")
        return cls(
            address=address or os.environ.get("TEMPORAL_ADDRESS", cls.address),
            namespace=namespace or os.environ.get("TEMPORAL_NAMESPACE", cls.namespace),
            api_key=os.environ.get("TEMPORAL_API_KEY") or None,
            tls_cert=Path(cert) if cert else None,
            tls_key=Path(key) if key else None,
        )

    def tls(self) -> bool | TLSConfig:
        if self.tls_cert and self.tls_key:
            return TLSConfig(
                client_cert=self.tls_cert.read_bytes(), client_private_key=self.tls_key.read_bytes()
            )
        return self.api_key is not None


class TemporalUnreachableError(DeployError):
    """No Temporal server answered at `address` (`reason`: the SDK's own words)."""

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(f"cannot reach Temporal at {address}")
        self.address = address
        self.reason = reason


async def connect(settings: TemporalSettings) -> Client:
    """A client of `settings`' namespace; raises TemporalUnreachableError when no server
    answers there."""
    try:
        return await Client.connect(
            settings.address,
            namespace=settings.namespace,
            api_key=settings.api_key,
            tls=settings.tls(),
            data_converter=DATA_CONVERTER,
            plugins=[tracing_plugin()],
        )
    except RuntimeError as err:
        # The SDK reports a failed connect as a RuntimeError, whatever the cause.
        raise TemporalUnreachableError(settings.address, str(err)) from err


def quiet_sdk_logs() -> None:
    """For a command a person runs: the SDK's core says only errors on the console (not a
    WARN line per retry while Temporal is away; the command says that once, itself)."""
    quiet = Runtime(
        telemetry=TelemetryConfig(
            logging=LoggingConfig(filter=TelemetryFilter(core_level="ERROR", other_level="ERROR"))
        )
    )
    Runtime.set_default(quiet, error_if_already_set=False)
