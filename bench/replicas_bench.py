"""Gateway replicas benchmark: one gateway replica against two behind HAProxy, same load, one
run. Prints figures; asserts nothing.

Two real gateways share one directory store and journal (distinct `--instance`), capture on
(store write + Temporal signal into running RolloutWorkflows on the real dev server), in front
of the fast fake upstream. The same clients (bench/load.py's load generator, one rollout
each) drive, in turn: replica A directly, A alone behind HAProxy, A and B behind HAProxy
round-robin (each rollout's calls alternate replicas), and A and B behind HAProxy balancing
by rollout (the path's rollout id hashed: a rollout's calls stay on one replica). For each:
calls/s, latency, and CPU ms per call of the gateway processes and of HAProxy, separately.
Then replay across replicas (rule 10): each rollout's attempt 2 replays attempt 1's record
(the calls above, all alike) through the round-robin HAProxy, two clients per attempt at
once; counted from the store, the calls replayed, the recorded calls served twice and those
served after the attempt's first live call (both must be 0), and from the replicas' logs the
records a replica's session offered that the store had seen served (passed over).

    make bench-replicas   # or: .venv/bin/python -m bench.replicas_bench [--calls 3200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

from bench.load import (
    SECRET,
    Phase,
    cpu_seconds,
    drive,
    gateway_targets,
    idle_rollouts,
    process_env,
    start_dev_server,
    start_fake_upstream,
    start_gateway,
    start_worker,
)
from darl.activities.runners.local import stop_leftover_agents
from darl.deploy.processes import ManagedProcess
from darl.gateway.store.directory import DirectoryTrajectoryStore
from darl.workflows.contracts import rollout_workflow_id
from darl.workflows.rollout_token import ReplayClaim, TokenClaims, mint_token
from tests.haproxy import BY_ROLLOUT, HAProxy


async def main(calls: int, clients: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="darl-replicas-bench-"))
    env = await start_dev_server()
    proc_env = process_env(env, "/usr/bin:/bin:/usr/sbin")
    queue = f"bench-{uuid.uuid4().hex[:6]}"
    processes: list[ManagedProcess] = []
    balancers: list[HAProxy] = []
    rollouts: list[str] = []
    try:
        upstream = start_fake_upstream(root, proc_env)
        processes.append(upstream)
        upstream_url = upstream.wait_ready()["url"]
        gateways = {
            name: start_gateway(
                root,
                proc_env,
                name,
                upstream_url,
                "--store-dir",
                str(root / "store"),
                "--instance",
                name,
            )
            for name in ("gateway-a", "gateway-b")
        }
        processes += gateways.values()
        urls = {name: g.wait_ready()["url"] for name, g in gateways.items()}
        worker = start_worker(root, proc_env, urls["gateway-a"], queue)
        processes.append(worker)
        worker.wait_ready()
        one = HAProxy(root / "haproxy-one", [urls["gateway-a"]]).start()
        two = HAProxy(root / "haproxy-two", list(urls.values())).start()
        hashed = HAProxy(root / "haproxy-hashed", list(urls.values()), BY_ROLLOUT).start()
        balancers += [one, two, hashed]
        rollouts = await idle_rollouts(env, queue, clients)
        phases = [
            ("1 replica, direct", gateway_targets(urls["gateway-a"], rollouts)),
            ("1 replica, HAProxy", gateway_targets(one.url, rollouts)),
            ("2 replicas, HAProxy", gateway_targets(two.url, rollouts)),
            ("2 replicas, by rollout", gateway_targets(hashed.url, rollouts)),
        ]
        for name, load in phases:
            await drive(f"warm-up {name}", load, clients * 10)
        watched = {
            "gateway-a": gateways["gateway-a"].pid,
            "gateway-b": gateways["gateway-b"].pid,
            "haproxy (1 replica)": one.pid,
            "haproxy (2 replicas)": two.pid,
            "haproxy (by rollout)": hashed.pid,
        }
        results: list[tuple[Phase, dict[str, float]]] = []
        for name, load in phases:
            before = cpu_seconds(watched)
            phase = await drive(name, load, calls)
            after = cpu_seconds(watched)
            results.append((phase, {k: after[k] - before[k] for k in watched}))
        print_table(results, clients, calls)
        replay_load = replay_targets(two.url, rollouts, REPLAY_CLIENTS_PER_ATTEMPT)
        before = cpu_seconds(watched)
        replayed = await drive("replay, 2 replicas", replay_load, calls)
        after = cpu_seconds(watched)
        spent = {k: after[k] - before[k] for k in watched}
        counts = await replay_counts(DirectoryTrajectoryStore(root / "store"), rollouts)
        passed_over = sum(
            (root / f"{name}.log").read_text().count("was served already") for name in gateways
        )
        print_replay(replayed, spent, counts, passed_over)
    finally:
        for rollout_id in rollouts:
            await env.client.get_workflow_handle(rollout_workflow_id(rollout_id)).cancel()
        for balancer in balancers:
            balancer.stop()
        for process in reversed(processes):
            process.stop()
        stop_leftover_agents(root / "agents")
        await env.shutdown()


# Clients sending one replaying attempt's calls at once (round-robin: to both replicas).
REPLAY_CLIENTS_PER_ATTEMPT = 2


def replay_targets(
    gateway_url: str, rollouts: list[str], per_attempt: int
) -> list[tuple[str, dict[str, str]]]:
    """`per_attempt` chat-completions targets per rollout, with the token of its attempt 2,
    which replays attempt 1."""
    expires = int(time.time() + 3600)
    replay = ReplayClaim(sources=(1,))
    return [
        (
            f"{gateway_url}/rollouts/{r}/v1/chat/completions",
            {
                "Authorization": "Bearer "
                + mint_token(SECRET.encode(), TokenClaims(r, 2, "train", expires, replay=replay))
            },
        )
        for r in rollouts
        for _ in range(per_attempt)
    ]


async def replay_counts(store: DirectoryTrajectoryStore, rollouts: list[str]) -> dict[str, int]:
    """Counted from the store over the rollouts' attempt 2: calls replayed, recorded calls
    served more than once (each time past the first), replayed calls after a live call."""
    counts = {"replayed": 0, "live": 0, "served twice": 0, "after live": 0}
    for rollout_id in rollouts:
        records = await store.read(rollout_id, 2)
        served = Counter(r.replayed_from for r in records if r.replayed_from is not None)
        live = [r.sequence for r in records if r.replayed_from is None]
        counts["replayed"] += sum(served.values())
        counts["live"] += len(live)
        counts["served twice"] += sum(n - 1 for n in served.values())
        counts["after live"] += sum(
            1 for r in records if r.replayed_from is not None and live and r.sequence > min(live)
        )
    return counts


def print_replay(
    phase: Phase, cpu: dict[str, float], counts: dict[str, int], passed_over: int
) -> None:
    n = len(phase.latencies)
    a, b = cpu["gateway-a"] / n * 1000, cpu["gateway-b"] / n * 1000
    print(
        f"\nReplay across replicas: attempt 2 of each rollout replays attempt 1, "
        f"{REPLAY_CLIENTS_PER_ATTEMPT} clients per attempt at once, round-robin HAProxy\n"
    )
    print(
        f"{'calls/s':>9}{'p50 ms':>8}{'p99 ms':>8}{'gw-a ms':>9}{'gw-b ms':>9}"
        f"{'replayed':>10}{'live':>6}{'served twice':>14}{'after live':>12}{'passed over':>13}"
    )
    print(
        f"{phase.rate:>9.0f}{phase.pct(0.5):>8.2f}{phase.pct(0.99):>8.2f}{a:>9.2f}{b:>9.2f}"
        f"{counts['replayed']:>10}{counts['live']:>6}{counts['served twice']:>14}"
        f"{counts['after live']:>12}{passed_over:>13}"
    )


def print_table(results: list[tuple[Phase, dict[str, float]]], clients: int, calls: int) -> None:
    print(
        f"\nGateway replicas: {clients} concurrent clients back to back, {calls} calls per "
        "phase, capture on, loopback, fast fake upstream, 2 cores shared by every process\n"
    )
    header = (
        f"{'phase':<22}{'calls/s':>9}{'p50 ms':>8}{'p99 ms':>8}"
        f"{'gw-a ms':>9}{'gw-b ms':>9}{'gateways':>10}{'haproxy':>9}"
    )
    print(header + "   (CPU ms per call)")
    for phase, cpu in results:
        n = len(phase.latencies)
        a, b = cpu["gateway-a"] / n * 1000, cpu["gateway-b"] / n * 1000
        balancer = sum(v for k, v in cpu.items() if k.startswith("haproxy")) / n * 1000
        print(
            f"{phase.name:<22}{phase.rate:>9.0f}{phase.pct(0.5):>8.2f}{phase.pct(0.99):>8.2f}"
            f"{a:>9.2f}{b:>9.2f}{a + b:>10.2f}{balancer:>9.3f}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3200)
    parser.add_argument("--clients", type=int, default=32)
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.clients))
    # The Temporal SDK's runtime can crash at interpreter exit (sdk-python #300): leave now.
    sys.stdout.flush()
    os._exit(0)
