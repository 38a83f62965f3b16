"""The trajectory viewer (`darl viewer`) and `darl trajectory` against the real dev server, a real
training run of the digits model and real multi-turn rollouts: every page over HTTP, unknown
ids, a store that lost a rollout's file, what the trainer would see, and a real browser
(Debian's Chromium through Playwright) watching a run train.

The module's training run is paused as soon as it starts, so the browser test sees it train
whatever the machine's speed: it opens the run's page, resumes the run and waits for a step
the page did not have. The other tests resume it too, if the browser test has not, and wait for
its end.

The module's dev server serves its Web UI too, so the same browser takes the manual's pictures
of the viewer and of a rollout in the Web UI (docs/images/, see `docs_screenshots`)."""

from __future__ import annotations

import asyncio
import html
import json
import re
import statistics
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from temporalio import workflow
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from darl.deploy.processes import ManagedProcess
from darl.deploy.temporal_connection import DATA_CONVERTER
from darl.gateway.store.directory import DirectoryTrajectoryStore
from darl.gateway.store.record import CallRecord
from darl.viewer.app import Viewer, ViewerSettings, create_viewer_app
from darl.viewer.temporal_view import TemporalView
from darl.workflows import search_attributes as sa
from darl.workflows.contracts import (
    HttpAgentSpec,
    LocalAgentSpec,
    PrefixSpec,
    RewardSpec,
    RolloutMode,
    RolloutResult,
    RolloutSpec,
    RolloutTimeouts,
    rollout_workflow_id,
)
from darl.workflows.names import PAUSE_SIGNAL, RESUME_SIGNAL, ROLLOUT_WORKFLOW
from darl.workflows.rollout_status import RolloutStatus
from darl.workflows.search_attributes import rollout_attributes
from darl.workflows.training_config import (
    AggregationSpec,
    BackendSpec,
    DatasetSpec,
    GroupsSpec,
    RolloutSettings,
    TrainingConfig,
    WeightSyncSettings,
    training_workflow_id,
)
from darl.workflows.training_messages import TrainingSummary
from tests.conftest import BIN
from tests.integration.dev_server import free_port
from tests.integration.docs_screenshots import browser_page, save_screenshot
from tests.integration.stack import Stack
from tests.integration.test_rollouts_e2e import RESULT_TIMEOUT, example_spec
from tests.integration.training_stack import (
    start_training,
    start_training_stack,
    training_config,
    training_result,
)

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
MEMBER = re.compile(r'class="reward">([^<]+)</b>.*?class="advantage">([^<]+)</b>', re.S)
SCRIPT = "<script>alert('x')</script>"


@pytest.fixture(scope="module")
def web_ui_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
async def dev_env(web_ui_port: int) -> AsyncIterator[WorkflowEnvironment]:
    """The real Temporal dev server (in memory) with DARL's search attributes, as the session's,
    and its Web UI on `web_ui_port`."""
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(BIN / "temporal"),
        data_converter=DATA_CONVERTER,
        search_attributes=sa.ALL,
        ui=True,
        ui_port=web_ui_port,
    )
    yield env
    await env.shutdown()


@dataclass
class ViewerStack:
    stack: Stack
    url: str
    handle: WorkflowHandle[Any, TrainingSummary]
    run_id: str
    multi_turn: RolloutResult
    lost_file: RolloutResult
    no_calls: RolloutResult
    resumed: bool = False

    def get(self, path: str, **params: Any) -> httpx.Response:
        # No `params` at all when none are given: httpx's would replace the path's own query.
        return httpx.get(f"{self.url}{path}", params=params or None, timeout=30)

    async def resume(self) -> None:
        """Resume the run, once: a completed run takes no more signals."""
        if not self.resumed:
            self.resumed = True
            await self.handle.signal(RESUME_SIGNAL)

    async def finished(self) -> TrainingSummary:
        await self.resume()
        return await training_result(self.stack, self.handle, 300)


