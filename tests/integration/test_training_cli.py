"""The training commands of docs/training.md, run as a user runs them: the temporal CLI
(start, query, signal, update) and the darl CLI (train --follow, status, pause, resume, stop,
plot) against a real stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from darl.deploy.progress import HEADER
from tests.conftest import BIN
from tests.integration.stack import Stack
from tests.integration.training_stack import training_config

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
TIMEOUT = 120


def temporal(stack: Stack, *args: str) -> dict | list | str:
    address = stack.env()["TEMPORAL_ADDRESS"]
    done = subprocess.run(
        [str(BIN / "temporal"), "workflow", *args, "--address", address, "--output", "json"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr + done.stdout
    return json.loads(done.stdout) if done.stdout.strip() else ""


def darl(stack: Stack, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "darl.deploy.cli", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=ROOT,
        env={**stack.env(), "DARL_RUNS_DIR": str(stack.runs_dir)},
        check=False,
    )
    assert done.returncode == 0, done.stderr + done.stdout
    return done.stdout


def query_status(stack: Stack, workflow_id: str) -> dict:
    answer = temporal(stack, "query", "--workflow-id", workflow_id, "--type", "status")
    assert isinstance(answer, dict)
    return answer["queryResult"][0]


def wait_until_status(stack: Stack, workflow_id: str, check, timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = query_status(stack, workflow_id)
        if check(status):
            return status
        time.sleep(1)
    raise AssertionError(f"{workflow_id} never got there: {status}")


def test_the_documented_training_commands(training_stack: Stack):
    stack = training_stack
    run_id = f"cli-{uuid.uuid4().hex[:8]}"
    workflow_id = f"train/{run_id}"
    config = training_config(stack, run_id, steps=50)
    config_file = stack.root / "train.json"
    config_file.write_text(config.model_dump_json(exclude_none=True))

    temporal(
        stack,
        "start",
        "--type",
        "TrainingWorkflow",
        "--task-queue",
        stack.trainer_queue,
        "--workflow-id",
        workflow_id,
        "--input-file",
        str(config_file),
    )
    wait_until_status(stack, workflow_id, lambda s: s["step"] >= 1)

    darl(stack, "pause", run_id)
    paused = wait_until_status(stack, workflow_id, lambda s: s["paused"])
    assert paused["phase"] == "paused"
    shown = darl(stack, "status", run_id)
    assert "paused" in shown
    assert HEADER in shown.splitlines(), shown  # the step rows say what their columns are
    darl(stack, "resume", run_id)

    knobs = temporal(
        stack,
        "update",
        "execute",
        "--workflow-id",
        workflow_id,
        "--name",
        "update_knobs",
        "--input",
        '{"learning_rate": 0.001, "max_inflight": 64}',
    )
    assert knobs["result"]["learning_rate"] == 0.001, knobs
    resumed = wait_until_status(stack, workflow_id, lambda s: s["step"] > paused["step"])
    assert resumed["knobs"]["learning_rate"] == 0.001

    darl(stack, "stop", run_id)
    summary = temporal(stack, "result", "--workflow-id", workflow_id)["result"]
    assert summary["stopped"] and summary["reason"] == "stopped by request"
    plot = Path(darl(stack, "plot", run_id).strip())
    assert plot == stack.runs_dir / run_id / "reward.png" and plot.stat().st_size > 0
    listed = temporal(stack, "list", "--query", f'DarlRun="{run_id}" AND DarlMode="trainer"')
    assert [w["execution"]["workflowId"] for w in listed] == [workflow_id]


def test_darl_train_follows_a_run_to_its_summary(training_stack: Stack):
    stack = training_stack
    run_id = f"follow-{uuid.uuid4().hex[:8]}"
    config = training_config(stack, run_id, steps=5)
    config_file = stack.root / "train.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    follow = [str(config_file), "--follow", "--task-queue", stack.trainer_queue]
    out = darl(stack, "train", *follow, "--set", "total_steps=2", "--ui-url", "http://ui:1")
    assert f"started train/{run_id}" in out
    assert f"Web UI: http://ui:1/namespaces/default/workflows/train%2F{run_id}" in out
    step_lines = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert [words[0] for words in step_lines] == ["1", "2"], out
    # The end is the demo's report, not the summary's JSON.
    assert f"{run_id}: 2 steps in" in out and "(completed 2 steps)" in out, out
    assert "rollouts started" in out and f"reward curve: {stack.runs_dir / run_id}" in out
    assert "{" not in out
    assert os.path.exists(stack.runs_dir / run_id / "metrics.jsonl")

    # --json: the raw summary instead.
    raw_config = training_config(stack, f"{run_id}-json", steps=1)
    raw_file = stack.root / "raw.json"
    raw_file.write_text(raw_config.model_dump_json(exclude_none=True))
    raw = darl(
        stack, "train", str(raw_file), "--follow", "--json", "--task-queue", stack.trainer_queue
    )
    summary = json.loads(raw[raw.index("{") :])
    assert summary["steps"] == 1 and summary["reason"] == "completed 1 steps"
    assert summary["seconds"] > 0
