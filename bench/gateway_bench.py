"""Gateway benchmark: what capture costs. Prints figures; asserts nothing.

In one run, 32 concurrent clients send chat completions (1) straight to a fast fake upstream
and (2) through the real gateway with capture on (store write + Temporal signal into a running
RolloutWorkflow on the real dev server, served by a real rollout worker). It reports latency
p50/p99 and calls/s for both, the added latency, and where the gateway's time goes (from its
own Prometheus histograms). Then one client sends the same question as a chat completion, a
Responses API call and an Anthropic Messages call, interleaved in rounds, through the same
gateway to the same fake upstream: what translating a protocol adds. Last, the same load
through a gateway on the directory store and one on the S3 store (moto's S3 emulator on
loopback, its CPU counted apart): calls/s and CPU per call of each (bench/store_bench.py).

    make bench            # or: .venv/bin/python -m bench.gateway_bench [--calls 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

import httpx
import psutil
from temporalio.testing import WorkflowEnvironment

from bench.load import (
    ADMIN,
    BODY,
    SECRET,
    Phase,
    cpu_seconds,
    drive,
    gateway_targets,
    idle_rollouts,
    scrape,
    start_fake_upstream,
    start_gateway,
    start_worker,
    temporal_server_pid,
)
from bench.store_bench import compare_stores, start_s3_gateway
from darl.activities.runners.local import stop_leftover_agents
from darl.deploy.temporal_connection import DATA_CONVERTER
from darl.workflows import search_attributes as sa
from darl.workflows.contracts import (
    rollout_workflow_id,
)

PROTOCOLS = {
    "chat.completions": ("/v1/chat/completions", BODY),
    "responses": (
        "/v1/responses",
        {"model": "m", "input": "What is 2 + 2?", "max_output_tokens": 16},
    ),
    "messages": (
        "/v1/messages",
        {
            "model": "m",
            "max_tokens": 16,
            "messages": [{"role": "user", "content": "What is 2 + 2?"}],
        },
    ),
}


async def main(calls: int, clients: int, fsync: bool, rate: float) -> None:
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
    upstream = start_fake_upstream(root, proc_env)
    processes = [upstream]
    try:
        upstream_url = upstream.wait_ready()["url"]
        gateway = start_gateway(
            root,
            proc_env,
            "gateway",
            upstream_url,
            "--store-dir",
            str(root / "store"),
            *(["--store-fsync"] if fsync else []),
            *os.environ.get("BENCH_GATEWAY_ARGS", "").split(),
        )
        processes.append(gateway)
        gateway_url = gateway.wait_ready()["url"]
        worker = start_worker(root, proc_env, gateway_url, queue)
        processes.append(worker)
        worker.wait_ready()
        rollouts = await idle_rollouts(env, queue, clients)
        through_gateway = gateway_targets(gateway_url, rollouts)
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
        alone_direct = await drive("direct, 1 client", direct[:1], calls // 8)
        alone_gateway = await drive("gateway, 1 client", through_gateway[:1], calls // 8)
        paced_direct = await drive(f"direct, {rate:g}/s", direct, calls // 2, rate)
        paced_gateway = await drive(f"gateway, {rate:g}/s", through_gateway, calls // 2, rate)
        rss0 = psutil.Process(gateway.pid).memory_info().rss
        cpu0 = cpu_seconds(watched)
        straight = await drive("direct", direct, calls)
        cpu1 = cpu_seconds(watched)
        before = scrape(httpx.get(f"{gateway_url}/metrics").text)
        captured = await drive("gateway", through_gateway, calls)
        after = scrape(httpx.get(f"{gateway_url}/metrics").text)
        cpu2 = cpu_seconds(watched)
        rss1 = psutil.Process(gateway.pid).memory_info().rss
        report(straight, captured, before, after, clients, fsync)
        for title, direct_phase, gateway_phase in (
            (f"{clients} clients paced to {rate:g} calls/s in all", paced_direct, paced_gateway),
            ("One client, back to back", alone_direct, alone_gateway),
        ):
            print(f"\n{title} ({len(direct_phase.latencies)} calls each):")
            compare(direct_phase, gateway_phase)
        print(
            f"\nGateway memory: {rss0 / 2**20:.0f} MiB before the measured phases, "
            f"{rss1 / 2**20:.0f} MiB after {calls} more calls "
            f"({(rss1 - rss0) / calls:.0f} bytes per call; records live in the store)"
        )
        print("\nCPU per call by process, ms (2 cores shared by all of them):")
        print(f"  {'process':<20}{'direct':>9}{'gateway':>9}")
        for name in watched:
            d = (cpu1[name] - cpu0[name]) / calls * 1000
            g = (cpu2[name] - cpu1[name]) / calls * 1000
            print(f"  {name:<20}{d:>9.2f}{g:>9.2f}")
        await compare_protocols(gateway_url, rollouts[0], through_gateway[0][1], gateway.pid, calls)
        emulator, s3_gateway, s3_url = start_s3_gateway(root, proc_env, upstream_url, processes)
        await compare_stores(
            env,
            queue,
            {"directory": (gateway_url, gateway.pid), "s3 (emulator)": (s3_url, s3_gateway.pid)},
            {"s3 emulator": emulator.pid, "temporal server": temporal_server_pid()},
            calls,
            clients,
            rollouts,
        )
    finally:
        for rollout_id in locals().get("rollouts", []):
            await env.client.get_workflow_handle(rollout_workflow_id(rollout_id)).cancel()
        for process in reversed(processes):
            process.stop()
        stop_leftover_agents(root / "agents")
        await env.shutdown()


async def compare_protocols(
    gateway_url: str, rollout_id: str, headers: dict[str, str], gateway_pid: int, calls: int
) -> None:
    """One client, the three protocols interleaved in rounds (so drift in the machine's load
    falls on all three alike): latency and the gateway's CPU per call of each."""
    rounds, per_round = 8, max(calls // 32, 10)
    latencies: dict[str, list[float]] = {name: [] for name in PROTOCOLS}
    cpu: dict[str, float] = dict.fromkeys(PROTOCOLS, 0.0)
    for name, (path, body) in PROTOCOLS.items():  # warm each path up
        await drive(name, [(f"{gateway_url}/rollouts/{rollout_id}{path}", headers)], 20, body=body)
    for _ in range(rounds):
        for name, (path, body) in PROTOCOLS.items():
            target = [(f"{gateway_url}/rollouts/{rollout_id}{path}", headers)]
            before = cpu_seconds({"gateway": gateway_pid})["gateway"]
            phase = await drive(name, target, per_round, body=body)
            cpu[name] += cpu_seconds({"gateway": gateway_pid})["gateway"] - before
            latencies[name] += phase.latencies
    print(
        f"\nProtocols: one client back to back, {rounds} interleaved rounds of {per_round} "
        "calls each, same gateway, same fake upstream:"
    )
    print(f"  {'protocol':<20}{'p50 ms':>9}{'p99 ms':>9}{'gateway CPU ms/call':>22}")
    chat = Phase("chat", latencies["chat.completions"], 1.0)
    for name in PROTOCOLS:
        phase = Phase(name, latencies[name], 1.0)
        per_call = cpu[name] / len(phase.latencies) * 1000
        print(f"  {name:<20}{phase.pct(0.5):>9.3f}{phase.pct(0.99):>9.3f}{per_call:>22.3f}")
    for name in ("responses", "messages"):
        phase = Phase(name, latencies[name], 1.0)
        print(
            f"  added by translating {name:<10} p50 {phase.pct(0.5) - chat.pct(0.5):+.3f} ms"
            f"   p99 {phase.pct(0.99) - chat.pct(0.99):+.3f} ms"
        )


def compare(direct: Phase, gateway: Phase) -> None:
    for phase in (direct, gateway):
        print(
            f"  {phase.name:<26}p50 {phase.pct(0.5):6.2f} ms   p99 {phase.pct(0.99):6.2f} ms"
            f"   {phase.rate:6.0f} calls/s"
        )
    added50 = gateway.pct(0.5) - direct.pct(0.5)
    added99 = gateway.pct(0.99) - direct.pct(0.99)
    print(f"  {'added by the gateway':<26}p50 {added50:6.2f} ms   p99 {added99:6.2f} ms")


def report(
    straight: Phase,
    captured: Phase,
    before: dict[str, float],
    after: dict[str, float],
    clients: int,
    fsync: bool,
) -> None:
    print(
        f"\nGateway benchmark: {clients} concurrent clients, {len(straight.latencies)} calls "
        f"per phase, store fsync={'on' if fsync else 'off'}, loopback, fast fake upstream\n"
    )
    print(f"Saturation: {clients} clients back to back")
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

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    for metric, labels, label in (
        ("darl_gateway_upstream_seconds", "", "waiting on the upstream"),
        ("darl_gateway_store_write_seconds", "", "trajectory store write"),
    ):
        count = delta(f"{metric}_count{labels}")
        mean = delta(f"{metric}_sum{labels}") / count * 1000 if count else float("nan")
        print(f"  {label:<26}{mean:>8.2f} ms")
    print("  (the rest: HTTP parsing, auth, JSON, tracing; and queueing for 2 shared cores)")
    events = delta("darl_gateway_delivered_events_total")
    signals = delta("darl_gateway_delivery_signals_total")
    if signals:
        print(
            f"  Temporal signals: {signals:.0f} carried {events:.0f} call events "
            f"({events / signals:.1f} per signal), off the answer path"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3200)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--fsync", action="store_true", help="fsync each record")
    parser.add_argument("--rate", type=float, default=300.0, help="calls/s of the paced phase")
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.clients, args.fsync, args.rate))
    # The Temporal SDK's runtime can crash at interpreter exit (sdk-python #300): leave now.
    sys.stdout.flush()
    os._exit(0)
