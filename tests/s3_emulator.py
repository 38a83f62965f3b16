"""An S3 emulator for tests: moto's server mode on loopback (a kernel-chosen port), speaking
the S3 REST API over real HTTP, so the store's client (obstore) goes through its whole
stack. It is an emulator, not S3: it proves DARL's use of the API (conditional writes,
listings), not S3's latency or consistency under load."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import boto3
import pytest
from moto.server import ThreadedMotoServer

EMULATOR_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "emulator",
    "AWS_SECRET_ACCESS_KEY": "emulator",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass(frozen=True)
class S3Emulator:
    """A running emulator: where it listens and the environment that points clients at it."""

    endpoint_url: str

    def env(self) -> dict[str, str]:
        """The standard AWS variables for a process that should use the emulator."""
        return {**EMULATOR_CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint_url}

    def new_bucket(self) -> str:
        name = f"darl-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint_url, **_client_args()).create_bucket(
            Bucket=name
        )
        return name


def _client_args() -> dict[str, str]:
    return {
        "aws_access_key_id": EMULATOR_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": EMULATOR_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": EMULATOR_CREDENTIALS["AWS_DEFAULT_REGION"],
    }


@pytest.fixture(scope="session")
def s3_emulator() -> Iterator[S3Emulator]:
    """moto's S3 emulator for the session, with this process's AWS variables pointing at it
    (restored after), so `open_store("s3://...")` in a test reaches it as a gateway would."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    emulator = S3Emulator(f"http://{host}:{port}")
    saved = {name: os.environ.get(name) for name in emulator.env()}
    os.environ.update(emulator.env())
    try:
        yield emulator
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.stop()


@pytest.fixture
def s3_bucket(s3_emulator: S3Emulator) -> str:
    """A fresh, empty bucket in the emulator."""
    return s3_emulator.new_bucket()
