"""The gateway as a real process on an S3 store (`--store-url s3://...`, against moto's S3
emulator on loopback, tests/s3_emulator.py): a rollout's calls land in the bucket, its journal
beside them, and the trainer's and the viewer's stores read them back from there."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from temporalio.testing import WorkflowEnvironment

from darl.gateway.store.url import open_store
from darl.viewer.trajectory import load_trajectory
from darl.workflows.rollout_status import RolloutStatus
from tests.integration.stack import Stack
from tests.integration.test_rollouts_e2e import RESULT_TIMEOUT, example_spec
from tests.s3_emulator import S3Emulator


@pytest.fixture(scope="module")
def s3_stack(
    dev_env: WorkflowEnvironment, tmp_path_factory: pytest.TempPathFactory, s3_emulator: S3Emulator
) -> Iterator[Stack]:
    """Policy server, gateway and worker; the gateway's store is a bucket in the emulator."""
    url = f"s3://{s3_emulator.new_bucket()}/darl"
    running = Stack(Path(tmp_path_factory.mktemp("s3-stack")), dev_env.client, url).start()
    yield running
    running.stop()


async def test_a_gateway_on_the_s3_emulator_serves_and_stores_calls(
    s3_stack: Stack, s3_emulator: S3Emulator
) -> None:
    spec = example_spec("darl.examples.arithmetic.calculator_agent", 1)
    handle = await s3_stack.start_rollout(spec)
    result = await asyncio.wait_for(handle.result(), RESULT_TIMEOUT)
    assert result.status == RolloutStatus.SUCCEEDED, result.error
    assert result.calls == 2

    # The trainer's read (TrainerActivities reads with read_sync on a thread).
    records = s3_stack.store().read_sync(spec.rollout_id, call_ids=result.call_ids)
    served = {line["id"]: line for line in s3_stack.policy_responses()}
    for record in records:
        answer = served[record.response["id"].split("-", 1)[1]]
        assert record.prompt_token_ids == answer["prompt_token_ids"]
        assert record.completion_token_ids() == answer["token_ids"][0]
    assert [r.sequence for r in records] == [0, 1]

    # The viewer's read, through the interface.
    assert s3_stack.store_url is not None
    found = await load_trajectory(open_store(s3_stack.store_url), spec.rollout_id, None)
    assert (found.attempts, [r.call_id for r in found.calls]) == ([1], result.call_ids)

    # Nothing went to a directory: the calls and the journal are objects in the bucket.
    assert not s3_stack.store_dir.exists()
    bucket = s3_stack.store_url.removeprefix("s3://").split("/")[0]
    s3 = boto3.client("s3", endpoint_url=s3_emulator.endpoint_url)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]]
    assert f"darl/{spec.rollout_id}/calls/attempt-1/0000000001.json" in keys
    assert "darl/_gateway/lifecycle-gateway.json" in keys
    assert f"darl/{spec.rollout_id}/attempt-1/closed" in keys

    shown = s3_stack.darl(
        "trajectory", spec.rollout_id, "--store-url", s3_stack.store_url, "--json"
    )
    assert shown.returncode == 0, shown.stderr
    assert result.call_ids[1] in json.dumps(json.loads(shown.stdout))