@pytest.fixture(scope="module")
def served(
    dev_env: WorkflowEnvironment, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, str]]:
    """The training stack with a `darl viewer` process reading its store, runs and agents."""
    stack = start_training_stack(tmp_path_factory.mktemp("viewer"), dev_env.client)
    try:
        process = ManagedProcess.darl(
            "viewer",
            [
                "viewer",
                "--port",
                "0",
                "--store-dir",
                str(stack.store_dir),
                "--runs-dir",
                str(stack.runs_dir),
                "--agents-dir",
                str(stack.agents_dir),
                "--ui-url",
                "http://ui.example:8233",
            ],
            stack.root / "logs",
            env=stack.env(),
        )
        stack.processes["viewer"] = process.start()
        url = process.wait_ready(timeout=120)["url"]
    except BaseException:
        stack.stop()
        raise
    yield stack, url
    stack.stop()


async def _rollout(stack: Stack, spec: RolloutSpec) -> RolloutResult:
    handle = await stack.start_rollout(spec)
    return await asyncio.wait_for(handle.result(), RESULT_TIMEOUT)


@pytest.fixture(scope="module")
async def viewer_stack(served: tuple[Stack, str]) -> AsyncIterator[ViewerStack]:
    stack, url = served
    run_id = f"viewer-{uuid.uuid4().hex[:8]}"
    handle = await start_training(
        stack.client, training_config(stack, run_id, 6), stack.trainer_queue
    )
    await handle.signal(PAUSE_SIGNAL)
    multi = example_spec("darl.examples.arithmetic.calculator_agent", 3)
    multi = multi.model_copy(
        update={"task": {"question": f"What is 3 + 2? {SCRIPT}", "answer": "5"}}
    )
    lost = example_spec("darl.examples.arithmetic.calculator_agent", 4)
    quiet = RolloutSpec(
        run_id="viewer-quiet",
        rollout_id=f"quiet-{uuid.uuid4().hex[:8]}",
        task={},
        agent=LocalAgentSpec(command=["true"]),
        reward=RewardSpec(missing_reward=0.0),
        timeouts=RolloutTimeouts(agent_seconds=60),
    )
    results = await asyncio.gather(*(_rollout(stack, s) for s in (multi, lost, quiet)))
    for result in results:
        assert result.status == RolloutStatus.SUCCEEDED, result.error
    # The store loses the second rollout's file (a store on another disk, a cleanup).
    (stack.store_dir / lost.rollout_id / f"attempt-{results[1].attempts}.jsonl").unlink()
    yield ViewerStack(stack, url, handle, run_id, *results)


def _points(svg_html: str) -> int:
    return int(re.search(r'data-points="(\d+)"', svg_html).group(1))  # type: ignore[union-attr]


async def test_a_browser_watches_the_run_train_and_opens_a_rollout(
    viewer_stack: ViewerStack, tmp_path: Path
) -> None:
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is missing: `make test` installs it (apt-get)")
    from playwright.async_api import async_playwright

    v = viewer_stack
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=["--no-sandbox"], timeout=60_000
        )
        try:
            page = await browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(30_000)
            await page.goto(f"{v.url}/runs/{v.run_id}")
            first_chart = page.locator("svg.chart").first
            before = int(await first_chart.get_attribute("data-points") or "-1")
            steps_before = await page.locator("#steps tr[data-step]").count()
            await v.resume()
            # The script refetches the curves; no reload: a step appears that was not there.
            await page.wait_for_function(
                "n => Number(document.querySelector('svg.chart').dataset.points) > n",
                arg=before,
                timeout=120_000,
            )
            assert await page.locator("#live").get_attribute("data-refreshed")
            assert await page.locator("#steps tr[data-step]").count() > steps_before
            await page.screenshot(path=str(tmp_path / "run.png"), full_page=True)

            await page.goto(f"{v.url}/runs/{v.run_id}/rollouts")
            await page.fill("input[name=version]", "0")
            await page.select_option("select[name=mode]", "train")
            await page.click("#apply")
            await page.wait_for_selector("#rollouts tr.rollout")
            versions = await page.locator("#rollouts tr.rollout td:nth-child(7)").all_inner_texts()
            assert versions and set(versions) == {"0"}, versions
            assert "version=0" in page.url
            await page.screenshot(path=str(tmp_path / "rollouts.png"), full_page=True)

            await page.locator("#rollouts tr.rollout a").first.click()
            await page.wait_for_selector("#calls section.call")
            assert await page.locator("#calls .tok").count() > 0
            assert await page.locator("section.row").count() >= 1
            await page.screenshot(path=str(tmp_path / "rollout.png"), full_page=True)

            await page.goto(f"{v.url}/rollouts/{v.multi_turn.rollout_id}")
            assert await page.locator("#calls section.call").count() == 2
            # The prompt's <script> is text on the page, never run.
            assert SCRIPT in await page.locator("#calls").inner_text()
            await page.screenshot(path=str(tmp_path / "multi-turn.png"), full_page=True)
        finally:
            await browser.close()
    for name in ("run", "rollouts", "rollout", "multi-turn"):
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000


