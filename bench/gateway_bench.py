"""Gateway benchmark: what capture costs. Prints figures; asserts nothing.

In one run, 32 concurrent clients send chat completions (1) straight to a fast fake upstream
and (2) through the real gateway with capture on (store write + Temporal signal into a running
RolloutWorkflow on the real dev server, served by a real rollout worker). It reports latency
p50/p99 and calls/s for both, the added latency, and where the gateway's time goes (from its
own Prometheus histograms). Then one client sends the same question as a chat completion, a
Responses API call and an Anthropic Messages call, interleaved in rounds, through the same
gateway to the same fake upstream: what translating a protocol adds. Then one rollout's
conversation grows call by call to 48k tokens, as a coding agent's does (the fake upstream's
token ids follow the text, so each prompt extends the one before): the gateway's CPU per call
and the added latency at 8k, 16k, 32k and 48k tokens of context. Last, the same load through
a gateway on the directory store and one on the S3 store (moto's S3 emulator on loopback, its
CPU counted apart), back to back and at the same paced rates: calls/s and CPU per call of
each (bench/store_bench.py).

    make bench            # or: .venv/bin/python -m bench.gateway_bench [--calls 3000]
    # the long-context phase alone, and against another checkout's gateway in the same run:
    .venv/bin/python -m bench.gateway_bench --long-context-only [--against PYTHONPATH]
    # instead of the phases above: short calls (32 clients, then one) through this checkout's
    # gateway and another's, in alternating rounds of the same run:
    .venv/bin/python -m bench.gateway_bench --against PYTHONPATH
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import psutil

from bench.load import (
    ADMIN,
    BODY,
    Phase,
    cpu_seconds,
    drive,
    gateway_targets,
    idle_rollouts,
    process_env,
    scrape,
    start_dev_server,
    start_fake_upstream,
    start_gateway,
    start_worker,
    temporal_server_pid,
)
from bench.store_bench import compare_stores, start_s3_gateway
from darl.activities.runners.local import stop_leftover_agents
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


async def main(
    calls: int, clients: int, fsync: bool, rate: float, long_only: bool, against: str | None
) -> None:
    root = Path(tempfile.mkdtemp(prefix="darl-bench-"))
    env = await start_dev_server()
    proc_env = process_env(env)
    queue = f"bench-{uuid.uuid4().hex[:6]}"
    upstream = start_fake_upstream(root, proc_env)
    processes = [upstream]
    try:
        upstream_url = upstream.wait_ready()["url"]
        # The same flags for this checkout's gateway and, with --against, the other one.
        flags = [
            *(["--store-fsync"] if fsync else []),
            *os.environ.get("BENCH_GATEWAY_ARGS", "").split(),
        ]
        gateway = start_gateway(
            root, proc_env, "gateway", upstream_url, "--store-dir", str(root / "store"), *flags
        )
        processes.append(gateway)
        gateway_url = gateway.wait_ready()["url"]
        worker = start_worker(root, proc_env, gateway_url, queue)
        processes.append(worker)
        worker.wait_ready()
        gateways = [("gateway", gateway_url, gateway.pid, root / "store")]
        if against is not None:
            # Another checkout's DARL in front of this one's (docs/benchmarks.md).
            other = start_gateway(
                root / "against",
                {**proc_env, "PYTHONPATH": against},
                "gateway",
                upstream_url,
                "--store-dir",
                str(root / "against" / "store"),
                *flags,
            )
            processes.append(other)
            gateways.append(
                ("against", other.wait_ready()["url"], other.pid, root / "against" / "store")
            )
        if against is not None and not long_only:
            # Both gateways take calls for the same rollouts, so what a rollout costs (its
            # workflow's history, its worker) falls on both alike. The worker opened each
            # attempt at its own gateway; the other one is told too, so neither asks Temporal
            # whether a rollout runs.
            rollouts = await idle_rollouts(env, queue, clients)
            await open_attempts(gateways[1][1], rollouts)
            await short_calls_against(
                [(name, pid, gateway_targets(url, rollouts)) for name, url, pid, _ in gateways],
                calls,
            )
            return
        if long_only:
            rollouts = await idle_rollouts(env, queue, len(gateways))
            await long_context(
                upstream_url,
                [
                    LongGateway(name, url, rollout_id, pid, store / rollout_id)
                    for (name, url, pid, store), rollout_id in zip(gateways, rollouts, strict=True)
                ],
            )
            return
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
        [long_rollout] = await idle_rollouts(env, queue, 1)
        rollouts.append(long_rollout)
        store = root / "store" / long_rollout
        await long_context(
            upstream_url, [LongGateway("gateway", gateway_url, long_rollout, gateway.pid, store)]
        )
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


LONG_CONTEXTS = (8_000, 16_000, 32_000, 48_000)
# Tokens each turn adds (a user message, and the 16-token answer): ~480 calls to 48k.
TURN_TOKENS = 100
# Calls measured around each context size (the CPU clock ticks in 10 ms: a window, not a call).
WINDOW = 40


@dataclass(frozen=True)
class LongGateway:
    """A gateway the long-context phase measures, and the rollout its conversation is in."""

    name: str
    url: str
    rollout_id: str
    pid: int
    store: Path


async def long_context(upstream_url: str, gateways: list[LongGateway]) -> None:
    """One client, one conversation growing by TURN_TOKENS a call; around each size in
    LONG_CONTEXTS, WINDOW calls are timed through each gateway and, with the same body,
    straight to the upstream (interleaved), and each gateway's CPU is read over its calls.
    Two gateways (this checkout's and another's, `--against`) take the same calls in
    alternating order, so the machine's drift falls on both alike."""
    targets = []
    for gateway in gateways:
        [(url, headers)] = gateway_targets(gateway.url, [gateway.rollout_id])
        targets.append((gateway, url, {**headers, "Content-Type": "application/json"}))
    direct_url = f"{upstream_url}/v1/chat/completions"
    messages: list[dict[str, str]] = [{"role": "system", "content": "You fix bugs." * 20}]
    tokens = 0
    rows = []
    async with aiohttp.ClientSession() as session:

        async def post(target: str, payload: bytes, extra: dict[str, str]) -> dict:
            async with session.post(target, data=payload, headers=extra) as response:
                if response.status != 200:
                    raise RuntimeError(f"long context: {response.status} {await response.text()}")
                return await response.json()

        for target in LONG_CONTEXTS:
            through: dict[str, list[float]] = {g.name: [] for g in gateways}
            cpu = {g.name: 0.0 for g in gateways}
            direct: list[float] = []
            while tokens < target:
                turn = f"Output of step {len(messages)}: " + "ok " * 30
                messages.append({"role": "user", "content": turn[: TURN_TOKENS - 17]})
                body = {"model": "m", "messages": messages, "max_tokens": 16}
                payload = json.dumps({**body, "bench_follow_text": True}).encode()
                timed = tokens >= target - WINDOW * TURN_TOKENS
                if timed:
                    t0 = time.perf_counter()
                    await post(direct_url, payload, {"Content-Type": "application/json"})
                    direct.append(time.perf_counter() - t0)
                turn_order = targets if len(messages) % 4 < 2 else targets[::-1]
                for gateway, url, headers in turn_order:
                    watched = {gateway.name: gateway.pid}
                    before = cpu_seconds(watched)[gateway.name]
                    t0 = time.perf_counter()
                    answer = await post(url, payload, headers)
                    if timed:
                        through[gateway.name].append(time.perf_counter() - t0)
                        cpu[gateway.name] += cpu_seconds(watched)[gateway.name] - before
                messages.append(answer["choices"][0]["message"])
                tokens = answer["usage"]["total_tokens"]
            rows.append((target, Phase("direct", direct, 1.0), through, cpu))
    calls = len(messages) // 2
    size = sum(f.stat().st_size for f in gateways[0].store.glob("attempt-*.jsonl"))
    print(
        f"\nLong context: one conversation grown by {TURN_TOKENS} tokens a call to "
        f"{tokens} tokens ({calls} calls, store {size / 1e6:.2f} MB); {WINDOW} calls timed "
        "before each size:"
    )
    header = f"{'direct p50':>12}{'gateway p50':>13}{'added p50':>11}{'gateway CPU ms/call':>22}"
    others = [g.name for g in gateways[1:]]
    for name in others:
        header += f"{name + ' p50':>16}{name + ' CPU':>16}{'CPU ratio':>11}"
    print(f"  {'context':>9}{header}")
    first = gateways[0].name
    for target, straight, through, cpu in rows:
        gateway = Phase("gateway", through[first], 1.0)
        per_call = cpu[first] / len(gateway.latencies) * 1000
        line = (
            f"  {target:>9}{straight.pct(0.5):>12.2f}{gateway.pct(0.5):>13.2f}"
            f"{gateway.pct(0.5) - straight.pct(0.5):>11.2f}{per_call:>22.2f}"
        )
        for name in others:
            other = cpu[name] / len(through[name]) * 1000
            line += f"{Phase(name, through[name], 1.0).pct(0.5):>16.2f}{other:>16.2f}"
            line += f"{per_call / other:>11.2f}"
        print(line)


