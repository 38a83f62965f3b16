"""Replay benchmark (rule 10): what resuming a lost agent by replay saves. Prints figures;
asserts nothing.

On a stack of its own (a Temporal dev server, DARL's reference policy server with the tiny
model, the gateway, a rollout worker), one long multi-turn agent (tests/agents/replay_agent.py:
the OpenAI SDK on token ids, a deterministic tool, the conversation sent whole each turn) is
SIGKILLed at call K of N, twice: once resumed by replay (`resume: replay`, the default), once
started over (`resume: restart`). For each: the rollout's wall time; the time its resumed
attempt took to get back to call K against the time the first attempt took to get there (from
the agent's start), and a call's time on the way; the tokens the policy server generated (its
own log), of them those the trained trajectory does not hold and those generated twice for
one prompt. Then the gateway's
CPU per call, live against replayed: the same calls sent once with an attempt's token and
again with the next attempt's, which replays them.

    .venv/bin/python -m bench.replay_bench [--calls 40] [--kill-at 30] [--max-tokens 24]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
from rich.console import Console
from rich.table import Table

from darl.deploy.devstack import connect_when_ready, register_search_attributes
from darl.workflows.contracts import LocalAgentSpec, RolloutSpec, RolloutTimeouts
from darl.workflows.rollout_token import ReplayClaim, TokenClaims, mint_token
from tests.integration.dev_server import DevServer
from tests.integration.stack import TOKEN_SECRET, Stack

AGENT = str(Path(__file__).resolve().parents[1] / "tests" / "agents" / "replay_agent.py")
TIMEOUT = 600


@dataclass(frozen=True)
class Resumed:
    mode: str
    wall_seconds: float
    # From the agent's start to its K-th answer: attempt 1, and the attempt after the kill.
    first_to_kill_point: float
    again_to_kill_point: float
    # The median time between two of the first K answers, as the agent saw them.
    first_per_call: float
    again_per_call: float
    generated_tokens: int
    # Tokens generated that the trained trajectory does not hold (the lost attempt's, when
    # it started over), and those generated for a prompt already generated for.
    thrown_away: int
    generated_twice: int
    replayed_calls: int


def agent_lines(log: Path, rollout_id: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    return [line for line in lines if line["rollout"] == rollout_id]


def to_kill_point(lines: list[dict[str, Any]], attempt: int, kill_at: int) -> tuple[float, float]:
    """Seconds from the attempt's agent start to its K-th answer, and the median time
    between two of its first K answers."""
    mine = [line for line in lines if line["attempt"] == attempt]
    start = next(line["start"] for line in mine if "start" in line)
    answers = [line["at"] for line in mine if "call_id" in line][:kill_at]
    gaps = [later - earlier for earlier, later in itertools.pairwise(answers)]
    return answers[-1] - start, statistics.median(gaps)


async def resume_once(
    stack: Stack, mode: str, calls: int, kill_at: int, max_tokens: int
) -> Resumed:
    log = stack.root / f"agent-{mode}.log"
    markers = stack.root / "markers"
    markers.mkdir(exist_ok=True)
    spec = RolloutSpec(
        run_id="bench-replay",
        rollout_id=f"bench-replay-{mode}-{uuid.uuid4().hex[:6]}",
        task={"question": f"A long task ({mode}): count the letters of each answer."},
        agent=LocalAgentSpec(
            command=["{python}", AGENT],
            env={
                # Token-in, token-out: 40 turns of its conversation fit the tiny model.
                "PROTOCOL": "tokens",
                "TURNS": str(calls),
                "KILL_AFTER": str(kill_at),
                "MAX_TOKENS": str(max_tokens),
                "AGENT_LOG": str(log),
                "MARKER_DIR": str(markers),
            },
        ),
        timeouts=RolloutTimeouts(
            agent_seconds=TIMEOUT, heartbeat_seconds=5, retry_backoff_seconds=0.1
        ),
        revision=3,
        resume=mode,  # type: ignore[arg-type]
    )
    started = time.monotonic()
    handle = await stack.start_rollout(spec)
    marker = markers / f"{spec.rollout_id}.1"
    async with asyncio.timeout(TIMEOUT):
        while not marker.exists():
            await asyncio.sleep(0.02)
    agent = stack.agents_dir / spec.rollout_id / "attempt-1" / "handle.json"
    os.killpg(int(json.loads(agent.read_text())["data"]["pid"]), signal.SIGKILL)
    result = await asyncio.wait_for(handle.result(), TIMEOUT)
    wall = time.monotonic() - started
    if result.status != "succeeded" or result.attempts != 2:
        raise RuntimeError(f"{mode}: {result.status} after {result.attempts}: {result.error}")
    records = stack.store().read_sync(spec.rollout_id)
    trained = stack.store().read_sync(spec.rollout_id, call_ids=result.call_ids)
    mine = {r.call_id for r in records}
    generated = [line for line in stack.policy_responses() if line.get("call_id") in mine]
    tokens = sum(len(ids) for line in generated for ids in line["token_ids"])
    # Tokens generated for a prompt that had been generated for before.
    seen: set[tuple[int, ...]] = set()
    twice = 0
    for line in generated:
        prompt = tuple(line["prompt_token_ids"])
        if prompt in seen:
            twice += sum(len(ids) for ids in line["token_ids"])
        seen.add(prompt)
    lines = agent_lines(log, spec.rollout_id)
    first, first_per_call = to_kill_point(lines, 1, kill_at)
    again, again_per_call = to_kill_point(lines, 2, kill_at)
    return Resumed(
        mode=mode,
        wall_seconds=wall,
        first_to_kill_point=first,
        again_to_kill_point=again,
        first_per_call=first_per_call,
        again_per_call=again_per_call,
        generated_tokens=tokens,
        thrown_away=tokens - sum(len(r.completion_token_ids()) for r in trained),
        generated_twice=twice,
        replayed_calls=result.replayed_calls,
    )


def cpu(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


async def gateway_cpu(stack: Stack, calls: int, max_tokens: int) -> dict[str, tuple[float, float]]:
    """Gateway CPU ms per call and p50 latency ms: `calls` live calls of attempt 1 of an idle
    rollout, then the same calls with attempt 2's token, which replays them."""
    rollout_id = await stack.start_idle_rollout("bench-replay-cpu")
    gateway = stack.processes["gateway"].pid
    url = f"{stack.gateway_url}/rollouts/{rollout_id}/v1/chat/completions"
    bodies = [
        {
            "model": "m",
            "messages": [{"role": "user", "content": f"call {i}: what comes next?"}],
            "max_tokens": max_tokens,
        }
        for i in range(calls)
    ]
    expires = int(time.time() + 3600)
    tokens = {
        "live": mint_token(TOKEN_SECRET.encode(), TokenClaims(rollout_id, 1, "train", expires)),
        "replayed": mint_token(
            TOKEN_SECRET.encode(),
            TokenClaims(rollout_id, 2, "train", expires, replay=ReplayClaim(sources=(1,))),
        ),
    }
    figures = {}
    async with httpx.AsyncClient(timeout=60) as http:
        for kind, token in tokens.items():
            headers = {"Authorization": f"Bearer {token}"}
            latencies = []
            before = cpu(gateway)
            for body in bodies:
                sent = time.perf_counter()
                response = await http.post(url, json=body, headers=headers)
                latencies.append(time.perf_counter() - sent)
                response.raise_for_status()
                if kind == "replayed" and "x-darl-replayed-from" not in response.headers:
                    raise RuntimeError("a call of the replaying attempt went live")
            spent = cpu(gateway) - before
            figures[kind] = (spent / calls * 1000, statistics.median(latencies) * 1000)
    return figures