async def test_the_manuals_pictures_of_the_viewer_and_the_web_ui(
    viewer_stack: ViewerStack, web_ui_port: int
) -> None:
    """docs/images/: the finished run's page and a multi-turn rollout's in the viewer, and the
    rollout's workflow in the Temporal Web UI (its Summary and Current Details, its history)."""
    v = viewer_stack
    await v.finished()
    spec = example_spec("darl.examples.arithmetic.calculator_agent", 5)
    # Started as `darl rollout` starts one: with its Summary (mode and task) for the Web UI.
    handle = await v.stack.client.start_workflow(
        ROLLOUT_WORKFLOW,
        spec,
        id=rollout_workflow_id(spec.rollout_id),
        task_queue=v.stack.task_queue,
        result_type=RolloutResult,
        static_summary=sa.rollout_summary(spec),
    )
    rollout = await asyncio.wait_for(handle.result(), RESULT_TIMEOUT)
    assert rollout.status == RolloutStatus.SUCCEEDED, rollout.error
    workflow_page = f"http://127.0.0.1:{web_ui_port}/namespaces/default/workflows/" + quote(
        rollout_workflow_id(rollout.rollout_id), safe=""
    )
    async with browser_page() as page:
        await page.goto(f"{v.url}/runs/{v.run_id}")
        await page.wait_for_selector("svg.chart")
        shots = [await save_screenshot(page, "viewer-run")]

        await page.goto(f"{v.url}/rollouts/{rollout.rollout_id}")
        await page.wait_for_selector("#calls section.call")
        shots.append(await save_screenshot(page, "viewer-rollout"))
        await page.locator("#calls").evaluate("calls => calls.scrollIntoView()")
        shots.append(await save_screenshot(page, "viewer-rollout-calls"))

        # The Web UI reads Current Details from the rollout worker (a query) and draws each
        # Markdown text in a frame of its own.
        await page.goto(workflow_page)
        await page.wait_for_url("**/timeline")
        await page.goto(page.url.removesuffix("/timeline") + "/user-metadata")
        details = page.frame_locator('iframe[src*="attempt%201%20of"]')
        await details.get_by_text("attempt 1 of").wait_for()
        shots.append(await save_screenshot(page, "web-ui-rollout"))

        await page.goto(page.url.removesuffix("/user-metadata") + "/history")
        history = page.get_by_role("heading", name="Event History")
        await history.wait_for()
        await page.get_by_text("Workflow Execution Completed").first.wait_for()
        await history.evaluate("heading => heading.scrollIntoView()")
        shots.append(await save_screenshot(page, "web-ui-history"))
    for shot in shots:
        assert 10_000 < shot.stat().st_size < 400_000, shot


async def test_the_runs_page_and_the_run_page_show_the_finished_run(
    viewer_stack: ViewerStack,
) -> None:
    v = viewer_stack
    summary = await v.finished()
    runs = v.get("/")
    assert runs.status_code == 200
    assert f'href="/runs/{v.run_id}"' in runs.text
    row = runs.text.split(f'href="/runs/{v.run_id}"', 1)[1].split("</tr>", 1)[0]
    assert f"<td>{summary.steps}</td>" in row  # DarlStep
    assert "completed" in row

    run = v.get(f"/runs/{v.run_id}")
    assert run.status_code == 200
    assert run.text.count('<svg class="chart"') == 7
    assert _points(run.text) == 6
    assert "http://ui.example:8233/namespaces/default/workflows/train%2F" + v.run_id in run.text
    assert f"rollouts started</th><td>{summary.counters.rollouts_started}<" in run.text
    live = v.get(f"/runs/{v.run_id}/live")
    assert live.status_code == 200 and "<html" not in live.text and "svg" in live.text


