"""Shared fixtures: real Temporal servers from the pip-installed binaries (never downloaded),
and the Kubernetes API emulator."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.testing import WorkflowEnvironment

from darl.deploy.temporal_connection import DATA_CONVERTER
from darl.workflows import search_attributes as sa

BIN = Path(sys.executable).parent


async def _start_time_skipping() -> WorkflowEnvironment:
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=str(BIN / "temporal-test-server"),
        data_converter=DATA_CONVERTER,
    )
    await env.client.operator_service.add_search_attributes(
        AddSearchAttributesRequest(
            namespace="default",
            search_attributes={
                k.name: IndexedValueType.ValueType(k.indexed_value_type.value) for k in sa.ALL
            },
        )
    )
    return env


@pytest.fixture
async def time_skipping_env() -> AsyncIterator[WorkflowEnvironment]:
    """Temporal's time-skipping test server, with DARL's search attributes: one per test.
    The server's time skipping is a counted lock that a test can leave taken (an activity
    that completes after its workflow was cancelled does it, seen with temporal-test-server
    1.40); on a shared server every later test that skips time would then wait in real
    time and time out. A server per test costs ~0.1 s and keeps a leak inside its test."""
    env = await _start_time_skipping()
    yield env
    await env.shutdown()


@pytest.fixture(scope="session")
async def dev_env() -> AsyncIterator[WorkflowEnvironment]:
    """The real Temporal dev server (in memory), with DARL's search attributes."""
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(BIN / "temporal"),
        data_converter=DATA_CONVERTER,
        search_attributes=sa.ALL,
    )
    yield env
    await env.shutdown()


# The S3 emulator (moto's server mode) for the S3 trajectory store's tests.
from tests.s3_emulator import s3_bucket, s3_emulator  # noqa: E402, F401


@pytest.fixture
async def emulator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    """The Kubernetes API emulator (tests/k8s_emulator.py), one per test, under the test's
    tmp_path."""
    from tests.k8s_emulator import KubernetesEmulator

    # kr8s reads a kubeconfig even when given a URL: never a real cluster's here (a real one
    # would lend it its token and default namespace).
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    async with KubernetesEmulator(tmp_path / "emulator") as emu:
        yield emu
