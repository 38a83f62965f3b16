"""The store comparison of the gateway benchmark: the same load through a gateway on the
directory store and through one on the S3 store, the latter against moto's S3 emulator on
loopback (its own process, so its CPU is counted apart: a real S3 is remote, and its cost is
not the gateway's)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
from temporalio.testing import WorkflowEnvironment

from bench.load import (
    ADMIN,
    Phase,
    cpu_seconds,
    drive,
    gateway_targets,
    idle_rollouts,
    scrape,
    start_gateway,
)
from darl.deploy.processes import ManagedProcess

ROOT = Path(__file__).resolve().parents[1]
EMULATOR_ENV = {
    "AWS_ACCESS_KEY_ID": "emulator",
    "AWS_SECRET_ACCESS_KEY": "emulator",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def start_s3_gateway(
    root: Path, proc_env: dict[str, str], upstream_url: str, processes: list[ManagedProcess]
) -> tuple[ManagedProcess, ManagedProcess, str]:
    """The emulator and a gateway on `s3://<its bucket>/bench`: (emulator, gateway, url)."""
    ready = root / "s3-emulator.json"
    emulator = ManagedProcess(
        "s3-emulator",
        [sys.executable, "-m", "bench.s3_emulator", "--ready-file", str(ready)],
        root / "s3-emulator.log",
        env=proc_env,
        ready_file=ready,
        cwd=ROOT,
    ).start()
    processes.append(emulator)
    info = emulator.wait_ready()
    gateway = start_gateway(
        root,
        {**proc_env, **EMULATOR_ENV, "AWS_ENDPOINT_URL": info["url"]},
        "gateway-s3",
        upstream_url,
        "--store-url",
        f"s3://{info['bucket']}/bench",
        "--instance",
        "gateway-s3",
    )
    processes.append(gateway)
    return emulator, gateway, gateway.wait_ready()["url"]


async def compare_stores(
    env: WorkflowEnvironment,
    queue: str,
    gateways: dict[str, tuple[str, int]],
    others: dict[str, int],
    calls: int,
    clients: int,
    rollouts: list[str],
    paced_rate: float = 60.0,
) -> None:
    """`gateways`: store name -> (gateway URL, gateway pid); `others`: processes whose CPU is
    reported beside (the emulator, Temporal). Each store gets fresh idle rollouts (appended to
    `rollouts`, for the caller to cancel), a warm-up, then `calls` calls from `clients` back to
    back, then calls paced to `paced_rate` in all (a rate both stores sustain here): Temporal's
    CPU per call follows the call events each signal carries, and a store that serves fewer
    calls a second carries fewer per signal (one signal per attempt per interval)."""
    rows: list[tuple[str, Phase, dict[str, float], float]] = []
    for name, (url, pid) in gateways.items():
        fresh = await idle_rollouts(env, queue, clients)
        rollouts += fresh
        targets = gateway_targets(url, fresh)
        await drive(f"warm-up {name}", targets, clients * 5)
        watched = {"gateway": pid, **others}
        for label, rate, n in (
            (name, None, calls),
            (f"{name} @{paced_rate:g}/s", paced_rate, calls // 4),
        ):
            # The phase before's events still queued would ride in this phase's signals: the
            # paced phase would carry the saturated one's batches, more of them for the store
            # that served more calls a second.
            await delivered_all(url)
            before, signals0 = cpu_seconds(watched), delivery(url)
            phase = await drive(label, targets, n, rate)
            after, signals1 = cpu_seconds(watched), delivery(url)
            per_call = {k: (after[k] - before[k]) / n * 1000 for k in watched}
            events, signals = (b - a for a, b in zip(signals0, signals1, strict=True))
            rows.append((label, phase, per_call, events / signals if signals else float("nan")))
    names = ["gateway", *others]
    print(
        f"\nStores: {clients} clients back to back ({calls} calls), then paced to {paced_rate:g} "
        f"calls/s in all ({calls // 4} calls), one gateway each (CPU ms per call by process; "
        "the S3 emulator is moto on loopback, not S3):"
    )
    header = "".join(f"{n + ' CPU':>20}" for n in names)
    print(f"  {'store':<22}{'calls/s':>9}{'p50 ms':>9}{'p99 ms':>9}{header}{'events/signal':>15}")
    for name, phase, cpu, per_signal in rows:
        figures = "".join(f"{cpu[n]:>20.2f}" for n in names)
        print(
            f"  {name:<22}{phase.rate:>9.0f}{phase.pct(0.5):>9.2f}{phase.pct(0.99):>9.2f}"
            f"{figures}{per_signal:>15.1f}"
        )


async def delivered_all(gateway_url: str, timeout: float = 30.0) -> None:
    """Wait until the gateway holds no call event it has yet to signal (`/admin/state`)."""
    async with httpx.AsyncClient(
        base_url=gateway_url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10
    ) as admin:
        async with asyncio.timeout(timeout):
            while (await admin.get("/admin/state")).json()["undelivered_events"]:
                await asyncio.sleep(0.1)


def delivery(gateway_url: str) -> tuple[float, float]:
    """(call events delivered, signals sent) so far, from the gateway's metrics."""
    metrics = scrape(httpx.get(f"{gateway_url}/metrics").text)
    return (
        metrics.get("darl_gateway_delivered_events_total", 0.0),
        metrics.get("darl_gateway_delivery_signals_total", 0.0),
    )
