"""The chaos tier in `make test`: one training run in which each component is SIGKILLed and
restarted once (rollout worker, trainer worker inside train_step and inside sync_weights,
gateway rolling out and paused for a sync, policy server, agent service, Temporal dev
server), one whose local-process agents lose their worker, and one of branching groups whose
multi-turn agents are killed at random calls. Each run must pass every
check of tests/chaos/checks.py. `make chaos` runs the full matrix (a run per kill) and
prints it against an undisturbed run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.harness import ChaosRun
from tests.chaos.report import COLUMNS, rows, summary
from tests.chaos.scenarios import HTTP_KILLS, LOCAL_KILLS, in_sequence

pytestmark = pytest.mark.integration


def table(report) -> str:
    return "\n".join([COLUMNS, *rows(report), summary(report)])


@pytest.mark.timeout(900)
async def test_a_run_survives_a_kill_of_each_component(tmp_path: Path) -> None:
    kills, steps = in_sequence(HTTP_KILLS)
    report = await ChaosRun(tmp_path, kills, steps).run()
    print(table(report))
    assert report.clean, table(report)
    assert len(report.kills) == len(HTTP_KILLS)


@pytest.mark.timeout(600)
async def test_local_agents_survive_their_workers_kill(tmp_path: Path) -> None:
    kills, steps = in_sequence(LOCAL_KILLS)
    report = await ChaosRun(tmp_path, kills, steps, agent="local").run()
    print(table(report))
    assert report.clean, table(report)


@pytest.mark.timeout(600)
async def test_multi_turn_agents_killed_at_random_calls_resume_by_replay(tmp_path: Path) -> None:
    """Rule 10 under chaos, in branching groups (docs/branching.md): a third of the
    multi-turn agents' first attempts (and of their second) are SIGKILLed at a random call,
    seeds and branches alike (a branch inside its prefix or after it); each resumes by replay.
    The run completes, no call is generated twice, every trained trajectory is one episode."""
    report = await ChaosRun(tmp_path, [], steps=2, agent="replay", groups="branch").run()
    print(table(report))
    assert report.clean, table(report)
    # 24 branches or more: none killed would be a chance of 0.7^24, 2e-4.
    assert report.branches_killed >= 1 and report.replayed_calls >= report.agents_killed