async def test_the_rollouts_table_filters_and_pages_through_visibility(
    viewer_stack: ViewerStack,
) -> None:
    v = viewer_stack
    await v.finished()
    every = v.get(f"/runs/{v.run_id}/rollouts", size=20)
    assert every.status_code == 200
    assert every.text.count('<tr class="rollout">') == 20
    # Each finished rollout's answer, from its result.
    assert "<th>answer</th>" in every.text
    assert every.text.count('<td class="answer"><code>') >= 10, every.text[-3000:]
    second = re.search(r'id="next" href="\?([^"]+)"', every.text)
    assert second, "a run of 6 x 16 rollouts has a second page of 20"
    following = v.get(f"/runs/{v.run_id}/rollouts?{html.unescape(second.group(1))}")
    first_ids = set(re.findall(r'href="/rollouts/([^"]+)"', every.text))
    next_ids = set(re.findall(r'href="/rollouts/([^"]+)"', following.text))
    assert len(next_ids) == 20 and not first_ids & next_ids

    # Filter by one listed rollout's own version and reward: it must be among what comes back.
    rewarded = [
        (rollout_id, *re.findall(r"<td>([^<]*)</td>", cell)[-3:-1])
        for rollout_id, cell in re.findall(
            r'<tr class="rollout">.*?href="/rollouts/([^"]+)"(.*?)</tr>', every.text, re.S
        )
    ]
    known, shown, version = next(r for r in rewarded if r[1] not in ("", "-"))
    at_least = float(shown) - 0.001  # the table rounds to 3 places
    top = v.get(f"/runs/{v.run_id}/rollouts", version=version, reward_min=str(at_least), size=200)
    cells = re.findall(r'<tr class="rollout">.*?</tr>', top.text, re.S)
    assert f'href="/rollouts/{known}"' in top.text, top.text[-2000:]
    for cell in cells:
        reward, shown_version = re.findall(r"<td>([^<]*)</td>", cell)[-3:-1]
        assert float(reward) >= at_least and shown_version == version, cell
    assert v.get(f"/runs/{v.run_id}/rollouts", status="failed_infra").text.count('id="empty"')
    for bad in (
        {"version": "x"},
        {"version": str(2**63)},
        {"reward_min": "nan"},
        {"reward_max": "inf"},
    ):
        assert v.get(f"/runs/{v.run_id}/rollouts", **bad).status_code == 400, bad
    # A value is a quoted string in the visibility query, never more of the query.
    injected = v.get(f"/runs/{v.run_id}/rollouts", group="x' OR DarlRun != '")
    assert injected.status_code == 200 and injected.text.count('id="empty"'), injected.text[-2000:]
    for token in ("%%%", "AAAA"):  # not base64; base64 that Temporal cannot read
        assert v.get(f"/runs/{v.run_id}/rollouts", page=token).status_code == 404, token


async def test_a_group_shows_grpo_advantages_as_the_trainer_computes_them(
    viewer_stack: ViewerStack,
) -> None:
    v = viewer_stack
    await v.finished()
    page = v.get(f"/runs/{v.run_id}/rollouts", status="succeeded", mode="train", size=20)
    group = re.search(r'href="/groups/([^"]+)"', page.text).group(1)  # type: ignore[union-attr]
    shown = v.get(f"/groups/{group}")
    assert shown.status_code == 200
    # Its run is one click away, and each card labels what it shows.
    assert f'/ <a href="/runs/{v.run_id}">run {v.run_id}</a> / group' in shown.text
    assert shown.text.count("<p>answer ") >= 3 and "1 calls" not in shown.text
    members = [
        found.groups()
        for block in shown.text.split('<div class="member">')[1:]
        if (
            found := re.search(
                r'class="reward">([^<]+)</b>.*?class="advantage">([^<]+)</b>', block, re.S
            )
        )
    ]
    assert len(members) >= 3, shown.text
    rewards = [float(r) for r, _ in members]
    mean, std = statistics.mean(rewards), statistics.stdev(rewards)
    for reward, advantage in members:
        assert float(advantage) == pytest.approx((float(reward) - mean) / (std + 1e-6), abs=1e-3)


