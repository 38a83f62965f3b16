"""`darl train|status|stop` tell the truth: the Web UI link and endpoints of the stack the user
started (`<home>/stack.json`), `--set` overrides typed by the config, the status table's
header, a validation that lands after its row, the run's report, `stop --finish`'s grace."""

from __future__ import annotations

import asyncio
import io
import json
import os
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import typer
from rich.console import Console
from temporalio.api.enums.v1 import EventType
from temporalio.testing import WorkflowEnvironment
from typer.testing import CliRunner

from darl.deploy.cli import app
from darl.deploy.cli import training as training_cli
from darl.deploy.cli.support import failure_text
from darl.deploy.config_file import ConfigFileError, load_config
from darl.deploy.demo import DEMO_CONFIG, demo_config, report
from darl.deploy.devstack import DevPorts, DevStack
from darl.deploy.progress import HEADER, _print_new, step_table
from darl.deploy.stack_file import (
    StackEndpoints,
    find_stack,
    on_stack,
    read_stack_file,
    register_stack,
    remove_stack_file,
    stack_file,
    unregister_stack,
    user_registry,
    write_stack_file,
)
from darl.deploy.temporal_connection import DATA_CONVERTER
from darl.workflows.contracts import HttpAgentSpec
from darl.workflows.training_config import TrainingConfig
from darl.workflows.training_messages import StopRequest, TrainingSummary
from darl.workflows.training_state import Counters, StepRecord

MOVED = DevPorts(
    temporal=7300, ui=8300 + 1, gateway=8101, policy=8201, agent_service=8301, viewer=8401
)


def cli() -> typer.Typer:
    return app


def moved_stack(
    home: Path, temporal_address: str | None = None, model: str = "digits"
) -> StackEndpoints:
    stack = DevStack(
        home, MOVED, model=model, agent_service="darl.examples.digits.agent_service:app"
    )
    endpoints = stack.endpoints()
    if temporal_address is not None:
        endpoints = endpoints.model_copy(update={"temporal_address": temporal_address})
    write_stack_file(home, endpoints)
    return endpoints