async def main(calls: int, kill_at: int, max_tokens: int, cpu_calls: int) -> None:
    console = Console(width=160)
    with tempfile.TemporaryDirectory(prefix="darl-bench-replay-") as tmp:
        root = Path(tmp)
        server = DevServer(root)
        server.start()
        stack: Stack | None = None
        try:
            await register_search_attributes(server.settings)
            client = await connect_when_ready(server.settings)
            stack = Stack(root / "stack", client)
            await asyncio.to_thread(stack.start)
            runs = [
                await resume_once(stack, mode, calls, kill_at, max_tokens)
                for mode in ("replay", "restart")
            ]
            per_call = await gateway_cpu(stack, cpu_calls, max_tokens)
        finally:
            if stack is not None:
                await asyncio.to_thread(stack.stop)
            server.stop()

    table = Table(title=f"An agent of {calls} calls killed at call {kill_at}")
    for column in (
        "resume",
        "wall s",
        "to call K: 1st, s",
        "again, s",
        "ratio",
        "a call: 1st, ms",
        "again, ms",
        "policy tokens",
        "thrown away",
        "twice",
        "replayed",
    ):
        table.add_column(column, justify="right")
    for run in runs:
        table.add_row(
            run.mode,
            f"{run.wall_seconds:.1f}",
            f"{run.first_to_kill_point:.2f}",
            f"{run.again_to_kill_point:.2f}",
            f"{run.again_to_kill_point / run.first_to_kill_point:.1%}",
            f"{run.first_per_call * 1000:.1f}",
            f"{run.again_per_call * 1000:.1f}",
            str(run.generated_tokens),
            str(run.thrown_away),
            str(run.generated_twice),
            str(run.replayed_calls),
        )
    console.print(table)
    calls_table = Table(title=f"Gateway, {cpu_calls} calls each, one client")
    for column in ("call", "gateway CPU ms/call", "p50 ms"):
        calls_table.add_column(column, justify="right")
    for kind, (cpu_ms, p50) in per_call.items():
        calls_table.add_row(kind, f"{cpu_ms:.2f}", f"{p50:.1f}")
    console.print(calls_table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--cpu-calls", type=int, default=200)
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.kill_at, args.max_tokens, args.cpu_calls))
    # The Temporal SDK's runtime can abort at interpreter exit (sdk-python #300).
    os._exit(0)