async def test_a_multi_turn_rollout_shows_its_calls_tokens_and_rows(
    viewer_stack: ViewerStack,
) -> None:
    v = viewer_stack
    rollout = v.get(f"/rollouts/{v.multi_turn.rollout_id}")
    assert rollout.status_code == 200
    text = rollout.text
    assert text.index('id="call-0"') < text.index('id="call-1"')
    assert "<script>alert" not in text and "&lt;script&gt;alert(" in text
    assert text.count('class="tok"') >= v.multi_turn.completion_tokens
    assert "finish <b" in text and "policy version <b>0</b>" in text
    assert "the default settings" in text  # a rollout of no training run
    assert 'id="agent-log"' in text and "expression" in text  # the local agent's own print
    assert "rollout%2F" + v.multi_turn.rollout_id in text
    rows = text.count('class="row"')
    assert rows >= 1 and f"{rows} rows from 2 calls" in text


async def test_a_trained_rollout_shows_the_runs_aggregation(viewer_stack: ViewerStack) -> None:
    v = viewer_stack
    await v.finished()
    page = v.get(f"/runs/{v.run_id}/rollouts", status="succeeded", size=20)
    rollout_id = re.search(r'href="/rollouts/([^"]+)"', page.text).group(1)  # type: ignore[union-attr]
    shown = v.get(f"/rollouts/{rollout_id}")
    assert shown.status_code == 200
    assert "the run's settings (its TrainingConfig)" in shown.text
    assert "prompts up to 16 tokens, responses up to 8" in shown.text  # the demo config's
    assert 'id="no-log"' in shown.text  # an HTTP agent service: no log on this machine


def test_unknown_ids_are_404_pages(viewer_stack: ViewerStack) -> None:
    v = viewer_stack
    for path, what in [
        ("/runs/no-such-run", "training run"),
        ("/rollouts/no-such-rollout", "rollout"),
        ("/groups/no-such-group", "group"),
    ]:
        response = v.get(path)
        assert response.status_code == 404, path
        assert "Not found: " + what in response.text
    assert v.get("/runs/no-such-run/live").status_code == 404


async def test_a_rollout_whose_spec_does_not_validate_shows_its_failure(
    viewer_stack: ViewerStack,
) -> None:
    """A rollout started by hand with a spec DARL refuses fails at once (rule 9); its page
    shows that failure, not a 500 from reading the input back."""
    v = viewer_stack
    rollout_id = f"bad-spec-{uuid.uuid4().hex[:8]}"
    handle = await v.stack.client.start_workflow(
        "RolloutWorkflow",
        {"rollout_id": rollout_id, "no_such_field": 1},
        id=f"rollout/{rollout_id}",
        task_queue=v.stack.task_queue,
    )
    with pytest.raises(WorkflowFailureError):
        await asyncio.wait_for(handle.result(), RESULT_TIMEOUT)
    page = v.get(f"/rollouts/{rollout_id}")
    assert page.status_code == 200, page.text[-2000:]
    assert "failed" in page.text


def test_a_store_missing_a_rollouts_file_is_said_on_the_page(viewer_stack: ViewerStack) -> None:
    v = viewer_stack
    for result in (v.lost_file, v.no_calls):
        response = v.get(f"/rollouts/{result.rollout_id}")
        assert response.status_code == 200, response.text[-1000:]
        assert 'id="missing"' in response.text
        assert 'id="status" class="status-succeeded"' in response.text


def test_darl_trajectory_prints_every_call_in_order(viewer_stack: ViewerStack) -> None:
    v = viewer_stack
    store = ["--store-dir", str(v.stack.store_dir)]
    rollout_id = v.multi_turn.rollout_id
    shown = v.stack.darl("trajectory", rollout_id, *store)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert out.index("call 0") < out.index("call 1"), out
    assert "succeeded" in out and "policy version 0" in out and SCRIPT in out
    assert out.count("completion:") == 2

    as_json = v.stack.darl("trajectory", rollout_id, "--json", "--tokens", *store)
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    assert [c["sequence"] for c in data["calls"]] == [0, 1]
    assert [c["call_id"] for c in data["calls"]] == v.multi_turn.call_ids
    assert data["result"]["status"] == "succeeded"
    for call in data["calls"]:
        assert len(call["completion_logprobs"]) == len(call["completion_token_ids"]) > 0

    tokens = v.stack.darl("trajectory", rollout_id, "--tokens", *store)
    assert tokens.returncode == 0 and "logprob" in tokens.stdout

    missing = v.stack.darl("trajectory", "no-such-rollout", *store)
    assert missing.returncode == 2
    assert "no rollout 'no-such-rollout'" in missing.stderr


