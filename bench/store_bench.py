"""The store comparison of the gateway benchmark: the same load through a gateway on the
directory store and through one on the S3 store, the latter against moto's S3 emulator on
loopback (its own process, so its CPU is counted apart: a real S3 is remote, and its cost is
not the gateway's)."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
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


# Slices of the paced phase, each store's in turn (the order alternating round by round).
PACED_ROUNDS = 4
# The paced rate both stores are compared at under load, as a share of the slower store's
# back-to-back rate: at half, moto's emulator keeps up; at three-quarters it fell behind in
# one run of four, and its calls queued.
MATCHED_SHARE = 0.5


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
    back; then calls paced to MATCHED_SHARE of the slower store's back-to-back rate (when that
    is above `paced_rate`), and to `paced_rate` (a rate both stores sustain here, where
    Temporal's idle work weighs on each call). Temporal's CPU per call follows the call events
    each signal carries, and a store that serves fewer calls a second carries fewer per signal
    (one signal per attempt per interval): the paced rows compare the stores at the same rate,
    the first under load. The paced calls go in PACED_ROUNDS slices a store, the stores
    taking turns, so the machine's drift over the phase falls on both alike; each window lasts
    until its calls' events are signalled, so each store's signals are counted in its own
    windows."""
    names = list(gateways)
    targets = {}
    for name, (url, _) in gateways.items():
        fresh = await idle_rollouts(env, queue, clients)
        rollouts += fresh
        targets[name] = gateway_targets(url, fresh)
        await drive(f"warm-up {name}", targets[name], clients * 5)
    back_to_back = {
        name: await measured(name, gateways[name], others, targets[name], calls, None)
        for name in gateways
    }
    rows = [window.row() for window in back_to_back.values()]
    slower = min(w.phase.rate for w in back_to_back.values())
    matched = MATCHED_SHARE * slower
    # Under load means above the low rate: stores slower than that are compared at the low rate
    # alone.
    paced = [(matched, calls // 2)] if matched > paced_rate else []
    made = []
    for rate, planned in [*paced, (paced_rate, calls // 4)]:
        n = max(clients, planned // PACED_ROUNDS)  # a call a client at least
        joined = await taking_turns(gateways, others, targets, n, rate)
        rows += [window.row() for window in joined.values()]
        made.append(f"{rate:.0f} calls/s in all ({joined[names[0]].calls} calls)")
    print(
        f"\nStores: {clients} clients back to back ({back_to_back[names[0]].calls} calls), then "
        f"paced to {' and to '.join(made)} in {PACED_ROUNDS} slices a store, taking turns "
        f"({MATCHED_SHARE:.0%} of the slower store's back-to-back {slower:.0f} calls/s, when that "
        f"is above {paced_rate:.0f}); one gateway each (CPU ms per call by process; the S3 "
        "emulator is moto on loopback, not S3):"
    )
    columns = ["gateway", *others]
    header = "".join(f"{n + ' CPU':>20}" for n in columns)
    print(f"  {'store':<22}{'calls/s':>9}{'p50 ms':>9}{'p99 ms':>9}{header}{'events/signal':>15}")
    for name, phase, cpu, per_signal in rows:
        figures = "".join(f"{cpu[n]:>20.2f}" for n in columns)
        print(
            f"  {name:<22}{phase.rate:>9.0f}{phase.pct(0.5):>9.2f}{phase.pct(0.99):>9.2f}"
            f"{figures}{per_signal:>15.1f}"
        )


async def taking_turns(
    gateways: dict[str, tuple[str, int]],
    others: dict[str, int],
    targets: dict[str, list[tuple[str, dict[str, str]]]],
    n: int,
    rate: float,
) -> dict[str, Window]:
    """PACED_ROUNDS windows of `n` calls at `rate` a store, the stores taking turns (the
    order alternating round by round), joined into one a store (named "<store> @<rate>/s")."""
    names = list(gateways)
    windows: dict[str, list[Window]] = {name: [] for name in names}
    for round_ in range(PACED_ROUNDS):
        for name in names if round_ % 2 == 0 else names[::-1]:
            label = f"{name} @{rate:.0f}/s"
            windows[name].append(
                await measured(label, gateways[name], others, targets[name], n, rate)
            )
    return {name: Window.joined(store_windows) for name, store_windows in windows.items()}


@dataclass
class Window:
    """One store's calls of a phase: their latencies, the CPU each process spent from their
    start until their events were signalled, and the events and signals that carried them."""

    phase: Phase
    calls: int
    cpu: dict[str, float]
    events: float
    signals: float

    @classmethod
    def joined(cls, windows: list[Window]) -> Window:
        latencies = [x for w in windows for x in w.phase.latencies]
        seconds = sum(w.phase.seconds for w in windows)
        return cls(
            Phase(windows[0].phase.name, latencies, seconds),
            sum(w.calls for w in windows),
            {k: sum(w.cpu[k] for w in windows) for k in windows[0].cpu},
            sum(w.events for w in windows),
            sum(w.signals for w in windows),
        )

    def row(self) -> tuple[str, Phase, dict[str, float], float]:
        per_call = {k: v / self.calls * 1000 for k, v in self.cpu.items()}
        per_signal = self.events / self.signals if self.signals else float("nan")
        return self.phase.name, self.phase, per_call, per_signal


async def measured(
    label: str,
    gateway: tuple[str, int],
    others: dict[str, int],
    targets: list[tuple[str, dict[str, str]]],
    n: int,
    rate: float | None,
) -> Window:
    """`n` calls to `targets` through `gateway` (URL, pid), at `rate` calls/s in all or back
    to back. The window opens with no event of the gateway's left to signal (the phase before
    would ride in this one's signals) and closes when this one's are all signalled."""
    url, pid = gateway
    watched = {"gateway": pid, **others}
    await delivered_all(url)
    before, signals0 = cpu_seconds(watched), delivery(url)
    phase = await drive(label, targets, n, rate)
    await delivered_all(url)
    after, signals1 = cpu_seconds(watched), delivery(url)
    events, signals = (b - a for a, b in zip(signals0, signals1, strict=True))
    cpu = {k: after[k] - before[k] for k in watched}
    return Window(phase, len(phase.latencies), cpu, events, signals)


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
