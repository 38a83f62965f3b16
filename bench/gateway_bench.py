"""Gateway benchmark: what capture costs. Prints figures; asserts nothing.

In one run, 32 concurrent clients send chat completions (1) straight to a fast fake upstream
and (2) through the real gateway with capture on (store write + Temporal signal into a running
RolloutWorkflow on the real dev server, served by a real rollout worker). It reports latency
p50/p99 and calls/s for both, the added latency, and where the gateway's time goes (from its
own Prometheus histograms).

    make bench            # or: .venv/bin/python -m bench.gateway_bench [--calls 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from temporalio.testing import WorkflowEnvironment

from activities.runners.local import stop_leftover_agents
from deploy.processes import ManagedProcess
from workflows import search_attributes as sa
from workflows.contracts import (
    LocalAgentSpec,
    RewardSpec,
    RolloutSpec,
    RolloutTimeouts,
    rollout_workflow_id,
)
from workflows.rollout_status import RolloutStatus
from workflows.rollout_token import TokenClaims, mint_token
from workflows.rollout_workflow import RolloutWorkflow
from workflows.temporal_connection import DATA_CONVERTER

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


async def drive(name: str, targets: list[tuple[str, dict[str, str]]], calls: int) -> Phase:
    """len(targets) clients, each sending calls/len(targets) requests back to back."""
    per_client = calls // len(targets)
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=len(targets), max_keepalive_connections=len(targets))
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:

        async def one_client(url: str, headers: dict[str, str]) -> None:
            for _ in range(per_client):
                t0 = time.perf_counter()
                response = await client.post(url, json=BODY, headers=headers)
                latencies.append(time.perf_counter() - t0)
                if response.status_code != 200:
                    raise RuntimeError(f"{name}: {response.status_code} {response.text[:300]}")

        started = time.perf_counter()
        await asyncio.gather(*(one_client(url, headers) for url, headers in targets))
        return Phase(name, latencies, time.perf_counter() - started)


def histogram_means(metrics: str) -> dict[str, tuple[float, float]]:
    """{series: (sum, count)} for the gateway's histograms."""
    sums: dict[str, tuple[float, float]] = {}
    for line in metrics.splitlines():
        match = re.match(r"(darl_gateway_\w+)_(sum|count)(\{[^}]*\})? ([0-9.e+-]+)", line)
        if match:
            key = match.group(1) + (match.group(3) or "")
            total, count = sums.get(key, (0.0, 0.0))
            if match.group(2) == "sum":
                total = float(match.group(4))
            else:
                count = float(match.group(4))
            sums[key] = (total, count)
    return sums


def temporal_server_pid() -> int:
    """The dev server the SDK started (a child of this process)."""
    for child in psutil.Process().children(recursive=True):
        if child.name() == "temporal":
            return child.pid
    raise RuntimeError("no temporal dev server among this process's children")


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    seconds = {}
    for name, pid in pids.items():
        times = psutil.Process(pid).cpu_times()
        seconds[name] = times.user + times.system
    return seconds


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