# --- a branching group, from a real store and stub workflows on the dev server ------------------


@workflow.defn(name=ROLLOUT_WORKFLOW)
class FinishedRollout:
    """A rollout that reports the result its task holds."""

    @workflow.run
    async def run(self, spec: RolloutSpec) -> RolloutResult:
        return RolloutResult.model_validate(spec.task["result"])


@workflow.defn(name="TrainingConfigHolder")
class TrainingConfigHolder:
    """Starts with a run's TrainingConfig, all the viewer reads of its TrainingWorkflow."""

    @workflow.run
    async def run(self, config: TrainingConfig) -> None:
        return None


def _branch_call(rollout_id: str, call: int, text: str, replayed_from: str | None) -> CallRecord:
    answer = [call + 10, call + 11]
    content = [{"token": chr(65 + t % 26), "logprob": -0.5} for t in answer]
    return CallRecord(
        call_id=f"{rollout_id}-c{call}",
        rollout_id=rollout_id,
        attempt=1,
        sequence=-1,
        endpoint="chat.completions",
        upstream="http://policy",
        policy_version=0,
        created_at=1.0 + call,
        latency_ms=1.0,
        retry_count=0,
        streamed=False,
        request={"model": "m", "messages": [{"role": "user", "content": f"turn {call}"}]},
        response={
            "prompt_token_ids": [1, 2, call + 3],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                    "token_ids": answer,
                    "logprobs": {"content": content},
                }
            ],
        },
        prompt_token_ids=[1, 2, call + 3],
        replayed_from=replayed_from,
    )