async def open_attempts(gateway_url: str, rollouts: list[str]) -> None:
    """Open each rollout's first attempt at the gateway, as the rollout worker does."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ADMIN}"}) as session:
        for rollout_id in rollouts:
            url = f"{gateway_url}/admin/rollouts/{rollout_id}/attempts/1/open"
            async with session.post(url) as response:
                if response.status != 200:
                    raise RuntimeError(f"opening {rollout_id}: {response.status}")


# Rounds of the short-call comparison; each gateway takes calls/AGAINST_ROUNDS a round.
AGAINST_ROUNDS = 8
# A gateway signals a call's event within this long of the call (its delivery's interval of
# 1 s, give or take a fifth, and the signal's round trip).
SIGNALLED_WITHIN = 1.5


async def short_calls_against(
    gateways: list[tuple[str, int, list[tuple[str, dict[str, str]]]]], calls: int
) -> None:
    """Short chat calls through two gateways (this checkout's and another's, `--against`), in
    rounds that alternate which goes first, so the machine's drift falls on both alike: at
    len(targets) clients back to back, then at one client. Each gateway's CPU is read from
    before its first round to after its last one's calls were signalled (a gateway signals a
    call's event up to a second after it; read round by round, that work fell in whichever
    window was open), so it includes both gateways' idle work while the other one runs."""
    print(f"\nShort calls, {AGAINST_ROUNDS} rounds alternating which gateway goes first:")
    columns = f"{'clients':>8}{'calls':>7}{'calls/s':>9}{'p50 ms':>8}{'CPU ms/call':>13}"
    print(f"  {'gateway':<10}{columns}")
    pids = {name: pid for name, pid, _ in gateways}
    for clients in sorted({len(gateways[0][2]), 1}, reverse=True):
        per_round = max(calls // AGAINST_ROUNDS // (1 if clients > 1 else 4), clients * 10)
        for _, _, targets in gateways:  # warm each up
            await drive("warm-up", targets[:clients], clients * 10)
        await asyncio.sleep(SIGNALLED_WITHIN)
        latencies: dict[str, list[float]] = {name: [] for name in pids}
        seconds = dict.fromkeys(pids, 0.0)
        before = cpu_seconds(pids)
        for n in range(AGAINST_ROUNDS):
            for name, _, targets in gateways if n % 2 == 0 else gateways[::-1]:
                phase = await drive(name, targets[:clients], per_round)
                latencies[name] += phase.latencies
                seconds[name] += phase.seconds
        await asyncio.sleep(SIGNALLED_WITHIN)
        after = cpu_seconds(pids)
        cpu = {name: after[name] - before[name] for name in pids}
        for name in latencies:
            phase = Phase(name, latencies[name], seconds[name])
            count = len(phase.latencies)
            print(
                f"  {name:<10}{clients:>8}{count:>7}{phase.rate:>9.0f}{phase.pct(0.5):>8.2f}"
                f"{cpu[name] / count * 1000:>13.3f}"
            )
        first, second = list(latencies)
        ratio = (cpu[first] / len(latencies[first])) / (cpu[second] / len(latencies[second]))
        print(f"  CPU per call, {first} / {second}: {ratio:.3f}")


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
    parser.add_argument(
        "--long-context-only", action="store_true", help="run the long-context phase alone"
    )
    parser.add_argument(
        "--against",
        metavar="PYTHONPATH",
        help="a second gateway run from another checkout's DARL (a PYTHONPATH putting it "
        "first), taking the same calls in alternating order: only short calls, at --clients "
        "clients and at one, or with --long-context-only only the long-context phase",
    )
    args = parser.parse_args()
    asyncio.run(
        main(
            args.calls,
            args.clients,
            args.fsync,
            args.rate,
            args.long_context_only,
            args.against,
        )
    )
    # The Temporal SDK's runtime can crash at interpreter exit (sdk-python #300): leave now.
    sys.stdout.flush()
    os._exit(0)
