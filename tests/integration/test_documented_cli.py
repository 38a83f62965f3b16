"""The `temporal workflow start` lines the manual (docs/) and the README show, taken from the
pages themselves: each names a workflow type and the task queue a DARL worker registers, the
one workflow id its input's id maps to, and reads its input with `--input-file`; the rollout
ones, run as the page shows them against the dev server and a rollout worker on
`darl-rollouts`, finish."""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from temporalio.testing import WorkflowEnvironment

from darl.workflows.contracts import RolloutResult, RolloutSpec, rollout_workflow_id
from darl.workflows.names import (
    ROLLOUT_TASK_QUEUE,
    ROLLOUT_WORKFLOW,
    TRAINER_TASK_QUEUE,
    TRAINING_WORKFLOW,
)
from darl.workflows.rollout_status import RolloutStatus
from darl.workflows.training_config import training_workflow_id
from tests.conftest import BIN
from tests.integration.stack import Stack

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
# The manual's pages and the front door.
PAGES = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]
QUEUES = {ROLLOUT_WORKFLOW: ROLLOUT_TASK_QUEUE, TRAINING_WORKFLOW: TRAINER_TASK_QUEUE}
# The pages that must show a rollout started with the temporal CLI.
ROLLOUT_PAGES = {"docs/reference/contracts.md", "docs/getting-started.md", "README.md"}
# One temporal command's limit: a rollout of the arithmetic example takes a few seconds.
COMMAND_TIMEOUT = 120
SHELLS = {"bash", "sh", "shell", "console"}


@dataclass(frozen=True)
class Block:
    """A shell block of a page, its commands with their continuation lines joined."""

    page: str
    commands: list[str]

    def starts(self) -> list[list[str]]:
        return [argv for argv in map(argv_of, self.commands) if argv[:3] == START]


START = ["temporal", "workflow", "start"]


def argv_of(command: str) -> list[str]:
    return shlex.split(command, comments=True)


def flag(argv: list[str], name: str) -> str | None:
    """The value of `--name value` or `--name=value` in `argv`, or None."""
    for i, word in enumerate(argv):
        if word == name and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(f"{name}="):
            return word.split("=", 1)[1]
    return None


def fenced(text: str) -> Iterator[tuple[str, str]]:
    """Each fenced block of a page: its language and its body."""
    language, body = None, []
    for line in text.splitlines():
        stripped = line.strip()
        if language is None and stripped.startswith("```"):
            language, body = stripped[3:].strip() or "text", []
        elif language is not None and stripped == "```":
            yield language, "\n".join(body)
            language = None
        elif language is not None:
            body.append(line)


def shell_blocks() -> Iterator[Block]:
    for path in PAGES:
        for language, body in fenced(path.read_text()):
            if language in SHELLS:
                lines = body.replace("\\\n", " ").splitlines()
                yield Block(str(path.relative_to(ROOT)), [c.strip() for c in lines if c.strip()])


def starts_a_rollout(argv: list[str]) -> bool:
    return flag(argv, "--type") == ROLLOUT_WORKFLOW


def documented_starts() -> list[tuple[Block, list[str]]]:
    return [(block, argv) for block in shell_blocks() for argv in block.starts()]


def input_of(block: Block, argv: list[str]) -> dict:
    """The JSON (or YAML) the start's `--input-file` holds: the file in the repository, or,
    for a file the block writes itself (`... train.yaml > /tmp/train.json`), its source."""
    given = flag(argv, "--input-file")
    assert given is not None
    if (ROOT / given).is_file():
        return yaml.safe_load((ROOT / given).read_text())
    for command in block.commands:
        words = argv_of(command)
        if ">" in words and words[words.index(">") + 1] == given:
            sources = [w for w in words[: words.index(">")] if w.endswith((".yaml", ".json"))]
            assert sources, f"{block.page}: {command!r} writes {given} from no file"
            return yaml.safe_load((ROOT / sources[-1]).read_text())
    raise AssertionError(f"{block.page}: {given} is neither in the repository nor written here")


def test_every_documented_start_names_the_registered_type_queue_and_id() -> None:
    starts = documented_starts()
    pages = {block.page for block, argv in starts if starts_a_rollout(argv)}
    assert pages >= ROLLOUT_PAGES, pages
    for block, argv in starts:
        shown = f"{block.page}: {shlex.join(argv)}"
        kind = flag(argv, "--type")
        assert kind in QUEUES, shown
        assert flag(argv, "--task-queue") == QUEUES[kind], shown
        assert flag(argv, "--input") is None, f"{shown}: the input goes by --input-file"
        data = input_of(block, argv)
        if kind == ROLLOUT_WORKFLOW:
            expected = rollout_workflow_id(RolloutSpec.model_validate(data).rollout_id)
        else:
            expected = training_workflow_id(data["run_id"])
        assert flag(argv, "--workflow-id") == expected, shown


@pytest.fixture(scope="module")
def rollout_worker(
    dev_env: WorkflowEnvironment, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """Policy server, gateway and a rollout worker on the task queue the docs name."""
    stack = Stack(Path(tmp_path_factory.mktemp("documented-cli")), dev_env.client)
    stack.task_queue = ROLLOUT_TASK_QUEUE
    yield stack.start()
    stack.stop()


def run(command: str, stack: Stack) -> subprocess.CompletedProcess[str]:
    env = {**stack.env(), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(
        ["bash", "-c", command],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
        cwd=ROOT,
        env=env,
        check=False,
    )


@pytest.mark.timeout(600)
async def test_the_documented_rollout_starts_run(rollout_worker: Stack) -> None:
    """Each page's start and result lines, exactly as shown (the temporal CLI finds the dev
    server by TEMPORAL_ADDRESS); the rollout's result is then read as a RolloutResult. Pages
    that show the same rollout id get its first result again, as a repeated start does."""
    blocks = [b for b in shell_blocks() if any(starts_a_rollout(a) for a in b.starts())]
    assert {b.page for b in blocks} >= ROLLOUT_PAGES
    for block in blocks:
        for argv in block.starts():
            workflow_id = flag(argv, "--workflow-id")
            lines = [
                c
                for c in block.commands
                if argv_of(c)[:3] in (START, ["temporal", "workflow", "result"])
                and flag(argv_of(c), "--workflow-id") == workflow_id
            ]
            for line in lines:
                done = run(line, rollout_worker)
                assert done.returncode == 0, f"{block.page}: {line}\n{done.stdout}{done.stderr}"
            handle = rollout_worker.client.get_workflow_handle(
                workflow_id, result_type=RolloutResult
            )
            result = await handle.result()
            assert result.status == RolloutStatus.SUCCEEDED, (block.page, result.error)
            assert workflow_id == rollout_workflow_id(result.rollout_id)
            assert result.calls >= 1, result  # its agent ran through the gateway