async def main(calls: int, clients: int, fsync: bool) -> None:
    root = Path(tempfile.mkdtemp(prefix="darl-bench-"))
    bin_dir = Path(sys.executable).parent
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(bin_dir / "temporal"),
        data_converter=DATA_CONVERTER,
        search_attributes=sa.ALL,
    )
    address = env.client.service_client.config.target_host
    proc_env = {
        "TEMPORAL_ADDRESS": address,
        "DARL_TOKEN_SECRET": SECRET,
        "DARL_ADMIN_KEY": ADMIN,
        "PATH": str(bin_dir) + ":/usr/bin:/bin",
    }
    queue = f"bench-{uuid.uuid4().hex[:6]}"
    upstream = ManagedProcess(
        "fake-upstream",
        [sys.executable, "-m", "bench.fake_upstream", "--ready-file", str(root / "up.json")],
        root / "fake-upstream.log",
        env=proc_env,
        ready_file=root / "up.json",
        cwd=Path(__file__).resolve().parents[1],
    ).start()
    processes = [upstream]
    try:
        upstream_url = upstream.wait_ready()["url"]
        gateway = ManagedProcess.darl(
            "gateway",
            [
                "gateway",
                "--port",
                "0",
                "--upstream",
                upstream_url,
                "--model",
                "fake",
                "--store-dir",
                str(root / "store"),
                *(["--store-fsync"] if fsync else []),
            ],
            root,
            env=proc_env,
        ).start()
        processes.append(gateway)
        gateway_url = gateway.wait_ready()["url"]
        worker = ManagedProcess.darl(
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
            env=proc_env,
        ).start()
        processes.append(worker)
        worker.wait_ready()
        rollouts = await idle_rollouts(env, queue, clients)
        expires = int(time.time() + 3600)
        through_gateway = [
            (
                f"{gateway_url}/rollouts/{r}/v1/chat/completions",
                {
                    "Authorization": "Bearer "
                    + mint_token(SECRET.encode(), TokenClaims(r, 1, "train", expires))
                },
            )
            for r in rollouts
        ]
        direct = [(f"{upstream_url}/v1/chat/completions", {})] * clients

        await drive("warm-up direct", direct, clients * 10)
        await drive("warm-up gateway", through_gateway, clients * 10)
        watched = {
            "gateway": gateway.pid,
            "rollout worker": worker.pid,
            "temporal server": temporal_server_pid(),
            "fake upstream": upstream.pid,
            "benchmark client": os.getpid(),
        }
        cpu0 = cpu_seconds(watched)
        straight = await drive("direct", direct, calls)
        cpu1 = cpu_seconds(watched)
        before = histogram_means(httpx.get(f"{gateway_url}/metrics").text)
        captured = await drive("gateway", through_gateway, calls)
        after = histogram_means(httpx.get(f"{gateway_url}/metrics").text)
        cpu2 = cpu_seconds(watched)
        report(straight, captured, before, after, clients, fsync)
        print("\nCPU per call by process, ms (2 cores shared by all of them):")
        print(f"  {'process':<20}{'direct':>9}{'gateway':>9}")
        for name in watched:
            d = (cpu1[name] - cpu0[name]) / calls * 1000
            g = (cpu2[name] - cpu1[name]) / calls * 1000
            print(f"  {name:<20}{d:>9.2f}{g:>9.2f}")
    finally:
        for rollout_id in locals().get("rollouts", []):
            await env.client.get_workflow_handle(rollout_workflow_id(rollout_id)).cancel()
        for process in reversed(processes):
            process.stop()
        stop_leftover_agents(root / "agents")
        await env.shutdown()


def report(
    straight: Phase,
    captured: Phase,
    before: dict[str, tuple[float, float]],
    after: dict[str, tuple[float, float]],
    clients: int,
    fsync: bool,
) -> None:
    print(
        f"\nGateway benchmark: {clients} concurrent clients, {len(straight.latencies)} calls "
        f"per phase, store fsync={'on' if fsync else 'off'}, loopback, fast fake upstream\n"
    )
    print(f"{'path':<28}{'p50 ms':>9}{'p99 ms':>9}{'mean ms':>9}{'calls/s':>10}")
    for phase in (straight, captured):
        mean = statistics.fmean(phase.latencies) * 1000
        print(
            f"{phase.name:<28}{phase.pct(0.5):>9.2f}{phase.pct(0.99):>9.2f}{mean:>9.2f}"
            f"{phase.rate:>10.0f}"
        )
    print(
        f"{'added by the gateway':<28}{captured.pct(0.5) - straight.pct(0.5):>9.2f}"
        f"{captured.pct(0.99) - straight.pct(0.99):>9.2f}"
    )
    print("\nWhere a captured call's time goes inside the gateway (mean per call):")
    for key, label in (
        ("darl_gateway_upstream_seconds", "proxying to the upstream"),
        ('darl_gateway_capture_seconds{phase="store"}', "trajectory store write"),
        ('darl_gateway_capture_seconds{phase="signal"}', "Temporal signal"),
    ):
        total = after.get(key, (0, 0))[0] - before.get(key, (0, 0))[0]
        count = after.get(key, (0, 0))[1] - before.get(key, (0, 0))[1]
        print(f"  {label:<26}{(total / count * 1000 if count else float('nan')):>8.2f} ms")
    print("  (the rest: HTTP parsing, auth, JSON, tracing, the client's own share of 2 cores)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3200)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--fsync", action="store_true", help="fsync each record")
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.clients, args.fsync))
