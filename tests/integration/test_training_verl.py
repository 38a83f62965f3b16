"""The same TrainingWorkflow, with the verl backend: verl's own FSDP actor worker in a Ray
worker group (on trainer/verl_cpu_platform.py: world size 1, gloo), driven through the real dev
server, gateway, policy server, rollout worker, agent service and trainer worker. Each step is
verl's checkpoint, the policy server serves verl's HF export, and the trainer worker leaves no
Ray process behind when it stops."""

from __future__ import annotations

import itertools
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from safetensors.torch import load_file

from darl.trainer.run_files import read_metrics
from darl.trainer.verl_backend import ACTOR_DIR, HF_DIR
from tests.integration.stack import Stack
from tests.integration.training_stack import (
    check_finished_run,
    served_versions,
    start_training,
    training_config,
    training_result,
)

pytestmark = pytest.mark.integration

STEPS = 3
# verl's keys. Small mini-batches (prompts of group_size answers), float32 compute (FSDP's
# mixed precision is bf16 unless told), a Ray without its dashboard.
VERL_ON_CPU = {
    "trainer.device": "cpu",
    "actor_rollout_ref.actor.optim.lr": 5e-3,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 4,
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision": {
        "param_dtype": "fp32",
        "reduce_dtype": "fp32",
        "buffer_dtype": "fp32",
    },
    "ray_kwargs.ray_init.num_cpus": 2,
    "+ray_kwargs.ray_init.include_dashboard": False,
}


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def alive(processes: list[psutil.Process]) -> list[str]:
    left = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{process.pid} {' '.join(process.cmdline())[:80]}")
        except psutil.NoSuchProcess:
            continue
    return left


async def test_the_training_workflow_trains_with_verls_worker(training_stack: Stack):
    stack = training_stack
    run_id = f"verl-{uuid.uuid4().hex[:8]}"
    config = training_config(
        stack,
        run_id,
        STEPS,
        backend={"name": "verl", "model_dir": str(stack.model_dir), "settings": VERL_ON_CPU},
    )
    assert config.backend.settings["actor_rollout_ref.rollout.n"] == config.group_size
    handle = await start_training(stack.client, config, stack.trainer_queue)
    summary = await training_result(stack, handle, 300)
    check_finished_run(summary, config)

    # Every step is verl's checkpoint with its HF export; each step changed the weights.
    checkpoints = Path(config.run_dir or "") / "checkpoints"
    exports = [checkpoints / f"step-{step:06d}" / ACTOR_DIR / HF_DIR for step in range(STEPS + 1)]
    weights = [load_file(export / "model.safetensors") for export in exports]
    for before, after in itertools.pairwise(weights):
        assert any(not torch.equal(before[name], after[name]) for name in before)

    # The metrics are verl's, from verl's worker.
    records = read_metrics(Path(config.run_dir or ""))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for record in records:
        assert "actor/pg_loss" in record["trainer"] and "actor/lr" in record["trainer"]

    # The policy server serves the last step's export, and each step's rollouts were served
    # by the step before (on-policy).
    async with httpx.AsyncClient(timeout=10) as http:
        served = (await http.get(f"{stack.policy_url}/version")).json()["policy_version"]
    assert served == STEPS
    assert served_versions(stack, run_id) == set(range(STEPS))

    # Stopping the trainer worker takes verl's Ray workers (and Ray) with it.
    trainer = stack.processes["trainer"]
    ray_processes = descendants(trainer.pid)
    assert any("ray" in " ".join(p.cmdline()) for p in ray_processes), ray_processes
    assert trainer.stop(grace=60) == 0
    deadline = time.monotonic() + 30
    while alive(ray_processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(ray_processes)
