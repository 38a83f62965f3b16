"""The chaos harness: a real training run of the digits model with every component its own
process (a Temporal dev server on its database, the policy server, the gateway, a rollout
worker, the agent service or local-process agents, the trainer worker), SIGKILLed and
restarted one at a time at chosen moments, then checked from outside DARL's own accounting:

- the run completed, its checkpoints are contiguous, AdamW's update counts exact;
- each RolloutWorkflow ran once (one execution per workflow id, from Temporal's visibility);
- no rollout failed (the digits agent never fails on its own: any failure is a kill's);
- every stored call's version is the one the policy server that answered had loaded (its own
  log of every answer, by call id), and its tokens are that answer's;
- no trained call came from weights more than `max_staleness` versions before its step
  (the steps' inputs, read from the TrainingWorkflow's history);
- each attempt was one agent run, and every answer an agent received (its own log) is in the
  store, and, for a trained rollout, is its trajectory.

`stall` is the longest stretch in the minute after a kill with no rollout ending, by the
`status` query (a query that fails while the trainer or Temporal is down counts as none).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError

from darl.deploy.devstack import connect_when_ready, register_search_attributes
from darl.deploy.temporal_connection import DATA_CONVERTER
from darl.gateway.store.directory import DirectoryTrajectoryStore
from darl.gateway.store.record import CallRecord
from darl.workflows import search_attributes as sa
from darl.workflows.contracts import LocalAgentSpec, RolloutResult
from darl.workflows.names import ROLLOUT_WORKFLOW, TRAIN_STEP
from darl.workflows.training_config import TrainingConfig
from darl.workflows.training_messages import (
    TrainingPhase,
    TrainingProgress,
    TrainingSummary,
    TrainStepRequest,
)
from tests.chaos import CALLS_ENV, RUNS_LOG
from tests.chaos.checks import (
    ChaosReport,
    Kill,
    KillOutcome,
    check_agents,
    check_replays,
    check_staleness,
    check_trajectories,
    check_versions,
    name_trained_calls,
)
from tests.chaos.sync_delay import SyncDelay
from tests.integration.dev_server import DevServer
from tests.integration.replicas_stack import ReplicatedStack
from tests.integration.stack import Stack
from tests.integration.training_stack import (
    check_finished_run,
    start_training,
    training_config,
)
from tests.serving import served

log = logging.getLogger(__name__)

LOCAL_AGENT = str(Path(__file__).resolve().parent / "local_agent.py")
# The multi-turn agent of the replay runs (rule 10): a token-in, token-out harness killed at
# random calls (tests/agents/replay_agent.py).
REPLAY_AGENT = str(Path(__file__).resolve().parents[1] / "agents" / "replay_agent.py")
REPLAY_TURNS = 5
REPLAY_KILL_RATE = 0.3
AGENT_SERVICE = "tests.chaos.agents:app"
FAILED = ("failed_agent", "failed_infra", "timed_out")

# Components, as the table names them.
ROLLOUT_WORKER = "rollout worker"
TRAINER = "trainer worker"
GATEWAY = "gateway"
POLICY = "policy server"
# Killed, and its state file lost: it comes back on its initial weights (version 0).
POLICY_FORGETTING = "policy server, state lost"
AGENT_SERVICE_NAME = "agent service"
TEMPORAL = "Temporal dev server"

# Moments.
ROLLING_OUT = "while rolling out"
IN_TRAIN_STEP = "inside train_step"
IN_SYNC = "inside sync_weights"
PAUSED_FOR_SYNC = "paused for a sync"


class ChaosRun:
    """One training run under a list of kills. `agent`: "http" (the digits agent service),
    "local" (a process per attempt) or "replay" (a multi-turn process per attempt, which waits
    at a random call of 30% of its first two attempts for the run's agent killer to SIGKILL
    its process group: the next attempt resumes by replay). With `replicas` > 1 the gateway
    is that many replicas behind HAProxy, round-robin (its kill is the first replica's): an
    agent's call and its attempt's close reach different replicas."""

    def __init__(
        self,
        root: Path,
        kills: list[Kill],
        steps: int,
        agent: str = "http",
        replicas: int = 1,
        groups: str = "independent",
    ) -> None:
        self.root = root
        self.kills = kills
        self.steps = steps
        self.agent = agent
        self.replicas = replicas
        # More than one makes async runs drop groups stale (a sync between an agent's calls).
        self.calls_per_agent_run = 1
        self.run_id = f"chaos-{agent}-{uuid.uuid4().hex[:6]}"
        self.server = DevServer(root)
        self.samples: list[tuple[float, TrainingProgress]] = []
        self.client: Client | None = None
        self.stack: Stack | None = None
        self.sync_delay: SyncDelay | None = None
        self.markers = root / "replay-markers"
        self.agents_killed = 0
        # `groups.mode` of the run; in `branch` mode, the branches whose agent was killed.
        self.groups = groups
        self.branches_killed = 0

    # --- the run ----------------------------------------------------------------------------

    async def run(self, timeout: float = 900) -> ChaosReport:
        self.server.start()
        await register_search_attributes(self.server.settings)
        self.client = await connect_when_ready(self.server.settings)
        self.stack = stack = self._topology()
        stack.model = "digits"
        try:
            await asyncio.to_thread(self._start_stack)
            self.sync_delay = SyncDelay(stack.policy_url)
            async with served(self.sync_delay.app(), self.root, "sync-delay") as delay_url:
                config = self._config(delay_url)
                return await asyncio.wait_for(self._train(config), timeout)
        finally:
            await asyncio.to_thread(stack.stop)
            self.server.stop()

    def _topology(self) -> Stack:
        assert self.client is not None
        root = self.root / "stack"
        if self.replicas == 1:
            stack = Stack(root, self.client)
        else:
            stack = ReplicatedStack(root, self.client, self.replicas)
        stack.extra_env[CALLS_ENV] = str(self.calls_per_agent_run)
        return stack

    def _start_stack(self) -> None:
        stack = self.stack
        assert stack is not None
        stack.start()
        if self.agent == "http":
            stack.start_agent_service(AGENT_SERVICE)
        stack.start_trainer_worker("trainer")

    def _config(self, delay_url: str) -> TrainingConfig:
        stack = self.stack
        assert stack is not None
        config = training_config(
            stack,
            self.run_id,
            self.steps,
            mode="async",
            knobs={"max_inflight": 32, "max_staleness": 1},
            # All-equal groups train too: a model that learns fast must not starve the run.
            equal_reward_groups="train",
            # A worker killed under an agent is noticed in 3 s, a trainer in 6 s.
            train_heartbeat_seconds=6,
            # Steps long enough to aim a kill inside one (~1-2 s), learning slowly.
            backend_settings={"ppo_epochs": 60, "lr": 1e-4},
            continue_as_new_after_events=100_000,
            groups={"mode": self.groups},
        )
        data = config.model_dump(mode="json")
        data["rollout"]["timeouts"] |= {"heartbeat_seconds": 3, "retry_backoff_seconds": 1}
        if self.agent == "local":
            log = str(self.root / RUNS_LOG)
            data["rollout"]["agent"] = LocalAgentSpec(
                command=["{python}", LOCAL_AGENT], env={"CHAOS_AGENT_LOG": log}
            ).model_dump(mode="json")
        if self.agent == "replay":
            self.markers.mkdir(exist_ok=True)
            data["rollout"]["agent"] = LocalAgentSpec(
                command=["{python}", REPLAY_AGENT],
                env={
                    "CHAOS_AGENT_LOG": str(self.root / RUNS_LOG),
                    "AGENT_LOG": str(self.root / "replay-agent.log"),
                    "MARKER_DIR": str(self.markers),
                    "PROTOCOL": "tokens",
                    "TURNS": str(REPLAY_TURNS),
                    "MAX_TOKENS": "3",
                    "KILL_RATE": str(REPLAY_KILL_RATE),
                },
            ).model_dump(mode="json")
            # A multi-turn episode straddles weight syncs in async mode; on-policy steps
            # keep every group (replayed calls keep the version that generated them).
            data["mode"] = "sync"
        # The trainer loads weights through the fault injector; the gateway reaches the
        # policy server directly (its --upstream).
        data["weight_sync"] |= {
            "policy_servers": [delay_url],
            "register_upstreams": False,
            # A server back on other weights is found (and given the run's) this soon.
            "check_every_seconds": 3,
        }
        return TrainingConfig.model_validate(data)

    async def _train(self, config: TrainingConfig) -> ChaosReport:
        assert self.client is not None and self.stack is not None
        started = time.monotonic()
        handle = await start_training(self.client, config, self.stack.trainer_queue)
        watching = asyncio.create_task(self._watch(handle))
        killing = asyncio.create_task(self._kill_waiting_agents())
        outcomes = []
        try:
            for kill in self.kills:
                outcomes.append(await self._strike(handle, kill))
            summary = await self._result(handle)
        finally:
            for task in (watching, killing):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        wall = time.monotonic() - started
        for outcome in outcomes:
            outcome.stall = self._stall(outcome)
        report = ChaosReport(self.run_id, self.agent, wall, outcomes)
        report.agents_killed = self.agents_killed
        report.branches_killed = self.branches_killed
        await self._check(report, config, summary)
        return report

    async def _kill_waiting_agents(self) -> None:
        """SIGKILL the process group of every replay agent that waits at its kill point, as
        a lost machine ends it (nothing to do for the other agents)."""
        assert self.stack is not None
        killed: set[str] = set()
        while True:
            for marker in self.markers.glob("*") if self.markers.exists() else ():
                if marker.name in killed:
                    continue
                rollout, attempt = marker.name.rsplit(".", 1)
                handle = self.stack.agents_dir / rollout / f"attempt-{attempt}" / "handle.json"
                if not handle.exists():
                    continue
                pid = int(json.loads(handle.read_text())["data"]["pid"])
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                killed.add(marker.name)
                self.agents_killed += 1
                # A group's seed is its member 0; the others are branches in `branch` mode.
                self.branches_killed += self.groups == "branch" and not rollout.endswith(".0")
            await asyncio.sleep(0.05)

    async def _result(self, handle: WorkflowHandle) -> TrainingSummary:
        """The run's summary, asking again across a Temporal restart."""
        while True:
            try:
                return await self._current(handle).result()
            except RPCError:
                await asyncio.sleep(0.5)

    def _current(self, handle: WorkflowHandle) -> WorkflowHandle:
        assert self.client is not None
        return self.client.get_workflow_handle(handle.id, result_type=TrainingSummary)

    async def _watch(self, handle: WorkflowHandle) -> None:
        """Sample the run's progress (a query fails while the trainer or Temporal is down)."""
        while True:
            with contextlib.suppress(RPCError):
                progress = await self._current(handle).query(
                    "status", result_type=TrainingProgress, rpc_timeout=timedelta(seconds=2)
                )
                self.samples.append((time.monotonic(), progress))
            await asyncio.sleep(0.1)

    def _latest(self) -> TrainingProgress | None:
        return self.samples[-1][1] if self.samples else None

    async def _until(self, condition: Callable[[TrainingProgress], bool], what: str) -> None:
        try:
            async with asyncio.timeout(300):
                while True:
                    latest = self._latest()
                    if latest is not None and condition(latest):
                        return
                    await asyncio.sleep(0.05)
        except TimeoutError:
            seen = self.samples[-1] if self.samples else None
            age = f"{time.monotonic() - seen[0]:.0f}s ago" if seen else "never"
            raise AssertionError(
                f"{self.run_id}: waited 300 s for {what}; last progress ({age}): "
                f"{seen[1] if seen else None}"
            ) from None

    # --- kills ------------------------------------------------------------------------------

    async def _strike(self, handle: WorkflowHandle, kill: Kill) -> KillOutcome:
        def from_step(p: TrainingProgress) -> bool:
            return p.step >= kill.from_step

        if kill.when == ROLLING_OUT:
            # Agents at work and the gateway serving them: in async mode that is while the run
            # rolls out and while it trains. Not the rolling-out phase alone: when a step's
            # batch is complete by the time the step before has synced, the run goes from
            # rolling out to training in one workflow task, and no query ever sees the phase.
            await self._until(
                lambda p: (
                    from_step(p)
                    and p.phase in (TrainingPhase.ROLLING_OUT, TrainingPhase.TRAINING)
                    and p.inflight_rollouts >= 8
                ),
                "rollouts in flight",
            )
            await self._work_in_flight(kill.component)
        elif kill.when == IN_TRAIN_STEP:
            await self._until(
                lambda p: p.step >= kill.from_step - 1 and p.phase == TrainingPhase.TRAINING,
                "a step training",
            )
        else:  # a sync, held by the fault injector
            assert self.sync_delay is not None
            await self._until(lambda p: p.step >= kill.from_step - 1, "the step before")
            self.sync_delay.arm()
            async with asyncio.timeout(300):
                await self.sync_delay.holding.wait()
        latest = self._latest()
        at_step = latest.step if latest else 0
        log.info(
            "%s: killing the %s %s at step %d", self.run_id, kill.component, kill.when, at_step
        )
        killed = time.monotonic()
        await self._kill_and_restart(kill.component)
        return KillOutcome(kill, at_step, killed, back_after=time.monotonic() - killed)

    async def _work_in_flight(self, component: str) -> None:
        """Strike when the component has work of its own in flight: an agent running (for
        the agent service and the rollout worker), a call at the gateway (for the gateway and
        the policy server). An agent call takes ~30 ms: at a random moment there may be none."""
        async with asyncio.timeout(60):
            while True:
                if component in (AGENT_SERVICE_NAME, ROLLOUT_WORKER) and self._agent_running():
                    return
                if component in (GATEWAY, POLICY, POLICY_FORGETTING) and await self._calls():
                    return
                if component == TEMPORAL:
                    return
                await asyncio.sleep(0.005)

    def _agent_running(self) -> bool:
        started, ended_runs = set(), set()
        for line in self._agent_log():
            (started if "rollout_id" in line else ended_runs).add(line["run"])
        return bool(started - ended_runs)

    async def _calls(self) -> int:
        """Calls in flight at the gateway (0 while it does not answer)."""
        stack = self.stack
        assert stack is not None

        def ask() -> int:
            with stack.admin() as admin:
                return sum(admin.get("/admin/state").json()["inflight"].values())

        try:
            return await asyncio.to_thread(ask)
        except (httpx.HTTPError, ValueError):
            return 0

    async def _kill_and_restart(self, component: str) -> None:
        stack = self.stack
        assert stack is not None
        restarts: dict[str, Callable[[], Awaitable[None]]] = {
            ROLLOUT_WORKER: lambda: self._restart_process("worker", stack.start_worker),
            TRAINER: lambda: self._restart_process(
                "trainer", lambda: stack.start_trainer_worker("trainer")
            ),
            GATEWAY: lambda: asyncio.to_thread(stack.restart_gateway, 1.0, True),
            POLICY: lambda: asyncio.to_thread(stack.restart_policy_server, True),
            POLICY_FORGETTING: lambda: asyncio.to_thread(stack.restart_policy_server, True, True),
            AGENT_SERVICE_NAME: lambda: asyncio.to_thread(stack.restart_agent_service),
            TEMPORAL: self._restart_temporal,
        }
        await restarts[component]()

    async def _restart_process(self, name: str, start: Callable[[], None]) -> None:
        stack = self.stack
        assert stack is not None
        stack.processes.pop(name).kill()
        await asyncio.sleep(1.0)
        await asyncio.to_thread(start)

    async def _restart_temporal(self) -> None:
        self.server.kill()
        await asyncio.sleep(2.0)
        self.server.start()
        self.client = await connect_when_ready(self.server.settings)

    def _stall(self, outcome: KillOutcome) -> float | None:
        """The longest stretch in the minute after the kill with no rollout ending (a query
        that fails, the trainer or Temporal being down, counts as no progress)."""
        killed = outcome.killed_at
        window = [
            (t, p.counters.ended()) for t, p in self.samples if killed - 5 <= t <= killed + 60
        ]
        before = [(t, n) for t, n in window if t <= killed]
        if not before:
            return None
        longest, since, count = 0.0, killed, before[-1][1]
        for t, n in window:
            if t > killed and n > count:
                longest = max(longest, t - since)
                since, count = t, n
        return longest

    # --- checks, from outside DARL's accounting ---------------------------------------------

    async def _check(
        self, report: ChaosReport, config: TrainingConfig, summary: TrainingSummary
    ) -> None:
        assert self.client is not None and self.stack is not None
        try:
            check_finished_run(summary, config)
        except AssertionError as err:
            report.problems.append(f"the run did not finish whole: {err}")
        if summary.counters.rollouts_failed:
            report.problems.append(f"the run counted {summary.counters.rollouts_failed} failed")
        await self._check_executions(report)
        stored = self._stored()
        records = {record.call_id: record for record in stored}
        check_versions(report, records, self.stack.policy_responses())
        steps = name_trained_calls(await self._train_steps(), stored)
        check_staleness(report, records, steps, config.knobs.max_staleness)
        check_agents(report, self.run_id, records, steps, self._agent_log())
        check_trajectories(report, stored, steps)
        check_replays(report, records, steps, self.stack.policy_responses())

    async def _check_executions(self, report: ChaosReport) -> None:
        assert self.client is not None
        query = f'DarlRun = "{self.run_id}" AND WorkflowType = "{ROLLOUT_WORKFLOW}"'
        # The rollouts the run cancelled at its end report before they close: let them close.
        deadline = time.monotonic() + 60
        while True:
            executions = [e async for e in self.client.list_workflows(query)]
            if time.monotonic() > deadline or all(
                e.status and e.status.name != "RUNNING" for e in executions
            ):
                break
            await asyncio.sleep(0.5)
        per_id = collections.Counter(e.id for e in executions)
        report.rollouts = len(per_id)
        report.twin_executions = sum(n - 1 for n in per_id.values())
        statuses = collections.Counter(e.typed_search_attributes.get(sa.STATUS) for e in executions)
        report.rollouts_failed = sum(statuses[s] for s in FAILED)
        for execution in executions:
            if execution.typed_search_attributes.get(sa.STATUS) in FAILED:
                handle = self.client.get_workflow_handle(execution.id, result_type=RolloutResult)
                result = await handle.result()
                report.problems.append(
                    f"{execution.id} {result.status} after {result.attempts} attempt(s): "
                    f"{result.error}"
                )
        running = [e.id for e in executions if e.status and e.status.name == "RUNNING"]
        if running:
            report.problems.append(f"{len(running)} rollouts still running after the run")

    def _stored(self) -> list[CallRecord]:
        """Every record of the run's rollouts, every attempt, as the store holds them."""
        assert self.stack is not None
        store = DirectoryTrajectoryStore(self.stack.store_dir)
        return [
            record
            for folder in self.stack.store_dir.iterdir()
            if folder.name.startswith(self.run_id)
            for record in store.read_sync(folder.name)
        ]

    async def _train_steps(self) -> dict[int, TrainStepRequest]:
        """Each step's trained rollouts, as the TrainingWorkflow asked train_step for them."""
        assert self.client is not None
        handle = self.client.get_workflow_handle(f"train/{self.run_id}")
        steps: dict[int, TrainStepRequest] = {}
        converter = DATA_CONVERTER.payload_converter
        async for event in handle.fetch_history_events():
            if not event.HasField("activity_task_scheduled_event_attributes"):
                continue
            attributes = event.activity_task_scheduled_event_attributes
            if attributes.activity_type.name == TRAIN_STEP:
                [request] = converter.from_payloads(attributes.input.payloads, [TrainStepRequest])
                steps[request.step] = request
        return steps

    def _agent_log(self) -> list[dict[str, Any]]:
        assert self.stack is not None
        path = (
            self.root / RUNS_LOG
            if self.agent in ("local", "replay")
            else self.stack.root / "agent-service" / RUNS_LOG
        )
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