def in_this_process(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    # run_client leaves with os._exit, which would end the test run.
    asyncio.run(main())


# --- the running stack: stack.json ---------------------------------------------------------


def test_the_stack_file_is_the_running_stacks(tmp_path: Path) -> None:
    written = moved_stack(tmp_path)
    assert read_stack_file(tmp_path) == written
    assert written.viewer_url == "http://127.0.0.1:8401" and written.pid == os.getpid()
    # Another process's stack is not removed by this one; this one's is.
    remove_stack_file(tmp_path, pid=written.pid + 1)
    assert stack_file(tmp_path).exists()
    remove_stack_file(tmp_path, pid=written.pid)
    assert read_stack_file(tmp_path) is None
    # A stack whose `darl dev` is gone (killed) is no stack.
    write_stack_file(tmp_path, written.model_copy(update={"pid": 2**22 + 12345}))
    assert read_stack_file(tmp_path) is None


def test_only_the_default_stacks_endpoints_move_to_the_running_stack(tmp_path: Path) -> None:
    stack = moved_stack(tmp_path)
    demo = load_config(DEMO_CONFIG)
    moved = on_stack(demo, stack)
    assert moved.weight_sync.gateway_admin_url == "http://127.0.0.1:8101"
    assert [s.url for s in moved.weight_sync.policy_servers] == ["http://127.0.0.1:8201"]
    assert isinstance(moved.rollout.agent, HttpAgentSpec)
    assert moved.rollout.agent.url == "http://127.0.0.1:8301/rollouts"
    # Endpoints of the user's own are theirs.
    own = load_config(
        DEMO_CONFIG,
        overrides=[
            "weight_sync.gateway_admin_url=http://gw:9000",
            "weight_sync.policy_servers=[http://a:1, http://b:1]",
            "rollout.agent.url=http://agents:9/rollouts",
        ],
    )
    assert on_stack(own, stack) == own


def test_the_demo_config_is_on_its_stack(tmp_path: Path) -> None:
    stack = DevStack(tmp_path, MOVED, model="digits", agent_service="x:app")
    config = demo_config(stack, "demo-1", steps=3)
    assert config.weight_sync.gateway_admin_url == stack.gateway_url
    assert [s.url for s in config.weight_sync.policy_servers] == [stack.policy_url]
    assert isinstance(config.rollout.agent, HttpAgentSpec)
    assert config.rollout.agent.url == f"{stack.agent_service_url}/rollouts"
    assert config.backend.model_dir == str(stack.model_dir)
    assert config.total_steps == 3 and config.run_id == "demo-1"


async def first_input(env: WorkflowEnvironment, workflow_id: str) -> TrainingConfig:
    history = await env.client.get_workflow_handle(workflow_id).fetch_history()
    started = history.events[0]
    assert started.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED
    payloads = started.workflow_execution_started_event_attributes.input.payloads
    [config] = await DATA_CONVERTER.decode(payloads, [TrainingConfig])
    return config


def test_train_links_and_aims_at_the_stack_the_user_started(
    dev_env: WorkflowEnvironment, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(training_cli, "run_client", in_this_process)
    monkeypatch.delenv("DARL_UI_URL", raising=False)
    monkeypatch.delenv("TEMPORAL_ADDRESS", raising=False)
    address = dev_env.client.service_client.config.target_host
    stack = moved_stack(tmp_path, temporal_address=address)
    run_id = f"stack-{uuid.uuid4().hex[:8]}"
    args = ["train", str(DEMO_CONFIG), "--run-id", run_id, "--home", str(tmp_path)]
    # No worker polls this queue: the run only has to start.
    args += ["--task-queue", f"nobody-{run_id}"]
    result = CliRunner().invoke(cli(), args)
    assert result.exit_code == 0, result.output
    assert f"Web UI: {stack.ui_url}/namespaces/default/workflows/train%2F{run_id}" in result.output
    assert f"Viewer: {stack.viewer_url}/runs/{run_id}" in result.output
    assert "gateway http://127.0.0.1:8100 -> http://127.0.0.1:8101" in result.output
    # The paths it resolved: beside the config file, and under .darl/ the stack's home.
    assert f"dataset: {DEMO_CONFIG.parent / 'tasks.jsonl'}" in result.output
    assert f"model: {tmp_path.resolve() / 'models' / 'digits'}" in result.output
    config = asyncio.run(first_input(dev_env, f"train/{run_id}"))
    assert config.weight_sync.gateway_admin_url == "http://127.0.0.1:8101"
    assert [s.url for s in config.weight_sync.policy_servers] == ["http://127.0.0.1:8201"]
    assert config.backend.model_dir == str(tmp_path.resolve() / "models" / "digits")
    # An explicit --ui-url wins.
    again = CliRunner().invoke(cli(), [*args, "--ui-url", "http://ui.example"])
    assert "Web UI: http://ui.example/namespaces/default/workflows/" in again.output
    # The run was running: the second `darl train` follows it, and says so.
    assert f"following train/{run_id} (already running)" in again.output, again.output


def test_stop_sends_the_grace_finish_asks_for(
    dev_env: WorkflowEnvironment, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(training_cli, "run_client", in_this_process)
    monkeypatch.delenv("TEMPORAL_ADDRESS", raising=False)
    address = dev_env.client.service_client.config.target_host
    run_id = f"stop-{uuid.uuid4().hex[:8]}"

    async def start() -> None:
        await dev_env.client.start_workflow(
            "TrainingWorkflow", "{}", id=f"train/{run_id}", task_queue=f"nobody-{run_id}"
        )

    async def signals() -> list[Any]:
        history = await dev_env.client.get_workflow_handle(f"train/{run_id}").fetch_history()
        return [
            e.workflow_execution_signaled_event_attributes
            for e in history.events
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
        ]

    async def stops() -> list[StopRequest]:
        return [
            (await DATA_CONVERTER.decode(s.input.payloads, [StopRequest]))[0]
            for s in await signals()
        ]

    asyncio.run(start())
    base = ["stop", run_id, "--temporal-address", address]
    # Without --temporal-address: the running dev stack's.
    moved_stack(tmp_path, temporal_address=address)
    on_the_stack = ["stop", run_id, "--home", str(tmp_path)]
    for args in (
        [*base, "--finish"],
        [*base, "--finish", "--finish-timeout", "30"],
        on_the_stack,
    ):
        result = CliRunner().invoke(cli(), args)
        assert result.exit_code == 0, result.output
    # Past what a run's timer may wait: refused here, never sent.
    too_long = CliRunner().invoke(cli(), [*base, "--finish", "--finish-timeout", "1e15"])
    assert too_long.exit_code == 2, too_long.output
    assert asyncio.run(stops()) == [
        StopRequest(cancel_inflight=False, grace_seconds=600),
        StopRequest(cancel_inflight=False, grace_seconds=30),
        StopRequest(cancel_inflight=True),
    ]
    # A plain stop names no field a trainer worker from before `grace_seconds` refuses.
    plain = json.loads(asyncio.run(signals())[-1].input.payloads[0].data)
    assert plain == {"cancel_inflight": True}


# --- --set ---------------------------------------------------------------------------------


def test_set_overrides_are_typed_by_the_config() -> None:
    config = load_config(
        DEMO_CONFIG,
        overrides=[
            "total_steps=5",
            "knobs.max_inflight=64",
            "weight_sync.gateway_admin_url=http://127.0.0.1:9100",
            "backend.settings.lr=0.01",
            "mode=sync",
        ],
    )
    assert config.total_steps == 5 and config.knobs.max_inflight == 64
    assert config.weight_sync.gateway_admin_url == "http://127.0.0.1:9100"
    assert config.backend.settings["lr"] == 0.01 and config.mode == "sync"
    assert config.knobs.max_staleness == 1  # the file's, untouched


def test_set_gives_a_text_field_the_text_as_written() -> None:
    """YAML would make `42` an int, `2024-01-05` a date and `{python}` a mapping: a text
    field takes the text itself."""
    config = load_config(DEMO_CONFIG, overrides=["run_id=2024-01-05", "dataset.path= 42.jsonl"])
    assert config.run_id == "2024-01-05"
    assert config.dataset.path.endswith("/42.jsonl")
    numbered = load_config(DEMO_CONFIG, overrides=["run_id=42"])
    assert numbered.run_id == "42"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("total_step=5", "--set total_step: no such config key; did you mean total_steps?"),
        (
            "knobs.max_inflght=4",
            "--set knobs.max_inflght: no such config key; did you mean knobs.max_inflight?",
        ),
        ("knobs=4", "knobs is a section"),
        ("total_steps", "expected key=value"),
        ("total_steps=many", "total_steps: Input should be a valid integer"),
        ("knobs.max_inflight=0", "knobs.max_inflight: Input should be greater than or equal"),
    ],
)
def test_a_wrong_set_says_what_is_wrong(override: str, message: str) -> None:
    with pytest.raises(ConfigFileError) as failed:
        load_config(DEMO_CONFIG, overrides=[override])
    assert message in str(failed.value)


def test_train_refuses_a_wrong_set_before_it_connects(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli(),
        ["train", str(DEMO_CONFIG), "--set", "totl_steps=3", "--home", str(tmp_path)],
        env={"COLUMNS": "400"},
    )
    assert result.exit_code == 2
    assert "did you mean total_steps?" in result.output


# --- the table and the report --------------------------------------------------------------


def record(step: int, val: float | None = None) -> StepRecord:
    return StepRecord(
        step=step,
        policy_version=step,
        reward_mean=0.5,
        reward_std=0.1,
        success_rate=0.25,
        groups=4,
        rollouts=16,
        response_tokens_mean=3.0,
        staleness_mean=0.0,
        paused_seconds=0.01,
        train_seconds=0.2,
        rollouts_ended=16 * step,
        rollouts_per_minute=60.0,
        time=float(step),
        val_reward_mean=val,
        val_success_rate=None if val is None else val,
    )


def test_the_status_table_has_its_header() -> None:
    lines = step_table([record(1), record(2)])
    assert lines[0] == HEADER and len(lines) == 3
    assert step_table([]) == []


def test_a_validation_that_lands_later_fills_the_val_column() -> None:
    out = io.StringIO()
    console = Console(file=out, width=200)
    shown: dict[int, StepRecord] = {}
    _print_new(console, [record(1)], shown)
    _print_new(console, [record(1), record(2)], shown)
    _print_new(console, [record(1, val=0.75), record(2)], shown)
    _print_new(console, [record(1, val=0.75), record(2)], shown)
    rows = out.getvalue().splitlines()
    val = HEADER.split().index("val")
    assert [row.split()[0] for row in rows] == ["1", "2", "1"]
    assert [row.split()[val] for row in rows] == ["-", "-", "0.75"]
    assert rows[2].endswith("validated")


def test_the_report_needs_no_run_dir_on_this_machine(tmp_path: Path) -> None:
    out = io.StringIO()
    summary = TrainingSummary(
        run_id="r",
        steps=2,
        policy_version=2,
        stopped=False,
        reason="completed 2 steps",
        counters=Counters(rollouts_started=32, rollouts_trained=32),
    )
    report(Console(file=out, width=200), summary, [record(1), record(2)], 10.0, tmp_path / "x")
    text = out.getvalue()
    assert "r: 2 steps in 10s (completed 2 steps)" in text
    assert "reward 0.500 (first 3 steps) -> 0.500 (last 3); success 25% -> 25%" in text
    assert "32 rollouts started (3.2 rollouts/s): 32 trained" in text
    assert "reward curve" not in text


def test_train_refuses_a_model_the_stacks_policy_server_does_not_serve(
    dev_env: WorkflowEnvironment, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The digits config on a stack serving the tiny model: one line, nothing started."""
    monkeypatch.setattr(training_cli, "run_client", in_this_process)
    monkeypatch.delenv("TEMPORAL_ADDRESS", raising=False)
    address = dev_env.client.service_client.config.target_host
    moved_stack(tmp_path, temporal_address=address, model="tiny")
    run_id = f"tiny-{uuid.uuid4().hex[:8]}"
    args = ["train", str(DEMO_CONFIG), "--run-id", run_id, "--home", str(tmp_path)]
    result = CliRunner().invoke(cli(), args)
    assert result.exit_code == 2, result.output
    [line] = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert "is not the model the dev stack's policy server serves" in line
    assert "models/tiny" in line


def test_config_paths_mean_the_files_directory_wherever_darl_train_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From another directory: the dataset beside the config is found; a --set path is the
    current directory's; `.darl/...` is the stack's home."""
    monkeypatch.chdir(tmp_path)
    home = tmp_path / "stack-home"
    config = load_config(DEMO_CONFIG, overrides=["run_dir=runs/mine"], home=home)
    assert config.dataset.path == str(DEMO_CONFIG.parent / "tasks.jsonl")
    assert Path(config.dataset.path).exists()
    assert config.run_dir == str(tmp_path / "runs" / "mine")
    assert config.backend.model_dir == str(home / "models" / "digits")


def test_a_command_finds_the_stack_from_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--home when given; else .darl here or in the nearest parent with a running stack; else
    the last `darl dev` started (registered for the user); else none."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    project = tmp_path / "project"
    nested = project / "src" / "deep"
    nested.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert find_stack(None, cwd=nested).endpoints is None

    registered = moved_stack(tmp_path / "registered")
    register_stack(tmp_path / "registered", os.getpid())
    found = find_stack(None, cwd=elsewhere)
    assert found.home == (tmp_path / "registered").resolve() and found.endpoints == registered
    assert "the last `darl dev` started" in found.describe()

    mine = moved_stack(project / ".darl")
    for here, how in ((project, "the current directory"), (nested, "a parent directory")):
        found = find_stack(None, cwd=here)
        assert (found.home, found.endpoints, found.found_by) == (project / ".darl", mine, how)
    explicit = find_stack(tmp_path / "registered", cwd=nested)
    assert explicit.endpoints == registered and explicit.found_by == "--home or DARL_HOME"

    # Another process's registration is not removed by this one; this one's is.
    unregister_stack(os.getpid() + 1)
    assert user_registry().exists()
    unregister_stack(os.getpid())
    assert find_stack(None, cwd=elsewhere).endpoints is None


def test_a_failure_says_a_cause_it_quotes_once() -> None:
    inner = AttributeError("module 'm' has no attribute 'nope'")
    middle = ValueError(f"cannot load reward function 'm:nope': {inner}")
    middle.__cause__ = inner
    outer = RuntimeError("Activity task failed")
    outer.__cause__ = middle
    assert failure_text(outer) == (
        "Activity task failed: cannot load reward function 'm:nope': module 'm' has no "
        "attribute 'nope'"
    )
