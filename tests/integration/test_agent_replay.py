"""Durable agents (rule 10): an agent killed from outside resumes by replay of its recorded
calls. The real policy server, gateway and rollout worker on the dev server; the agent is a
multi-turn harness on the official OpenAI and Anthropic SDKs (tests/agents/replay_agent.py),
killed with SIGKILL of its process group (or its agent service) after a known call."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from darl.trainer.run_files import read_metrics
from darl.workflows.contracts import (
    HttpAgentSpec,
    LocalAgentSpec,
    PrefixSpec,
    ReplaySpec,
    RewardSpec,
    RolloutResult,
    RolloutSpec,
    rollout_workflow_id,
)
from darl.workflows.training_config import TrainingConfig
from darl.workflows.training_messages import TrainingSummary
from tests.integration.replay_checks import (
    REPLAY_AGENT,
    Scenario,
    agent_log,
    check_resumed,
    local_spec,
    replay_settings,
    run_killed,
    sigkill_local_agent,
    trajectory_rows,
    wait_for_marker,
)
from tests.integration.stack import Stack
from tests.integration.training_stack import (
    check_finished_run,
    start_training,
    training_config,
    training_result,
)

pytestmark = pytest.mark.integration

ARITHMETIC_TASKS = Path(__file__).resolve().parents[2] / "examples" / "arithmetic" / "tasks.jsonl"


async def _replay(stack: Stack, scenario: Scenario):
    spec = local_spec(stack, scenario)
    return await run_killed(stack, spec, lambda: sigkill_local_agent(stack, spec.rollout_id))


async def test_a_killed_agent_resumes_by_replay_even_while_the_gateway_is_paused(
    stack: Stack,
) -> None:
    """Killed after 5 of 11 calls: attempt 2 gets the 5 recorded answers while the gateway is
    paused for a weight sync (they need no policy), and its first live call waits for the
    resume."""
    scenario = Scenario("chat", kill_after=5, turns=11)
    spec = local_spec(stack, scenario)
    store = stack.store()

    async def kill_then_pause() -> None:
        with stack.admin() as admin:
            admin.post("/admin/pause", json={"mode": "hold"}).raise_for_status()
        try:
            sigkill_local_agent(stack, spec.rollout_id)
            async with asyncio.timeout(60):
                while len(await store.read(spec.rollout_id, 2)) < scenario.kill_after:
                    await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)  # a live call would be recorded now, were it let through
            assert len(await store.read(spec.rollout_id, 2)) == scenario.kill_after
        finally:
            with stack.admin() as admin:
                admin.post("/admin/resume", json={}).raise_for_status()

    result = await run_killed(stack, spec, kill_then_pause)
    final = check_resumed(stack, result, scenario.kill_after)
    assert len(final) == 11

    # The viewer and `darl trajectory` say which calls were replayed, and from which call.
    store = ["--store-dir", str(stack.store_dir)]
    viewer = await asyncio.to_thread(
        stack._start,
        "viewer",
        ["viewer", "--port", "0", *store, "--agents-dir", str(stack.agents_dir)],
    )
    try:
        async with httpx.AsyncClient(base_url=viewer["url"], timeout=30) as http:
            page = (await http.get(f"/rollouts/{spec.rollout_id}")).text
    finally:
        stack.processes.pop("viewer").stop()
    assert 'id="replay"' in page and "5 calls of the final attempt replayed" in page
    for again in final[:5]:
        assert f'class="replayed">replayed from {again.replayed_from}<' in page
    shown = await asyncio.to_thread(stack.darl, "trajectory", spec.rollout_id, *store)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.count("replayed from") == 5


async def test_a_token_agent_resumes_into_one_training_row(stack: Stack) -> None:
    """A token-in, token-out agent's calls extend each other: interrupted or not, its
    trajectory is one row with no merge mismatch."""
    result = await _replay(stack, Scenario("tokens", 4, 9, {"PROTOCOL": "tokens"}))
    final = check_resumed(stack, result, 4)
    rows, counters = trajectory_rows(final)
    assert len(rows) == 1 and counters.merge_mismatches == 0 and counters.merged_calls == 8


@pytest.mark.parametrize(
    "settings",
    [
        {"PROTOCOL": "chat", "STREAM": "1"},
        {"PROTOCOL": "responses"},
        {"PROTOCOL": "responses", "STREAM": "1"},
        {"PROTOCOL": "messages"},
        {"PROTOCOL": "messages", "STREAM": "1"},
        {"PROTOCOL": "tokens", "STREAM": "1"},
        {"PROTOCOL": "chat", "PARALLEL": "2"},
    ],
    ids=lambda s: "-".join(s.values()),
)
async def test_every_protocol_resumes_by_replay(stack: Stack, settings: dict[str, str]) -> None:
    parallel = settings.get("PARALLEL") == "2"
    scenario = Scenario("matrix", kill_after=4, turns=5 if parallel else 7, settings=settings)
    result = await _replay(stack, scenario)
    check_resumed(stack, result, scenario.kill_after, ordered=not parallel)


async def test_a_clock_ends_the_replay_where_the_agent_differs(stack: Stack) -> None:
    """The tool prints the time at turn 2: the request after it matches nothing, the replay
    ends there and every later call is live."""
    scenario = Scenario("clock", 5, 8, {"TOOL": "clock", "CLOCK_TURN": "2"})
    result = await _replay(stack, scenario)
    assert result.status == "succeeded", result.error
    assert result.replayed_calls == 3 and result.replay_diverged_at == 3
    final = stack.store().read_sync(result.rollout_id, call_ids=result.call_ids)
    assert [r.replayed_from is not None for r in final] == [True] * 3 + [False] * 5
    again = [line for line in agent_log(stack, result.rollout_id) if line["attempt"] == 2]
    assert [line["replayed_from"] is not None for line in again] == [True] * 3 + [False] * 5
    # The recorded calls not used stay with attempt 1, untouched.
    assert len(stack.store().read_sync(result.rollout_id, 1)) == 5


async def test_a_duration_normalizer_replays_pytest_output(stack: Stack) -> None:
    """pytest prints a new duration on every run: strict, the replay ends at the first call
    after it; with the `durations` preset it reaches the kill point, each such call stored
    with the prompt sent now and the recorded answer, marked normalized."""
    pytest_tool = {"TOOL": "pytest"}
    normalized = Scenario(
        "pytest", 5, 8, pytest_tool, {"replay": ReplaySpec(normalize=["durations"])}
    )
    strict = Scenario("pytest-strict", 5, 8, pytest_tool)
    loose, exact = await asyncio.gather(_replay(stack, normalized), _replay(stack, strict))

    assert exact.status == "succeeded" and exact.replayed_calls == 1, exact
    assert exact.replay_diverged_at == 1

    assert loose.status == "succeeded" and loose.replayed_calls == 5, loose
    assert loose.replay_diverged_at is None
    store = stack.store()
    first = store.read_sync(loose.rollout_id, 1)
    final = store.read_sync(loose.rollout_id, call_ids=loose.call_ids)
    assert [r.replay_normalized for r in final[:5]] == [False] + [True] * 4
    for original, again in zip(first, final[:5], strict=True):
        assert again.replayed_from == original.call_id
        assert again.completion_token_ids() == original.completion_token_ids()
        assert again.completion_logprobs() == original.completion_logprobs()
        if again.replay_normalized:
            # The prompt the agent sent this time, tokenized by the policy server.
            assert again.request["messages"] != original.request["messages"]
            assert again.prompt_token_ids != original.prompt_token_ids
    # The live call after them extends the normalized prompts: still one conversation.
    assert final[5].prompt_token_ids[: len(final[4].prompt_token_ids)] == final[4].prompt_token_ids


async def test_restart_generates_the_episode_again(stack: Stack) -> None:
    result = await _replay(stack, Scenario("restart", 4, 6, spec_overrides={"resume": "restart"}))
    assert result.status == "succeeded" and result.attempts == 2, result
    assert result.replayed_calls == 0 and result.replay_diverged_at is None
    final = stack.store().read_sync(result.rollout_id, call_ids=result.call_ids)
    assert len(final) == 6 and all(r.replayed_from is None for r in final)
    served = {line["call_id"] for line in stack.policy_responses()}
    assert {r.call_id for r in final} <= served


async def test_a_restarted_agent_service_resumes_by_replay(stack: Stack) -> None:
    """The agent HTTP service is SIGKILLed mid-attempt and started again: its journal answers
    the lost attempt 410, and the next attempt's POST replays the first one's calls."""
    scenario = Scenario("service", kill_after=3, turns=6)
    stack.extra_env = replay_settings(stack, scenario)
    try:
        await asyncio.to_thread(stack.start_agent_service, "tests.agents.replay_service:app")
        spec = local_spec(stack, scenario, HttpAgentSpec(url=f"{stack.agent_service_url}/rollouts"))
        result = await run_killed(
            stack, spec, lambda: asyncio.to_thread(stack.restart_agent_service)
        )
    finally:
        stack.extra_env = {}
        service = stack.processes.pop("agent-service", None)
        if service is not None:
            service.stop()
    check_resumed(stack, result, scenario.kill_after)


async def test_a_third_attempt_replays_the_second(stack: Stack) -> None:
    """Killed after 3 calls, then again after 6: attempt 2's record holds the 3 it replayed
    and 3 live ones, and attempt 3 replays all 6. Every prompt was generated once."""
    scenario = Scenario("chain", kill_after=3, turns=9, settings={"KILL_AFTER": "3,6"})
    spec = local_spec(stack, scenario)
    handle = await stack.start_rollout(spec)
    for attempt in (1, 2):
        await wait_for_marker(stack, spec.rollout_id, attempt)
        sigkill_local_agent(stack, spec.rollout_id, attempt)
    result = await asyncio.wait_for(handle.result(), 120)
    assert result.status == "succeeded" and result.attempts == 3, result
    assert result.replayed_calls == 6 and result.replay_diverged_at is None
    store = stack.store()
    one, two = store.read_sync(spec.rollout_id, 1), store.read_sync(spec.rollout_id, 2)
    final = store.read_sync(spec.rollout_id, call_ids=result.call_ids)
    assert (len(one), len(two), len(final)) == (3, 6, 9)
    assert [r.replayed_from for r in two[:3]] == [r.call_id for r in one]
    assert [r.replayed_from for r in final[:6]] == [r.call_id for r in two]
    assert all(r.replayed_from is None for r in [*two[3:], *final[6:]])
    generated = Counter(tuple(line["prompt_token_ids"]) for line in stack.policy_responses())
    episode = [*one, *two[3:], *final[6:]]
    assert all(generated[tuple(r.prompt_token_ids)] == 1 for r in episode)
    assert trajectory_rows(final)[0] == trajectory_rows(episode)[0]


# --- rollouts that start from another's recorded prefix (branches, docs/branching.md) -----


async def _seed(stack: Stack, name: str, turns: int, settings: dict[str, str] | None = None):
    """A rollout run whole, for branches to start from."""
    spec = local_spec(stack, Scenario(name, kill_after=0, turns=turns, settings=settings or {}))
    result = await asyncio.wait_for((await stack.start_rollout(spec)).result(), 120)
    assert result.status == "succeeded" and result.attempts == 1, result
    return spec, stack.store().read_sync(spec.rollout_id, call_ids=result.call_ids)


def _branch(stack: Stack, seed: RolloutSpec, calls: int, scenario: Scenario) -> RolloutSpec:
    """A rollout of the seed's task that starts from the seed's first `calls` calls."""
    prefix = PrefixSpec(rollout_id=seed.rollout_id, attempt=1, calls=calls)
    scenario.spec_overrides = {"task": seed.task, "prefix": prefix}
    return local_spec(stack, scenario)


async def test_a_branch_replays_the_seeds_first_calls_then_goes_live(stack: Stack) -> None:
    """The branch's agent runs from its start: the gateway answers its first 3 calls from the
    seed's record (the policy generates none of them again), and its 4th, the seed's 4th
    prompt, is sampled anew."""
    seed, seed_calls = await _seed(stack, "seed", turns=6)
    spec = _branch(stack, seed, 3, Scenario("branch", kill_after=0, turns=6))
    result = await asyncio.wait_for((await stack.start_rollout(spec)).result(), 120)
    assert result.status == "succeeded" and result.attempts == 1, result
    assert (result.prefix_calls, result.prefix_diverged_at, result.replayed_calls) == (3, None, 3)
    final = stack.store().read_sync(spec.rollout_id, call_ids=result.call_ids)
    assert len(final) == 6
    assert [r.replayed_from for r in final[:3]] == [r.call_id for r in seed_calls[:3]]
    for again, original in zip(final[:3], seed_calls, strict=False):
        assert again.rollout_id == spec.rollout_id
        assert again.response == original.response
        assert again.prompt_token_ids == original.prompt_token_ids
        assert again.completion_logprobs() == original.completion_logprobs()
        assert again.policy_version == original.policy_version
    assert all(r.replayed_from is None for r in final[3:])
    generated = Counter(tuple(line["prompt_token_ids"]) for line in stack.policy_responses())
    assert [generated[tuple(r.prompt_token_ids)] for r in seed_calls[:4]] == [1, 1, 1, 2]
    assert final[3].prompt_token_ids == seed_calls[3].prompt_token_ids
    served = {line["call_id"] for line in stack.policy_responses()}
    assert not served & {r.call_id for r in final[:3]}
    marked = {line["call_id"]: line["replayed_from"] for line in agent_log(stack, spec.rollout_id)}
    assert [marked[r.call_id] for r in final] == [r.replayed_from for r in final]


async def test_a_branch_killed_after_its_prefix_resumes_by_replay(stack: Stack) -> None:
    """Killed after the 3 prefix calls and 2 live ones: attempt 2 replays all 5 (the prefix
    through attempt 1's record) and still counts 3 as the prefix."""
    seed, seed_calls = await _seed(stack, "seed-kill", turns=7)
    spec = _branch(stack, seed, 3, Scenario("branch-kill", kill_after=5, turns=7))
    result = await run_killed(stack, spec, lambda: sigkill_local_agent(stack, spec.rollout_id))
    assert result.status == "succeeded" and result.attempts == 2, result
    assert (result.prefix_calls, result.prefix_diverged_at, result.replayed_calls) == (3, None, 5)
    store = stack.store()
    one = store.read_sync(spec.rollout_id, 1)
    final = store.read_sync(spec.rollout_id, call_ids=result.call_ids)
    assert [r.replayed_from for r in one[:3]] == [r.call_id for r in seed_calls[:3]]
    assert [r.replayed_from for r in final[:5]] == [r.call_id for r in one]
    generated = Counter(tuple(line["prompt_token_ids"]) for line in stack.policy_responses())
    assert [generated[tuple(r.prompt_token_ids)] for r in seed_calls[:3]] == [1, 1, 1]
    served = {line["call_id"] for line in stack.policy_responses()}
    assert {r.call_id for r in one[3:]} <= served
    assert not served & {r.call_id for r in [*one[:3], *final[:5]]}


async def test_a_branch_that_leaves_its_prefix_early_says_where(stack: Stack) -> None:
    """The tool prints the time at turn 1: the branch's 3rd request is not the seed's, so a
    prefix of 4 calls ends after 2 and the result says so; the rollout goes on live."""
    clock = {"TOOL": "clock", "CLOCK_TURN": "1"}
    seed, _ = await _seed(stack, "seed-clock", turns=5, settings=clock)
    spec = _branch(stack, seed, 4, Scenario("branch-clock", 0, 5, settings=clock))
    result = await asyncio.wait_for((await stack.start_rollout(spec)).result(), 120)
    assert result.status == "succeeded", result.error
    assert (result.prefix_calls, result.prefix_diverged_at, result.replayed_calls) == (2, 2, 2)
    final = stack.store().read_sync(spec.rollout_id, call_ids=result.call_ids)
    assert [r.replayed_from is not None for r in final] == [True] * 2 + [False] * 3


async def _branching_run(
    stack: Stack,
    agent: LocalAgentSpec,
    branch_at: str,
    reward: RewardSpec | None = None,
    **overrides: Any,
) -> tuple[TrainingConfig, TrainingSummary]:
    """2 steps of 2 branching groups of 3 with `agent` (and `reward`, else the demo's), on the
    module's stack and a trainer worker of its own."""
    config = training_config(
        stack,
        f"branching-{uuid.uuid4().hex[:8]}",
        2,
        group_size=3,
        batch_size=2,
        min_group_size=3,
        equal_reward_groups="train",
        groups={"mode": "branch", "branch_at": branch_at},
        **overrides,
    )
    data = config.model_dump(mode="json")
    data["rollout"]["agent"] = agent.model_dump(mode="json")
    if reward is not None:
        data["rollout"]["reward"] = reward.model_dump(mode="json")
    config = TrainingConfig.model_validate(data)
    await asyncio.to_thread(stack.start_trainer_worker, "trainer")
    try:
        handle = await start_training(stack.client, config, stack.trainer_queue)
        summary = await training_result(stack, handle, 240)
    finally:
        stack.processes.pop("trainer").stop()
    check_finished_run(summary, config)
    return config, summary


async def _check_branches(stack: Stack, config: TrainingConfig, summary: TrainingSummary) -> None:
    """Every group branched; every branch reproduced its prefix without the policy generating
    it again and went live after it; the trainer masked exactly the prefixes: each branch's
    `prefix_calls` and its seed's k."""
    counters = summary.counters
    assert counters.groups_branched == counters.groups_trained, counters
    assert (counters.seeds_not_branched, counters.branches_broken) == (0, 0), counters
    store = stack.store()
    rollout_ids = sorted(
        folder.name for folder in stack.store_dir.iterdir() if folder.name.startswith(config.run_id)
    )
    results = {
        rollout_id: await stack.client.get_workflow_handle(
            rollout_workflow_id(rollout_id), result_type=RolloutResult
        ).result()
        for rollout_id in rollout_ids
    }
    served = {line["call_id"] for line in stack.policy_responses()}
    # In sync mode the run starts exactly the groups it trains.
    masked = {seed: 0 for seed in results if seed.endswith(".0")}
    assert len(masked) == counters.groups_trained
    for rollout_id, result in results.items():
        if rollout_id in masked:
            continue
        seed_id = rollout_id.rsplit(".", 1)[0] + ".0"
        seed = results[seed_id]
        calls = store.read_sync(rollout_id, call_ids=result.call_ids)
        k = result.prefix_calls
        assert 1 <= k < seed.calls and result.prefix_diverged_at is None, result
        assert [r.replayed_from for r in calls[:k]] == seed.call_ids[:k]
        assert not served & {r.call_id for r in calls[:k]}
        assert calls[k:] and {r.call_id for r in calls[k:]} <= served
        masked[rollout_id] = masked[seed_id] = k
    trained = [r["trainer"] for r in read_metrics(Path(config.run_dir or ""))]
    assert sum(t["aggregation/prefix_masked_calls"] for t in trained) == sum(masked.values())


async def test_a_branching_training_run_trains_the_continuations(stack: Stack) -> None:
    """A 5-call agent in branching groups, each branched at its seed's most surprising call
    (the trainer read the seed's logprobs from the store)."""
    markers = stack.root / "replay-markers"
    markers.mkdir(exist_ok=True)
    agent = LocalAgentSpec(
        command=["{python}", REPLAY_AGENT],
        env={
            "AGENT_LOG": str(stack.root / "replay-agent.log"),
            "MARKER_DIR": str(markers),
            "PROTOCOL": "tokens",
            "TURNS": "5",
            "MAX_TOKENS": "3",
        },
    )
    config, summary = await _branching_run(stack, agent, "surprisal")
    await _check_branches(stack, config, summary)


async def test_the_calculator_example_trains_in_branching_groups(stack: Stack) -> None:
    """The multi-turn arithmetic example (examples/arithmetic/calculator_agent.py: an
    expression, the calculator tool, an answer), unchanged: each branch replays its seed's
    expression call and samples the answer again; the reward is the example's."""
    agent = LocalAgentSpec(command=["{python}", "-m", "darl.examples.arithmetic.calculator_agent"])
    config, summary = await _branching_run(
        stack,
        agent,
        "uniform",
        RewardSpec(function="numeric_match", answer_key="answer"),
        dataset={"path": str(ARITHMETIC_TASKS)},
    )
    await _check_branches(stack, config, summary)
