"""A DARL stack for integration tests: the real policy server, gateway and rollout workers as
child processes of the test, against the session's Temporal dev server, on a task queue of its
own. Everything binds 127.0.0.1 with ports from the kernel (port 0)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
from temporalio.client import Client, WorkflowHandle

from darl.activities.runners.local import stop_leftover_agents
from darl.deploy.processes import ManagedProcess
from darl.gateway.store.base import TrajectoryStore
from darl.gateway.store.url import open_store
from darl.workflows.contracts import (
    LocalAgentSpec,
    RewardSpec,
    RolloutResult,
    RolloutSpec,
    RolloutTimeouts,
    rollout_workflow_id,
)
from darl.workflows.rollout_status import RolloutStatus
from darl.workflows.rollout_token import TokenClaims, mint_token
from darl.workflows.rollout_workflow import RolloutWorkflow

TOKEN_SECRET = "integration-secret"
ADMIN_KEY = "integration-admin-key"


class Stack:
    def __init__(self, root: Path, client: Client, store_url: str | None = None) -> None:
        self.root = root
        # The `--store-url` (an s3:// URL, say) of the gateway and trainer in place of
        # `store_dir`; S3 settings reach them in the AWS_* variables of the environment.
        self.store_url = store_url
        self.client = client
        self.task_queue = f"darl-rollouts-{uuid.uuid4().hex[:8]}"
        self.processes: dict[str, ManagedProcess] = {}
        self.policy_url = ""
        self.gateway_url = ""
        self.response_log = root / "policy-responses.jsonl"
        self.store_dir = root / "trajectories"
        self.agents_dir = root / "agents"
        self.runs_dir = root / "runs"
        self.trainer_queue = f"darl-trainer-{uuid.uuid4().hex[:8]}"
        self.model = "tiny"
        self.agent_service_url = ""
        self.agent_service_target = ""
        self.policy_state_file = root / "policy-server-state.json"
        # More environment for every component (a test agent's settings, say).
        self.extra_env: dict[str, str] = {}

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "TEMPORAL_ADDRESS": self.client.service_client.config.target_host,
            "DARL_TOKEN_SECRET": TOKEN_SECRET,
            "DARL_ADMIN_KEY": ADMIN_KEY,
            "DARL_HOME": str(self.root),
            **self.extra_env,
        }

    def admin_urls(self) -> list[str]:
        """The gateway's admin API as the trainer is given it (every replica's)."""
        return [self.gateway_url]

    def _start(self, name: str, args: list[str]) -> dict[str, Any]:
        process = ManagedProcess.darl(name, args, self.root / "logs", env=self.env())
        self.processes[name] = process.start()
        return process.wait_ready(timeout=120)

    def start_policy_server(self, port: int = 0) -> None:
        info = self._start(
            "policy-server",
            [
                "policy-server",
                "--port",
                str(port),
                "--model-dir",
                str(self.model_dir),
                "--model",
                self.model,
                "--response-log",
                str(self.response_log),
                "--state-file",
                str(self.policy_state_file),
            ],
        )
        self.policy_url = info["url"]

    def gateway_flags(self) -> list[str]:
        """More `darl gateway` flags, for stacks that need them."""
        return []

    def start_gateway(self, port: int = 0, signal_interval: float = 1.0) -> None:
        info = self._start(
            "gateway",
            [
                "gateway",
                "--port",
                str(port),
                "--upstream",
                self.policy_url,
                *self.store_flags(),
                "--signal-interval",
                str(signal_interval),
                *self.gateway_flags(),
            ],
        )
        self.gateway_url = info["url"]

    def store_flags(self) -> list[str]:
        if self.store_url is not None:
            return ["--store-url", self.store_url]
        return ["--store-dir", str(self.store_dir)]

    def start_worker(self, name: str = "worker", *extra: str) -> None:
        self._start(
            name,
            [
                "worker",
                "--gateway-url",
                self.gateway_url,
                "--agents-dir",
                str(self.agents_dir),
                "--task-queue",
                self.task_queue,
                *extra,
            ],
        )

    @property
    def model_dir(self) -> Path:
        return self.root / f"model-{self.model}"

    def start_trainer_worker(self, name: str = "trainer") -> None:
        self._start(
            name,
            [
                "trainer-worker",
                *self.store_flags(),
                "--runs-dir",
                str(self.runs_dir),
                "--task-queue",
                self.trainer_queue,
            ],
        )

    def start_agent_service(self, target: str, port: int = 0) -> None:
        self.agent_service_target = target
        info = self._start("agent-service", ["agent-service", target, "--port", str(port)])
        self.agent_service_url = info["url"]

    def restart_agent_service(self) -> None:
        """SIGKILL the agent service and start it again on the same port (its journal in
        `<root>/agent-service` stays)."""
        self.processes.pop("agent-service").kill()
        self.start_agent_service(self.agent_service_target, urlparse(self.agent_service_url).port)

    def start(self) -> Stack:
        self.start_policy_server()
        self.start_gateway()
        self.start_worker()
        return self

    def restart_policy_server(self, kill: bool = True, forget_weights: bool = False) -> None:
        """SIGKILL (or stop) the policy server and start it again on the same port; with
        `forget_weights` its state file goes first, so it comes back on its initial weights."""
        server = self.processes.pop("policy-server")
        if kill:
            server.kill()
        else:
            server.stop()
        if forget_weights:
            self.policy_state_file.unlink(missing_ok=True)
        self.start_policy_server(urlparse(self.policy_url).port or 0)

    def restart_gateway(self, signal_interval: float = 1.0, kill: bool = False) -> None:
        """Stop (or SIGKILL) the gateway and start it again on the same port."""
        gateway = self.processes.pop("gateway")
        if kill:
            gateway.kill()
        else:
            gateway.stop()
        self.start_gateway(urlparse(self.gateway_url).port or 0, signal_interval)

    def stop(self) -> None:
        for process in reversed(list(self.processes.values())):
            process.stop()
        self.processes.clear()
        stop_leftover_agents(self.agents_dir)

    # --- driving rollouts ----------------------------------------------------------------

    async def start_rollout(self, spec: RolloutSpec) -> WorkflowHandle[Any, RolloutResult]:
        return await self.client.start_workflow(
            RolloutWorkflow.run,
            spec,
            id=rollout_workflow_id(spec.rollout_id),
            task_queue=self.task_queue,
        )

    async def start_idle_rollout(self, run_id: str) -> str:
        """A running rollout whose agent waits quietly (its token stays valid for calls the
        test makes itself). Returns its rollout id once the agent runs."""
        spec = RolloutSpec(
            run_id=run_id,
            rollout_id=f"{run_id}-{uuid.uuid4().hex[:8]}",
            task={},
            agent=LocalAgentSpec(command=["sleep", "300"]),
            reward=RewardSpec(missing_reward=0.0),
            timeouts=RolloutTimeouts(agent_seconds=600),
        )
        handle = await self.start_rollout(spec)
        async with asyncio.timeout(60):
            while (await handle.query(RolloutWorkflow.status)).status != RolloutStatus.RUNNING:
                await asyncio.sleep(0.1)
        return spec.rollout_id

    async def wait_for_calls(self, handle: WorkflowHandle, at_least: int) -> int:
        """Calls reach the workflow in batches (the gateway's signal interval): wait for them.
        Returns the number of calls the workflow then knows."""
        async with asyncio.timeout(60):
            while (calls := (await handle.query(RolloutWorkflow.status)).calls) < at_least:
                await asyncio.sleep(0.1)
        return calls

    def token(
        self,
        rollout_id: str,
        attempt: int = 1,
        ttl: float = 600,
        mode: str = "train",
        secret: str = TOKEN_SECRET,
    ) -> str:
        claims = TokenClaims(rollout_id, attempt, mode, int(time.time() + ttl))
        return mint_token(secret.encode(), claims)

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.gateway_url,
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=30,
        )

    def darl(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run `darl ARGS` as a user would, against this stack's Temporal and keys."""
        return subprocess.run(
            [sys.executable, "-m", "darl.deploy.cli", *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def load_policy_version(self, version: int) -> None:
        """Label the policy server's weights `version` (reloading its model dir), as a weight
        sync would: the gateway records the version the policy server proves."""
        response = httpx.post(
            f"{self.policy_url}/reload_weights",
            json={"path": str(self.model_dir), "version": version},
            timeout=60,
        )
        response.raise_for_status()

    def policy_responses(self) -> list[dict[str, Any]]:
        if not self.response_log.exists():
            return []
        return [json.loads(line) for line in self.response_log.read_text().splitlines()]

    def store(self) -> TrajectoryStore:
        return open_store(self.store_url or self.store_dir)
