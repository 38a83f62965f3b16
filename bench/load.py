"""The benchmarks' load generator and meters: paced or back-to-back clients (aiohttp), the
gateway's Prometheus figures, CPU seconds by process, idle rollouts to send calls for."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import psutil
from temporalio.testing import WorkflowEnvironment

from darl.deploy.processes import ManagedProcess
from darl.deploy.temporal_connection import DATA_CONVERTER
from darl.workflows import search_attributes as sa
from darl.workflows.contracts import (
    LocalAgentSpec,
    RewardSpec,
    RolloutSpec,
    RolloutTimeouts,
    rollout_workflow_id,
)
from darl.workflows.rollout_status import RolloutStatus
from darl.workflows.rollout_token import TokenClaims, mint_token
from darl.workflows.rollout_workflow import RolloutWorkflow

SECRET = "bench-secret"
ADMIN = "bench-admin"
BODY = {"model": "m", "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 16}


@dataclass
class Phase:
    name: str
    latencies: list[float]
    seconds: float

    def pct(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.seconds


async def drive(
    name: str,
    targets: list[tuple[str, dict[str, str]]],
    calls: int,
    rate: float | None = None,
    body: dict[str, object] = BODY,
) -> Phase:
    """len(targets) clients, each sending calls/len(targets) requests back to back, or, with
    `rate`, each paced to rate/len(targets) calls per second (starts spread evenly). The load
    generator is aiohttp: httpx cost ~2.5 ms of CPU per call here, more than the gateway."""
    per_client = calls // len(targets)
    latencies: list[float] = []
    payload = json.dumps(body).encode()
    connector = aiohttp.TCPConnector(limit=len(targets))
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one_client(index: int, url: str, headers: dict[str, str]) -> None:
            headers = {**headers, "Content-Type": "application/json"}
            period = len(targets) / rate if rate else 0.0
            start = time.perf_counter() + period * index / len(targets)
            for n in range(per_client):
                if period:
                    await asyncio.sleep(max(0.0, start + n * period - time.perf_counter()))
                t0 = time.perf_counter()
                async with session.post(url, data=payload, headers=headers) as response:
                    body = await response.read()
                latencies.append(time.perf_counter() - t0)
                if response.status != 200:
                    raise RuntimeError(f"{name}: {response.status} {body[:300]!r}")

        started = time.perf_counter()
        await asyncio.gather(*(one_client(i, *target) for i, target in enumerate(targets)))
        return Phase(name, latencies, time.perf_counter() - started)


def scrape(metrics: str) -> dict[str, float]:
    """Prometheus text format: {"name{labels}": value}."""
    values = {}
    for line in metrics.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def temporal_server_pid() -> int:
    """The dev server the SDK started (a child of this process)."""
    for child in psutil.Process().children(recursive=True):
        if child.name() == "temporal":
            return child.pid
    raise RuntimeError("no temporal dev server among this process's children")


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU time of each process so far, to the nanosecond where the OS says it (Linux: the
    process's CPU clock, all its threads, ended ones too). /proc's user and system times move
    in 10 ms ticks, which made a window of a few calls read as 0 or 10 ms and a phase's
    figure swing by a fifth."""
    return {name: _process_cpu_seconds(pid) for name, pid in pids.items()}


def _process_cpu_seconds(pid: int) -> float:
    if sys.platform == "linux":
        # clock_getcpuclockid(pid): the process-wide scheduler clock (CPUCLOCK_SCHED).
        return time.clock_gettime_ns(((~pid) << 3) | 2) / 1e9
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


async def idle_rollouts(env: WorkflowEnvironment, queue: str, n: int) -> list[str]:
    ids = []
    for i in range(n):
        spec = RolloutSpec(
            run_id="bench",
            rollout_id=f"bench-{uuid.uuid4().hex[:6]}-{i}",
            task={},
            agent=LocalAgentSpec(command=["sleep", "900"]),
            reward=RewardSpec(missing_reward=0.0),
            timeouts=RolloutTimeouts(agent_seconds=1200),
        )
        await env.client.start_workflow(
            RolloutWorkflow.run, spec, id=rollout_workflow_id(spec.rollout_id), task_queue=queue
        )
        ids.append(spec.rollout_id)
    for rollout_id in ids:
        handle = env.client.get_workflow_handle(rollout_workflow_id(rollout_id))
        while (await handle.query(RolloutWorkflow.status)).status != RolloutStatus.RUNNING:
            await asyncio.sleep(0.05)
    return ids


def gateway_targets(gateway_url: str, rollouts: list[str]) -> list[tuple[str, dict[str, str]]]:
    """One chat-completions target per rollout, with its rollout token."""
    expires = int(time.time() + 3600)
    return [
        (
            f"{gateway_url}/rollouts/{r}/v1/chat/completions",
            {
                "Authorization": "Bearer "
                + mint_token(SECRET.encode(), TokenClaims(r, 1, "train", expires))
            },
        )
        for r in rollouts
    ]


REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


async def start_dev_server() -> WorkflowEnvironment:
    """The Temporal dev server every gateway benchmark signals into (DARL's search
    attributes registered, DARL's data converter on the client)."""
    return await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(BIN / "temporal"),
        data_converter=DATA_CONVERTER,
        search_attributes=sa.ALL,
    )


def process_env(env: WorkflowEnvironment, path: str = "/usr/bin:/bin") -> dict[str, str]:
    """The environment of the processes a benchmark starts: the dev server, the bench's
    secrets, and a PYTHONPATH that puts another checkout's DARL in front of this one's (a
    "before" column: see docs/benchmarks.md)."""
    return {
        "TEMPORAL_ADDRESS": env.client.service_client.config.target_host,
        "DARL_TOKEN_SECRET": SECRET,
        "DARL_ADMIN_KEY": ADMIN,
        "PATH": f"{BIN}:{path}",
        **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}),
    }


def start_fake_upstream(root: Path, env: dict[str, str]) -> ManagedProcess:
    """The fast fake policy server every gateway benchmark forwards to (bench/fake_upstream)."""
    ready = root / "up.json"
    return ManagedProcess(
        "fake-upstream",
        [sys.executable, "-m", "bench.fake_upstream", "--ready-file", str(ready)],
        root / "fake-upstream.log",
        env=env,
        ready_file=ready,
        cwd=REPO,
    ).start()


def start_gateway(
    root: Path, env: dict[str, str], name: str, upstream_url: str, *flags: str
) -> ManagedProcess:
    """A `darl gateway` on a free port in front of the fake upstream; `flags` pick its store
    and the rest."""
    return ManagedProcess.darl(
        name,
        ["gateway", "--port", "0", "--upstream", upstream_url, "--model", "fake", *flags],
        root,
        env=env,
    ).start()


def start_worker(root: Path, env: dict[str, str], gateway_url: str, queue: str) -> ManagedProcess:
    """A rollout worker closing attempts at `gateway_url` (the idle rollouts need one)."""
    return ManagedProcess.darl(
        "worker",
        [
            "worker",
            "--gateway-url",
            gateway_url,
            "--agents-dir",
            str(root / "agents"),
            "--task-queue",
            queue,
        ],
        root,
        env=env,
    ).start()
