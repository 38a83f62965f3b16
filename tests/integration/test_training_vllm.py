"""The same TrainingWorkflow against a real vLLM (the CPU build) as its policy server: the run's
config names it `{kind: vllm, launcher_url: ...}`, and each weight sync restarts vLLM through
`darl vllm-server` on the step's checkpoint, while the gateway holds new calls. Nothing in the
workflow knows which kind of server it drives."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from tests.integration.training_stack import (
    AGENT_SERVICE,
    check_finished_run,
    served_versions,
    start_training,
    training_config,
    training_result,
)
from tests.vllm_fixtures import VllmStack, running_vllm_stack

pytestmark = pytest.mark.integration

STEPS = 2


@pytest.fixture
def vllm_training_stack(dev_env: WorkflowEnvironment, tmp_path: Path) -> Iterator[VllmStack]:
    # Training answers are sampled (temperature 1), as in any RL run.
    stacks = running_vllm_stack(dev_env.client, tmp_path, train_temperature=1.0)
    stack = next(stacks)
    try:
        stack.start_agent_service(AGENT_SERVICE)
        stack.start_trainer_worker("trainer")
        yield stack
    finally:
        # Stops every process, then checks that no vLLM process is left.
        next(stacks, None)


async def test_the_training_workflow_syncs_weights_into_vllm(vllm_training_stack: VllmStack):
    stack = vllm_training_stack
    run_id = f"vllm-{uuid.uuid4().hex[:8]}"
    server = {"kind": "vllm", "url": stack.policy_url, "launcher_url": stack.launcher_url}
    config = training_config(
        stack,
        run_id,
        STEPS,
        weight_sync={"gateway_admin_url": stack.gateway_url, "policy_servers": [server]},
        # The vLLM preset answers the digits task at random: keep groups whose rewards tie.
        equal_reward_groups="train",
    )
    restarts_before = stack.vllm_status()["restarts"]
    handle = await start_training(stack.client, config, stack.trainer_queue)
    summary = await training_result(stack, handle, 400)
    check_finished_run(summary, config)

    # vLLM serves the last step's checkpoint as its version, restarted once per sync (the
    # run's own step 0 first, then each step).
    status = stack.vllm_status()
    checkpoints = Path(config.run_dir or "") / "checkpoints"
    assert status["model_dir"] == str(checkpoints / f"step-{STEPS:06d}")
    assert status["version"] == STEPS and status["running"]
    assert status["restarts"] - restarts_before == STEPS + 1

    # On-policy: the calls each step trained on were served by the version before it.
    assert served_versions(stack, run_id) == set(range(STEPS))
