"""Where a captured call's CPU goes inside the gateway: py-spy samples the gateway process while
one client, then 32, send chat completions through it (the `make bench` stack: a real dev
server, a rollout worker, the fast fake upstream), then while one conversation grows to 48k
tokens (`make bench`'s long-context phase), and this prints the top frames by share of the
samples, by their own time and with what they call. Prints figures; asserts nothing.

Read the shares as where the samples fell, not as savings: py-spy does not always tell a wait
from work here, so some of the event loop's polling shows as `Runner.run`'s own time, and an
idle thread pool's wait as `_worker`'s. And a share is not what removing a frame would save:
FastAPI's routing and dependency injection look like a tenth of the gateway's samples, yet
serving the agents' calls past them measured no less CPU per call. Check a cut with
`make bench`. `--gil` samples only the thread holding the GIL: Python's own work, without the
loop's polling or the waits inside socket calls (a long context's loopback send shows as
`StreamWriter._writelines` otherwise).

    make profile-gateway      # or: .venv/bin/python -m bench.gateway_profile [--calls 2000] [--gil]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections import Counter
from collections.abc import Awaitable
from pathlib import Path

from bench.gateway_bench import LongGateway, long_context
from bench.load import (
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
from darl.workflows.contracts import rollout_workflow_id

# "function (path/to/file.py:line)" as py-spy's raw format writes a frame.
FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def frame_name(frame: str) -> str:
    """`function (file)` with the file cut to its last two parts and the line dropped, so a
    function's samples add up whatever line they were on."""
    match = FRAME.match(frame)
    if match is None:
        return frame
    parts = Path(match["file"]).parts
    return f"{match['fn']} ({'/'.join(parts[-2:])})"


# The process's own scaffolding, under every sample: left out of the inclusive table.
SCAFFOLDING = ("<frozen runpy>", "typer/", "_click/", "cli/", "asyncio/runners.py")


def summarize(raw: Path, top: int) -> None:
    """py-spy's collapsed stacks ("a;b;c N" per line) as two tables: own and inclusive share."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [frame_name(f) for f in stack.split(";")]
        total += n
        own[frames[-1]] += n
        for name in set(frames):
            if not any(part in name for part in SCAFFOLDING):
                inclusive[name] += n
    if not total:
        print("  (no samples)")
        return
    for title, counts in (("own time", own), ("inclusive (with what it calls)", inclusive)):
        print(f"  top frames by {title}, share of {total} samples:")
        for name, n in counts.most_common(top):
            print(f"    {n / total:6.1%}  {name}")


async def sampled(
    name: str, pid: int, out: Path, work: Awaitable[object], gil: bool = False
) -> None:
    """Await `work` while py-spy samples the gateway, then print where its CPU went."""
    raw = out / f"{name}.txt"
    spy = await asyncio.create_subprocess_exec(
        shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"),
        "record",
        *(["--gil"] if gil else []),
        "--pid",
        str(pid),
        "--rate",
        "1000",
        "--format",
        "raw",
        "--nonblocking",
        "--output",
        str(raw),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    before = cpu_seconds({"gateway": pid})["gateway"]
    try:
        await work
    finally:
        used = cpu_seconds({"gateway": pid})["gateway"] - before
        spy.send_signal(2)  # SIGINT: py-spy writes its file and exits
        await asyncio.wait_for(spy.wait(), 60)
    print(f"\n{name}: gateway CPU {used:.2f} s (py-spy slows it down)")
    summarize(raw, 25)


async def phase(name: str, targets: list[tuple[str, dict[str, str]]], calls: int) -> None:
    await drive(f"warm-up {name}", targets, len(targets) * 5)
    done = await drive(name, targets, calls)
    print(f"\n{name}: {len(done.latencies)} calls, p50 {done.pct(0.5):.2f} ms, {done.rate:.0f}/s")


async def main(calls: int, top_clients: int, gateway_vars: list[str], gil: bool) -> None:
    root = Path(tempfile.mkdtemp(prefix="darl-profile-"))
    env = await start_dev_server()
    proc_env = process_env(env)
    queue = f"profile-{uuid.uuid4().hex[:6]}"
    upstream = start_fake_upstream(root, proc_env)
    processes = [upstream]
    rollouts: list[str] = []
    try:
        upstream_url = upstream.wait_ready()["url"]
        gateway_env = {**proc_env, **dict(kv.split("=", 1) for kv in gateway_vars)}
        gateway = start_gateway(
            root, gateway_env, "gateway", upstream_url, "--store-dir", str(root / "store")
        )
        processes.append(gateway)
        gateway_url = gateway.wait_ready()["url"]
        worker = start_worker(root, proc_env, gateway_url, queue)
        processes.append(worker)
        worker.wait_ready()
        rollouts = await idle_rollouts(env, queue, top_clients)
        targets = gateway_targets(gateway_url, rollouts)
        print(f"py-spy on the gateway (pid {gateway.pid}), samples in {root}")
        for name, clients, n in (
            ("1 client", 1, calls // 4),
            (f"{top_clients} clients", top_clients, calls),
        ):
            await sampled(name, gateway.pid, root, phase(name, targets[:clients], n), gil)
        [long_rollout] = await idle_rollouts(env, queue, 1)
        rollouts.append(long_rollout)
        store = root / "store" / long_rollout
        grow = long_context(
            upstream_url, [LongGateway("gateway", gateway_url, long_rollout, gateway.pid, store)]
        )
        await sampled("long context", gateway.pid, root, grow, gil)
    finally:
        for rollout_id in rollouts:
            await env.client.get_workflow_handle(rollout_workflow_id(rollout_id)).cancel()
        for process in reversed(processes):
            process.stop()
        stop_leftover_agents(root / "agents")
        await env.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--gateway-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument(
        "--gil", action="store_true", help="sample only the thread holding the GIL (py-spy --gil)"
    )
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.clients, args.gateway_env, args.gil))
    sys.stdout.flush()
    os._exit(0)
