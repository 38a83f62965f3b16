"""The vLLM launcher's bookkeeping without a vLLM (starting one takes 30 s and more; the
integration tests start real ones): every load is recorded in its state file and read back,
and its watch starts a server that died again on the weights and version it had, leaves a
running one alone, and never restarts one while a load is changing it. The server is a fake
with the parts of VllmServerProcess the launcher uses; the model directories are real."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from darl.serving.vllm_server import (
    VllmLauncher,
    VllmServerError,
    check_model_dir,
    read_launcher_state,
)

WAIT = 5.0
INTERVAL = 0.01


def model_dir(path: Path) -> Path:
    """A directory `check_model_dir` accepts (vLLM would read these files; no one does here)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return path


class FakeVllmServer:
    """A fake VllmServerProcess: `restart` stops it (no longer running), waits for `gate` if
    one is set, fails while `failures` are left, and otherwise runs again on the new weights.
    `alive = False` is a vLLM that died on its own."""

    def __init__(self, model: Path, version: int = 0) -> None:
        self.model_dir = check_model_dir(model)
        self.version = version
        self.port = 8123
        self.pid: int | None = 4242
        self.alive = True
        self.restarts: list[tuple[Path, int]] = []
        self.running_calls = 0
        self.gate: asyncio.Event | None = None
        self.failures = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def running(self) -> bool:
        self.running_calls += 1
        return self.alive

    async def restart(self, model: Path, version: int) -> str:
        self.model_dir = check_model_dir(model)
        self.version = version
        self.alive = False
        self.restarts.append((self.model_dir, version))
        if self.gate is not None:
            await self.gate.wait()
        if self.failures:
            self.failures -= 1
            raise VllmServerError("vLLM exited (1) before it was ready:\nout of memory")
        self.alive = True
        self.pid = (self.pid or 0) + 1
        return self.url

    def log_tail(self, size: int = 4000) -> str:
        return "INFO started\nERROR EngineCore died unexpectedly\n"[-size:]


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT):
        while not condition():
            await asyncio.sleep(INTERVAL)


@contextlib.asynccontextmanager
async def watching(launcher: VllmLauncher) -> AsyncIterator[None]:
    task = asyncio.create_task(launcher.watch(interval=INTERVAL))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT)


async def test_every_load_is_recorded_in_the_state_file_and_read_back(tmp_path: Path) -> None:
    state_file = tmp_path / "state" / "vllm-server.json"
    server = FakeVllmServer(model_dir(tmp_path / "base"))
    launcher = VllmLauncher(server, state_file)  # type: ignore[arg-type]
    assert read_launcher_state(state_file) is None
    step3 = model_dir(tmp_path / "step-3")
    loaded = await launcher.load_weights(step3, 3)
    assert loaded["restarted"] and loaded["version"] == 3
    assert read_launcher_state(state_file) == (step3.resolve(), 3)
    again = await launcher.load_weights(step3, 3)  # the same load again is a no-op
    assert not again["restarted"]
    step4 = model_dir(tmp_path / "step-4")
    await launcher.load_weights(step4, 4)
    assert read_launcher_state(state_file) == (step4.resolve(), 4)
    assert server.restarts == [(step3.resolve(), 3), (step4.resolve(), 4)]
    assert launcher.restarts == 2


async def test_a_load_that_fails_is_not_recorded(tmp_path: Path) -> None:
    state_file = tmp_path / "vllm-server.json"
    server = FakeVllmServer(model_dir(tmp_path / "base"))
    launcher = VllmLauncher(server, state_file)  # type: ignore[arg-type]
    step3 = model_dir(tmp_path / "step-3")
    await launcher.load_weights(step3, 3)
    server.failures = 1
    with pytest.raises(VllmServerError, match="out of memory"):
        await launcher.load_weights(model_dir(tmp_path / "step-4"), 4)
    assert read_launcher_state(state_file) == (step3.resolve(), 3)
    assert not launcher.loading


async def test_watch_starts_a_dead_server_again_on_the_weights_it_had(tmp_path: Path) -> None:
    state_file = tmp_path / "vllm-server.json"
    server = FakeVllmServer(model_dir(tmp_path / "base"))
    launcher = VllmLauncher(server, state_file)  # type: ignore[arg-type]
    step3 = model_dir(tmp_path / "step-3")
    await launcher.load_weights(step3, 3)
    async with watching(launcher):
        server.alive = False  # vLLM died on its own
        await until(lambda: launcher.revivals == 1)
        await asyncio.sleep(10 * INTERVAL)  # and only once
    assert server.restarts == [(step3.resolve(), 3), (step3.resolve(), 3)]
    assert server.running() and launcher.status()["revivals"] == 1
    assert launcher.restarts == 1  # a revival is not a load
    assert read_launcher_state(state_file) == (step3.resolve(), 3)


async def test_watch_leaves_a_running_server_alone(tmp_path: Path) -> None:
    server = FakeVllmServer(model_dir(tmp_path / "base"), version=2)
    launcher = VllmLauncher(server)  # type: ignore[arg-type]
    async with watching(launcher):
        await until(lambda: server.running_calls >= 10)  # it looked, ten times
    assert server.restarts == []
    assert launcher.revivals == 0


async def test_watch_tries_again_after_a_revival_that_failed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    base = model_dir(tmp_path / "base")
    server = FakeVllmServer(base, version=2)
    launcher = VllmLauncher(server)  # type: ignore[arg-type]
    server.failures = 1
    with caplog.at_level(logging.ERROR, logger="darl.serving.vllm_server"):
        async with watching(launcher):
            server.alive = False
            await until(lambda: launcher.revivals == 1)
    assert server.restarts == [(base.resolve(), 2), (base.resolve(), 2)]
    assert any("did not come back" in r.getMessage() for r in caplog.records)
    assert not launcher.loading


async def test_watch_does_not_restart_a_server_while_a_load_changes_it(tmp_path: Path) -> None:
    server = FakeVllmServer(model_dir(tmp_path / "base"))
    launcher = VllmLauncher(server)  # type: ignore[arg-type]
    server.gate = asyncio.Event()
    step5 = model_dir(tmp_path / "step-5")
    async with watching(launcher):
        loading = asyncio.create_task(launcher.load_weights(step5, 5))
        await until(lambda: len(server.restarts) == 1)  # stopped, not yet running again
        assert not server.alive and launcher.loading
        await asyncio.sleep(30 * INTERVAL)  # thirty watch intervals
        assert len(server.restarts) == 1
        looked = server.running_calls
        server.gate.set()
        assert (await asyncio.wait_for(loading, WAIT))["restarted"]
        await until(lambda: server.running_calls > looked + 3)  # watch looks again
    assert server.restarts == [(step5.resolve(), 5)]
    assert launcher.revivals == 0 and launcher.restarts == 1
