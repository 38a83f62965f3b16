from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from tests.integration.stack import Stack
from tests.integration.training_stack import start_training_stack


@pytest.fixture(scope="module")
def stack(
    dev_env: WorkflowEnvironment, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """Policy server, gateway and one worker, shared by the tests of a module."""
    running = Stack(Path(tmp_path_factory.mktemp("stack")), dev_env.client).start()
    yield running
    running.stop()


@pytest.fixture
def training_stack(dev_env: WorkflowEnvironment, tmp_path: Path) -> Iterator[Stack]:
    """Policy server (the digits model), gateway, rollout worker, agent service and one
    trainer worker, for one test."""
    stack = start_training_stack(tmp_path, dev_env.client)
    yield stack
    stack.stop()