async def test_a_branching_group_shows_its_prefix_once_and_each_branchs_continuation(
    dev_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """Seed `.0` of 4 calls branched at k = 2: `.1` reproduced both and made 3 calls of its
    own, `.2` left the prefix at call 1 and made 2. The trainer masks the seed's first 2 calls
    and `.1`'s 2 (one row a call in `transition`), leaves `.2` out of the group (the default
    `broken_branches: drop`), and the advantages come from the rows that leaves."""
    run_id = f"vb-{uuid.uuid4().hex[:8]}"
    group_id, queue = f"{run_id}.e0.t0", f"viewer-branch-{uuid.uuid4().hex[:8]}"
    seed, k = f"{group_id}.0", 2
    config = TrainingConfig(
        run_id=run_id,
        dataset=DatasetSpec(path="stub"),
        rollout=RolloutSettings(agent=HttpAgentSpec(url="http://127.0.0.1:9/stub")),
        backend=BackendSpec(model_dir="stub"),
        weight_sync=WeightSyncSettings(
            gateway_admin_url="http://127.0.0.1:9", policy_servers=["http://127.0.0.1:9"]
        ),
        group_size=3,
        batch_size=1,
        groups=GroupsSpec(mode="branch"),
        aggregation=AggregationSpec(mode="transition"),
    )
    store = DirectoryTrajectoryStore(tmp_path / "trajectories")
    # member: (reward, prefix calls reproduced, where it left the prefix, live calls)
    members = {0: (1.0, 0, None, 4), 1: (0.0, k, None, 3), 2: (0.5, 1, 1, 2)}
    specs = []
    for member, (reward, reproduced, diverged, live) in members.items():
        rollout_id = f"{group_id}.{member}"
        records = [_branch_call(rollout_id, i, f"seed step {i}", None) for i in range(live)]
        if member:
            records = [
                _branch_call(rollout_id, i, f"seed step {i}", f"{seed}-c{i}")
                for i in range(reproduced)
            ] + [
                _branch_call(rollout_id, reproduced + i, f"branch {member} step {i}", None)
                for i in range(live)
            ]
        for record in records:
            await store.append(record)
        result = RolloutResult(
            run_id=run_id,
            rollout_id=rollout_id,
            group_id=group_id,
            mode=RolloutMode.TRAIN,
            status=RolloutStatus.SUCCEEDED,
            reward=reward,
            attempts=1,
            calls=len(records),
            call_ids=[r.call_id for r in records],
            prefix_calls=reproduced,
            prefix_diverged_at=diverged,
        )
        specs.append(
            RolloutSpec(
                run_id=run_id,
                rollout_id=rollout_id,
                group_id=group_id,
                task={"result": result.model_dump(mode="json")},
                agent=LocalAgentSpec(command=["true"]),
                prefix=PrefixSpec(rollout_id=seed, attempt=1, calls=k) if member else None,
            )
        )
    client = dev_env.client
    async with Worker(
        client,
        task_queue=queue,
        workflows=[FinishedRollout, TrainingConfigHolder],
        workflow_runner=UnsandboxedWorkflowRunner(),
    ):
        await client.execute_workflow(
            TrainingConfigHolder.run, config, id=training_workflow_id(run_id), task_queue=queue
        )
        for spec in specs:
            await client.execute_workflow(
                ROLLOUT_WORKFLOW,
                spec,
                id=rollout_workflow_id(spec.rollout_id),
                task_queue=queue,
                search_attributes=rollout_attributes(spec, "succeeded"),
                result_type=RolloutResult,
            )
    temporal = TemporalView(client)
    async with asyncio.timeout(30):  # the group is listed once visibility has indexed it
        while len(await temporal.group(group_id)) < len(members):
            await asyncio.sleep(0.05)
    settings = ViewerSettings(store.root, tmp_path / "runs", tmp_path / "agents")
    app = create_viewer_app(Viewer(temporal, settings))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://viewer") as http:
        shown = await http.get(f"/groups/{group_id}")
    assert shown.status_code == 200, shown.text[-2000:]
    text = shown.text
    prefix, cards = text.split('id="members"')
    # The prefix once, above the members: the seed's first k completions, and no later one.
    assert text.count('id="prefix"') == 1 and f'id="branch-point">{k}</b>' in prefix
    assert prefix.count('class="prefix-call"') == k
    assert "seed step 0" in prefix and "seed step 1" in prefix and "seed step 2" not in prefix
    assert "seed step 0" not in cards
    found = {}
    for block in cards.split('<div class="member">')[1:]:
        rollout_id = re.search(r'href="/rollouts/([^"]+)"', block).group(1)  # type: ignore[union-attr]
        found[rollout_id] = block
    seed_card, whole, early = (found[f"{group_id}.{m}"] for m in members)
    assert "the seed" in seed_card and 'class="continuation">2</b>' in seed_card
    assert f'class="branched-at">{k}</b>' in whole and 'class="prefix-calls">2</b>' in whole
    assert "left the prefix early" not in whole and 'class="continuation">3</b>' in whole
    assert f'class="branched-at">{k}</b>' in early and 'class="prefix-calls">1</b>' in early
    assert "left the prefix early, at call 1: left out of the group" in early
    assert 'class="continuation">2</b>' in early
    # Masked as the trainer masks: the seed's k, each branch's reproduced calls.
    masked_rows = {}
    for member, block in zip(members, (seed_card, whole, early), strict=True):
        masked = re.search(r"(\d+) masked calls?", block).group(1)  # type: ignore[union-attr]
        rows = re.search(r'class="rows">(\d+)</span>', block).group(1)  # type: ignore[union-attr]
        masked_rows[member] = (int(masked), int(rows))
    assert masked_rows == {0: (k, 2), 1: (k, 3), 2: (1, 0)}
    by_row = [members[m][0] for m, (_, rows) in masked_rows.items() for _ in range(rows)]
    mean, std = statistics.mean(by_row), statistics.stdev(by_row)
    for member, block in zip(members, (seed_card, whole, early), strict=True):
        advantage = re.search(r'class="advantage">([^<]+)</b>', block).group(1)  # type: ignore[union-attr]
        if masked_rows[member][1] == 0:
            assert advantage == "-", member
            continue
        expected = (members[member][0] - mean) / (std + 1e-6)
        assert float(advantage) == pytest.approx(expected, abs=1e-3), member
