"""The vLLM pieces that need no vLLM: a server that cannot start fails fast with its log and
leaves no process, the launcher refuses what vLLM could not serve, policy server specs make
the right control, and `keep` is refused before anything pauses when a server restarts."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from darl.serving.vllm_server import (
    ModelDirError,
    VllmLauncher,
    VllmServerError,
    VllmServerProcess,
    VllmSettings,
    check_model_dir,
    create_launcher_app,
)
from darl.trainer.policy_control import (
    GatewayControl,
    PolicyServerSpec,
    ReferencePolicyServer,
    VllmPolicyServer,
    WeightSyncError,
    policy_server_control,
    sync_weights,
)
from tests.vllm_fixtures import assert_group_gone

# The gateway holds new calls and keeps its upstreams: what these syncs test is the load.
HOLD: dict[str, Any] = {"pause_mode": "hold", "register_upstreams": False}


def model_dir(path: Path, *tensor_files: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    for name in tensor_files:
        (path / name).write_bytes(b"")
    return path


async def test_a_server_that_cannot_start_fails_fast_with_its_log(tmp_path: Path) -> None:
    # DARL's own python has no vllm module: the server dies at once.
    settings = VllmSettings(python=Path(sys.executable), startup_timeout_seconds=60)
    server = VllmServerProcess(
        model_dir(tmp_path / "m", "model.safetensors"), tmp_path / "log", settings
    )
    server.start()
    pid = server.pid
    started = time.monotonic()
    with pytest.raises(VllmServerError, match="No module named 'vllm'"):
        await server.wait_ready()
    assert time.monotonic() - started < 30
    server.stop()
    assert pid is not None
    assert_group_gone(pid, within=5)


def test_a_missing_vllm_venv_says_how_to_make_it(tmp_path: Path) -> None:
    settings = VllmSettings(python=tmp_path / "no-python")
    server = VllmServerProcess(
        model_dir(tmp_path / "m", "model.safetensors"), tmp_path / "log", settings
    )
    with pytest.raises(VllmServerError, match="make vllm"):
        server.start()


def test_a_server_argv_binds_loopback_and_keeps_its_name(tmp_path: Path) -> None:
    server = VllmServerProcess(
        model_dir(tmp_path / "m", "model.safetensors"), tmp_path / "log", port=8123
    )
    argv = server.argv()
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--port") + 1] == "8123"
    assert argv[argv.index("--served-model-name") + 1] == "darl-tiny"
    assert server.env()["VLLM_SERVER_DEV_MODE"] == "1"


def test_model_dirs_vllm_could_not_serve_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match="not a model directory"):
        check_model_dir(tmp_path)
    trained = model_dir(tmp_path / "step", "model.safetensors", "optimizer.safetensors")
    with pytest.raises(ModelDirError, match=r"optimizer\.safetensors"):
        check_model_dir(trained)
    (trained / "model.safetensors.index.json").write_text("{}")  # vLLM reads only the index's
    assert check_model_dir(trained) == trained.resolve()
    sharded = model_dir(tmp_path / "sharded", "model-00001-of-00002.safetensors")
    assert check_model_dir(sharded) == sharded.resolve()


async def test_the_launcher_answers_400_for_a_path_that_is_no_model(tmp_path: Path) -> None:
    server = VllmServerProcess(model_dir(tmp_path / "m", "model.safetensors"), tmp_path / "log")
    app = create_launcher_app(VllmLauncher(server))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://launcher") as client:
        refused = await client.post("/load_weights", json={"path": str(tmp_path), "version": 1})
        malformed = await client.post("/load_weights", json={"path": str(tmp_path)})
        status = (await client.get("/status")).json()
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "not_a_model_dir"
    assert malformed.status_code == 422
    assert status["running"] is False and status["version"] == 0 and status["restarts"] == 0


async def test_specs_make_the_right_control() -> None:
    async with httpx.AsyncClient() as http:
        reference = policy_server_control(PolicyServerSpec(url="http://r/"), http)
        in_place = policy_server_control(PolicyServerSpec(kind="vllm", url="http://v"), http)
        restarting = policy_server_control(
            PolicyServerSpec(kind="vllm", url="http://v", launcher_url="http://l/"), http
        )
        with pytest.raises(WeightSyncError, match="no launcher"):
            policy_server_control(PolicyServerSpec(url="http://r", launcher_url="http://l"), http)
    assert isinstance(reference, ReferencePolicyServer) and reference.url == "http://r"
    assert isinstance(in_place, VllmPolicyServer) and in_place.keeps_inflight_across_load
    assert isinstance(restarting, VllmPolicyServer)
    assert restarting.launcher_url == "http://l" and not restarting.keeps_inflight_across_load


async def test_keep_with_a_restarting_server_pauses_nothing() -> None:
    calls: list[str] = []

    def record(request: httpx.Request) -> httpx.Response:
        calls.append(f"{request.method} {request.url.path}")
        return httpx.Response(200, json={})

    async with httpx.AsyncClient(transport=httpx.MockTransport(record)) as http:
        gateway = GatewayControl("http://gateway", "key", http)
        servers: list[Any] = [
            ReferencePolicyServer("http://r", http),
            VllmPolicyServer("http://v", http, launcher_url="http://l"),
        ]
        with pytest.raises(WeightSyncError, match=r"\['http://v'\] restart"):
            await sync_weights(gateway, servers, "/ckpt", 3, "keep", 10, **HOLD)
        await sync_weights(gateway, servers, "/ckpt", 3, "drain", 10, **HOLD)
    assert calls == [
        "POST /admin/pause",
        "POST /reload_weights",
        "POST /load_weights",
        "POST /admin/resume",
    ]
