"""The weight-sync protocol (trainer/policy_control.py) against a real vLLM (CPU build) behind
the real gateway: `keep` freezes a call in flight until the resume, `abort` ends it with its
partial tokens (recorded), a sync restarts vLLM through `darl vllm-server` on a checkpoint the
reference trainer made from calls vLLM answered, and every call records the version it was
admitted under. vLLM's CPU build reloads other weights wrongly in place, so the in-place path
(the one for GPUs) is checked with the weights vLLM already serves."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.testing import WorkflowEnvironment

from darl.gateway.store.record import CallRecord
from darl.trainer.aggregation import AggregationSettings, RolloutSample, aggregate
from darl.trainer.backend import StepOverrides
from darl.trainer.policy_control import (
    GatewayControl,
    PolicyServerSpec,
    VllmPolicyServer,
    WeightSyncError,
    policy_server_control,
    sync_weights,
)
from tests.integration.stack import ADMIN_KEY
from tests.vllm_fixtures import (
    VllmStack,
    assert_group_gone,
    auth,
    caught_in_flight,
    chat_url,
    finish_reasons,
    gateway_state,
    hf_logprobs,
    read_stream,
    running_vllm_stack,
    sent_to_held_engine,
    settled,
    started_held,
    stored,
    streamed_ids,
    until,
    vllm_metric,
)

# The gateway holds new calls and keeps its upstreams: what these syncs test is the load.
HOLD: dict[str, Any] = {"pause_mode": "hold", "register_upstreams": False}

pytestmark = pytest.mark.integration

# vLLM's engine makes these in a few seconds on a CPU; its API server needs ~10 s to send them.
LONG_TOKENS = 4000
LONG_CALL = {
    "model": "policy",
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "max_tokens": LONG_TOKENS,
    "ignore_eos": True,
}
DRAINED_TOKENS = 2000
# An aborted call returns early: it can fill the context, to stay in the engine longest.
ABORTED_CALL = {**LONG_CALL, "max_tokens": 8000}
# Logprobs of vLLM (float32, its own kernels) against transformers on the same checkpoint.
LOGPROB_TOLERANCE = 1e-3
QUESTIONS = ["What is 1 + 1?", "Name a color.", "hi", "Say yes or no."]


@pytest.fixture(scope="module")
def vllm_stack(
    dev_env: WorkflowEnvironment, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmStack]:
    yield from running_vllm_stack(dev_env.client, Path(tmp_path_factory.mktemp("vllm-sync")))


async def ask(
    http: httpx.AsyncClient, stack: VllmStack, rollout_id: str, content: str
) -> httpx.Response:
    body = {"model": "policy", "messages": [{"role": "user", "content": content}], "max_tokens": 12}
    answer = await http.post(
        chat_url(stack, rollout_id), json=body, headers=auth(stack, rollout_id)
    )
    assert answer.status_code == 200, answer.text
    return answer


def max_logprob_gap(record: CallRecord, model_dir: Path) -> float:
    """How far vLLM's logprobs of the call lie from transformers' on `model_dir`."""
    expected = hf_logprobs(model_dir, record.prompt_token_ids, record.completion_token_ids())
    logprobs = record.completion_logprobs() or []
    return max(abs(a - b) for a, b in zip(logprobs, expected, strict=True))


@dataclass
class Frozen:
    paused: dict[str, Any]
    frozen_at: int
    still_at: int
    decoded: float
    decoded_later: float
    running: float
    ended_in_pause: bool
    chunks: list[dict[str, Any]]
    record: CallRecord


async def test_keep_freezes_a_call_in_flight_until_resume(vllm_stack: VllmStack) -> None:
    async def freeze_a_call() -> Frozen | None:
        rollout_id = await vllm_stack.start_idle_rollout("vllm-keep")
        chunks: list[dict[str, Any]] = []
        async with httpx.AsyncClient(timeout=120) as http:
            server = VllmPolicyServer(vllm_stack.policy_url, http)
            reading = await started_held(
                http, vllm_stack, read_stream(http, vllm_stack, rollout_id, LONG_CALL, chunks)
            )
            await server.pause("keep")
            try:
                paused = (await http.get(f"{vllm_stack.policy_url}/is_paused")).json()
                frozen_at = await settled(chunks)  # what was decoded before the pause
                decoded = await vllm_metric(http, vllm_stack, "vllm:generation_tokens_total")
                await asyncio.sleep(2.0)
                still_at = len(streamed_ids(chunks))
                later = await vllm_metric(http, vllm_stack, "vllm:generation_tokens_total")
                running = await vllm_metric(http, vllm_stack, "vllm:num_requests_running")
                ended_in_pause = reading.done()
            finally:
                await server.resume()
            call_id = await asyncio.wait_for(reading, 120)
        await vllm_stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()
        if frozen_at == LONG_TOKENS:
            return None  # it had ended inside vLLM before the pause
        record = stored(vllm_stack, rollout_id, call_id)
        return Frozen(
            paused, frozen_at, still_at, decoded, later, running, ended_in_pause, chunks, record
        )

    frozen = await caught_in_flight(freeze_a_call, "a streamed call")
    assert frozen.paused == {"is_paused": True}
    # Paused, nothing more came and nothing more was decoded; the call stayed in the engine.
    assert frozen.still_at == frozen.frozen_at < LONG_TOKENS and not frozen.ended_in_pause
    assert frozen.decoded_later == frozen.decoded and frozen.running == 1
    # Resumed, it finished whole, and the gateway recorded all of it.
    ids = streamed_ids(frozen.chunks)
    assert len(ids) == LONG_TOKENS and finish_reasons(frozen.chunks) == ["length"]
    assert frozen.record.completion_token_ids() == ids
    assert len(frozen.record.completion_logprobs() or []) == LONG_TOKENS


# A streamed call's try can still miss when vLLM's API server falls behind its engine at once
# (see caught_in_flight): all three tries once missed with a busy loop beside the tests.
# One rerun for that, until a pause can be made to land for certain.
@pytest.mark.flaky(reruns=1)
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
async def test_abort_ends_a_call_in_flight_with_its_partial_tokens(
    vllm_stack: VllmStack, streamed: bool
) -> None:
    async def abort_a_call() -> tuple[str, list[int], CallRecord, Any] | None:
        rollout_id = await vllm_stack.start_idle_rollout("vllm-abort")
        chunks: list[dict[str, Any]] = []
        headers = auth(vllm_stack, rollout_id)
        async with httpx.AsyncClient(timeout=120) as http:
            server = VllmPolicyServer(vllm_stack.policy_url, http)
            call: Coroutine[Any, Any, Any] = (
                read_stream(http, vllm_stack, rollout_id, ABORTED_CALL, chunks)
                if streamed
                else http.post(chat_url(vllm_stack, rollout_id), json=ABORTED_CALL, headers=headers)
            )
            calling = await started_held(http, vllm_stack, call)
            await server.pause("abort")
            try:
                ended = await asyncio.wait_for(calling, 60)
            finally:
                await server.resume()
            after = await ask(http, vllm_stack, rollout_id, "hi")  # vLLM answers again
        handle = vllm_stack.client.get_workflow_handle(f"rollout/{rollout_id}")
        calls = await vllm_stack.wait_for_calls(handle, 2)  # both reached the workflow
        await handle.cancel()
        if streamed:
            call_id, ids, finish = ended, streamed_ids(chunks), finish_reasons(chunks)[0]
            answer = None
        else:
            assert ended.status_code == 200, ended.text
            answer = ended.json()
            choice = answer["choices"][0]
            call_id, ids, finish = (
                ended.headers["x-darl-call-id"],
                choice["token_ids"],
                choice["finish_reason"],
            )
        assert calls == 2 and after.json()["choices"][0]["finish_reason"] == "length"
        if finish == "length" or not ids:
            return None  # it had ended (or not begun) inside vLLM when the pause came
        return finish, ids, stored(vllm_stack, rollout_id, call_id), answer

    finish, ids, record, answer = await caught_in_flight(abort_a_call, "a call")
    assert finish == "abort" and 0 < len(ids) < ABORTED_CALL["max_tokens"]
    assert record.response["choices"][0]["finish_reason"] == "abort"
    assert record.completion_token_ids() == ids
    assert len(record.completion_logprobs() or []) == len(ids)
    if answer is not None:
        # Recorded as vLLM answered; the prompt's ids go back only to an agent that asks.
        assert answer == {**record.response, "prompt_token_ids": None}


async def test_keep_is_refused_before_anything_pauses(vllm_stack: VllmStack) -> None:
    """A server that restarts to load cannot keep calls: the sync says so and pauses nothing."""
    before = vllm_stack.vllm_status()
    async with httpx.AsyncClient(timeout=60) as http:
        spec = PolicyServerSpec(
            kind="vllm", url=vllm_stack.policy_url, launcher_url=vllm_stack.launcher_url
        )
        server = policy_server_control(spec, http)
        assert not server.keeps_inflight_across_load
        gateway = GatewayControl(vllm_stack.gateway_url, ADMIN_KEY, http)
        with pytest.raises(WeightSyncError, match="cannot hold calls across a restart"):
            await sync_weights(gateway, [server], before["model_dir"], 99, "keep", 60, **HOLD)
        assert (await gateway_state(http, vllm_stack))["paused"] is False
        paused = (await http.get(f"{vllm_stack.policy_url}/is_paused")).json()
    assert paused == {"is_paused": False}
    assert vllm_stack.vllm_status() == before


async def test_the_launcher_refuses_a_non_model_and_repeats_nothing(
    vllm_stack: VllmStack, tmp_path: Path
) -> None:
    before = vllm_stack.vllm_status()
    load = f"{vllm_stack.launcher_url}/load_weights"
    async with httpx.AsyncClient(timeout=60) as http:
        refused = await http.post(load, json={"path": str(tmp_path), "version": 5})
        again = await http.post(
            load, json={"path": before["model_dir"], "version": before["version"]}
        )
        server = VllmPolicyServer(vllm_stack.policy_url, http, vllm_stack.launcher_url)
        with pytest.raises(WeightSyncError, match="not a model directory"):
            await server.load_weights(str(tmp_path), 5)
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "not_a_model_dir"
    assert again.status_code == 200 and again.json()["restarted"] is False
    assert vllm_stack.vllm_status() == before  # same process, same weights


async def test_a_keep_sync_in_place_carries_a_call_across_the_reload(
    vllm_stack: VllmStack,
) -> None:
    """The GPU path: `/collective_rpc reload_weights` while a call is frozen; the reset of the
    prefix cache preempts it (it computes its cache again on the loaded weights), it finishes
    whole after the sync and records the version of the weights that finished it (vLLM's
    weight version, read by the gateway after the stream ended), not the one it was admitted
    under."""
    before = vllm_stack.vllm_status()
    weights = before["model_dir"]

    async def sync_across_a_call() -> tuple[CallRecord, list[dict[str, Any]], Any, int] | None:
        rollout_id = await vllm_stack.start_idle_rollout("vllm-inplace")
        chunks: list[dict[str, Any]] = []
        async with httpx.AsyncClient(timeout=120) as http:
            version = (await gateway_state(http, vllm_stack))["policy_version"]
            server = VllmPolicyServer(vllm_stack.policy_url, http)  # no launcher: in place
            gateway = GatewayControl(vllm_stack.gateway_url, ADMIN_KEY, http)
            preempted = await vllm_metric(http, vllm_stack, "vllm:num_preemptions_total")
            reading = await started_held(
                http, vllm_stack, read_stream(http, vllm_stack, rollout_id, LONG_CALL, chunks)
            )
            outcome = await sync_weights(
                gateway, [server], weights, version + 1, "keep", 60, **HOLD
            )
            call_id = await asyncio.wait_for(reading, 120)
            preempted_after = await vllm_metric(http, vllm_stack, "vllm:num_preemptions_total")
            after = await ask(http, vllm_stack, rollout_id, QUESTIONS[0])
            paused = (await http.get(f"{vllm_stack.policy_url}/is_paused")).json()
        await vllm_stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()
        assert outcome.drained is None and paused == {"is_paused": False}
        assert after.headers["x-darl-policy-version"] == str(version + 1)
        if preempted_after == preempted:
            return None  # it had ended inside vLLM before the pause
        assert preempted_after == preempted + 1
        return stored(vllm_stack, rollout_id, call_id), chunks, after, version

    record, chunks, after, version = await caught_in_flight(sync_across_a_call, "a call")
    ids = streamed_ids(chunks)
    assert len(ids) == LONG_TOKENS and finish_reasons(chunks) == ["length"]
    assert record.completion_token_ids() == ids
    assert record.policy_version == version + 1  # admitted before the sync, finished after
    new = stored(vllm_stack, record.rollout_id, after.headers["x-darl-call-id"])
    assert new.policy_version == version + 1
    assert max_logprob_gap(new, Path(weights)) < LOGPROB_TOLERANCE
    assert vllm_stack.vllm_status()["pid"] == before["pid"]  # loaded in place: no restart


async def test_a_sync_restarts_vllm_on_the_trained_checkpoint(vllm_stack: VllmStack) -> None:
    rollout_id = await vllm_stack.start_idle_rollout("vllm-sync")
    before = vllm_stack.vllm_status()
    old_weights = Path(before["model_dir"])
    async with httpx.AsyncClient(timeout=120) as http:
        old_version = (await gateway_state(http, vllm_stack))["policy_version"]
        new_version = old_version + 1
        # Calls on the old weights: vLLM reports those weights' logprobs.
        answers = [await ask(http, vllm_stack, rollout_id, q) for q in QUESTIONS]
        old = [stored(vllm_stack, rollout_id, a.headers["x-darl-call-id"]) for a in answers]
        assert {a.headers["x-darl-policy-version"] for a in answers} == {str(old_version)}
        assert max(max_logprob_gap(r, old_weights) for r in old) < LOGPROB_TOLERANCE

        # The reference trainer takes a step on those calls (vLLM's ids and logprobs).
        samples = [
            RolloutSample(f"{rollout_id}-{i}", "group", float(i % 2), [record])
            for i, record in enumerate(old)
        ]
        batch, _ = aggregate(samples, AggregationSettings(pad_token_id=0))
        step = vllm_stack.backend.latest_step() + 1
        await asyncio.to_thread(vllm_stack.backend.train_step, step, batch, StepOverrides(lr=0.05))
        new_weights = vllm_stack.backend.policy_path(step)

        # A call in flight drains on the old weights; one made during the sync is held.
        server = VllmPolicyServer(vllm_stack.policy_url, http, vllm_stack.launcher_url)
        gateway = GatewayControl(vllm_stack.gateway_url, ADMIN_KEY, http)
        # Held in vLLM's engine until the gateway has paused: it is in flight at the pause.
        draining = await sent_to_held_engine(
            http,
            vllm_stack,
            http.post(
                chat_url(vllm_stack, rollout_id),
                json={**LONG_CALL, "max_tokens": DRAINED_TOKENS},
                headers=auth(vllm_stack, rollout_id),
            ),
        )
        try:
            syncing = asyncio.create_task(
                sync_weights(gateway, [server], str(new_weights), new_version, "drain", 120, **HOLD)
            )

            async def gateway_paused() -> bool:
                return (await gateway_state(http, vllm_stack))["paused"]

            await until(gateway_paused, 30, "the gateway paused")
        finally:
            await server.resume()  # the call drains on the old weights
        held = asyncio.create_task(ask(http, vllm_stack, rollout_id, QUESTIONS[0]))
        outcome = await asyncio.wait_for(syncing, 400)
        drained, held_answer = await asyncio.wait_for(asyncio.gather(draining, held), 60)
        again = [await ask(http, vllm_stack, rollout_id, q) for q in QUESTIONS]
    after = vllm_stack.vllm_status()

    print(f"sync by restart: paused {outcome.paused_seconds:.1f}s")
    assert outcome.drained is True and outcome.paused_seconds > 0
    assert drained.headers["x-darl-policy-version"] == str(old_version)
    assert len(drained.json()["choices"][0]["token_ids"]) == DRAINED_TOKENS
    assert held_answer.headers["x-darl-policy-version"] == str(new_version)
    # vLLM restarted on the new checkpoint, on the same port, and the old one is gone.
    assert after["model_dir"] == str(new_weights) and after["version"] == new_version
    assert after["restarts"] == before["restarts"] + 1
    assert after["url"] == vllm_stack.policy_url and after["pid"] != before["pid"]
    assert_group_gone(before["pid"])
    # The same questions now get the new weights' logprobs, recorded under the new version.
    new = [stored(vllm_stack, rollout_id, a.headers["x-darl-call-id"]) for a in again]
    assert {r.policy_version for r in new} == {new_version}
    assert max(max_logprob_gap(r, new_weights) for r in new) < LOGPROB_TOLERANCE
    assert min(max_logprob_gap(r, old_weights) for r in new) > 10 * LOGPROB_TOLERANCE
    await vllm_stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()


async def test_a_vllm_that_dies_comes_back_on_its_weights_under_their_version(
    vllm_stack: VllmStack,
) -> None:
    """SIGKILL vLLM's whole process group (the launcher stays): the launcher starts it again on
    the checkpoint it had and labels vLLM's weight version with that checkpoint's policy
    version, so the gateway records what the weights are (rule 8). Last in the module: the
    vLLM it leaves is the revived one."""
    rollout_id = await vllm_stack.start_idle_rollout("vllm-revive")
    before = vllm_stack.vllm_status()
    os.killpg(before["pid"], signal.SIGKILL)

    def revived() -> bool:
        now = vllm_stack.vllm_status()
        return now["revivals"] == before["revivals"] + 1 and now["running"] and not now["loading"]

    async with asyncio.timeout(300):
        while not await asyncio.to_thread(revived):
            await asyncio.sleep(0.5)
    after = vllm_stack.vllm_status()
    assert_group_gone(before["pid"])
    assert (after["model_dir"], after["version"]) == (before["model_dir"], before["version"])
    assert after["url"] == vllm_stack.policy_url and after["pid"] != before["pid"]
    async with httpx.AsyncClient(timeout=120) as http:
        label = (await http.get(f"{vllm_stack.policy_url}/weight_info")).json()
        answer = await ask(http, vllm_stack, rollout_id, QUESTIONS[0])
    assert label == {"weight_version": str(before["version"])}
    assert answer.status_code == 200, answer.text
    record = stored(vllm_stack, rollout_id, answer.headers["x-darl-call-id"])
    assert record.policy_version == before["version"]
    assert max_logprob_gap(record, Path(before["model_dir"])) < LOGPROB_TOLERANCE
    await vllm_stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()
