"""The reference policy server, in process over its real HTTP app: vLLM's response fields,
sampling parameters, streaming, vLLM's pause modes and weight reloads."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from darl.serving.generation import SamplingParams, Sequence, TokenStep
from darl.serving.policy_app import create_policy_app
from darl.serving.policy_server import (
    CALL_ID_HEADER,
    UNRESTORED_VERSION,
    VERSION_HEADER,
    PolicyServer,
)
from darl.serving.tiny_model import create_model_dir
from tests.serving import served


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture
async def server(model_dir: Path) -> AsyncIterator[PolicyServer]:
    policy = PolicyServer(model_dir, max_batch=8)
    policy.engine.start()
    yield policy
    await asyncio.to_thread(policy.engine.stop)


@pytest.fixture
async def http(server: PolicyServer, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """The app behind a real uvicorn on 127.0.0.1 (streams must stream)."""
    async with (
        served(create_policy_app(server), tmp_path, "policy") as url,
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        yield client


CHAT = {"messages": [{"role": "user", "content": "What is 3 + 4?"}], "return_token_ids": True}


async def chat(http: httpx.AsyncClient, **fields: object) -> dict:
    response = await http.post("/v1/chat/completions", json={**CHAT, **fields})
    assert response.status_code == 200, response.text
    return response.json()


async def test_chat_answers_carry_vllms_fields(http: httpx.AsyncClient, server: PolicyServer):
    body = await chat(http, max_tokens=8, logprobs=True, top_logprobs=2, seed=1)
    template = server.tokenizer.apply_chat_template(
        CHAT["messages"], tokenize=False, add_generation_prompt=True
    )
    assert (
        body["prompt_token_ids"]
        == server.tokenizer(template, add_special_tokens=False)["input_ids"]
    )
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"] <= 8
    entries = choice["logprobs"]["content"]
    assert len(entries) == len(choice["token_ids"])
    assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == 2 for e in entries)
    assert body["usage"]["prompt_tokens"] == len(body["prompt_token_ids"])


async def test_the_same_seed_gives_the_same_answer(http: httpx.AsyncClient) -> None:
    a, b, c = [await chat(http, max_tokens=12, seed=s) for s in (5, 5, 6)]
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    assert a["choices"][0]["token_ids"] != c["choices"][0]["token_ids"]


async def test_max_tokens_and_stop_strings(http: httpx.AsyncClient) -> None:
    long = await chat(http, max_tokens=40, seed=3, ignore_eos=True)
    assert long["choices"][0]["finish_reason"] == "length"
    assert len(long["choices"][0]["token_ids"]) == 40
    text = long["choices"][0]["message"]["content"]
    stop = text[10:12]
    stopped = await chat(http, max_tokens=40, seed=3, ignore_eos=True, stop=[stop])
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stop not in stopped["choices"][0]["message"]["content"]
    assert text.startswith(stopped["choices"][0]["message"]["content"])


async def test_n_choices_and_greedy(http: httpx.AsyncClient) -> None:
    body = await chat(http, max_tokens=6, n=3, seed=9)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    greedy = [await chat(http, max_tokens=6, temperature=0) for _ in range(2)]
    assert greedy[0]["choices"][0]["token_ids"] == greedy[1]["choices"][0]["token_ids"]


async def test_a_stream_carries_the_same_tokens(http: httpx.AsyncClient) -> None:
    whole = await chat(http, max_tokens=10, seed=11, logprobs=True)
    chunks = []
    async with http.stream(
        "POST",
        "/v1/chat/completions",
        json={
            **CHAT,
            "max_tokens": 10,
            "seed": 11,
            "logprobs": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    assert ids == whole["choices"][0]["token_ids"]
    text = "".join(ch["delta"].get("content", "") for c in chunks for ch in c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    finishing = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert [f["finish_reason"] for f in finishing] == [whole["choices"][0]["finish_reason"]]
    assert chunks[-1]["usage"]["completion_tokens"] == len(ids)


async def test_completions_take_text_or_token_ids(http: httpx.AsyncClient) -> None:
    by_text = (
        await http.post(
            "/v1/completions",
            json={
                "prompt": "abc",
                "max_tokens": 5,
                "seed": 2,
                "logprobs": 1,
                "return_token_ids": True,
            },
        )
    ).json()
    prompt_ids = by_text["choices"][0]["prompt_token_ids"]
    by_ids = (
        await http.post(
            "/v1/completions",
            json={
                "prompt": prompt_ids,
                "max_tokens": 5,
                "seed": 2,
                "return_token_ids": True,
            },
        )
    ).json()
    assert by_ids["choices"][0]["token_ids"] == by_text["choices"][0]["token_ids"]
    assert len(by_text["choices"][0]["logprobs"]["token_logprobs"]) == len(
        by_text["choices"][0]["token_ids"]
    )


async def test_bad_requests_are_400s(http: httpx.AsyncClient) -> None:
    too_long = {**CHAT, "messages": [{"role": "user", "content": "x" * 3000}]}
    for path, body in (
        ("/v1/chat/completions", too_long),
        ("/v1/chat/completions", {"messages": []}),
        ("/v1/completions", {"prompt": [10_000]}),
        ("/v1/chat/completions", {**CHAT, "temperature": -1}),
        ("/v1/chat/completions", {**CHAT, "seed": 2**70}),
        ("/v1/completions", {"prompt": "3+4=", "seed": -(2**63) - 1}),
    ):
        response = await http.post(path, json=body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["code"] == 400


async def test_sampling_at_the_edges_of_what_the_api_takes(http: httpx.AsyncClient) -> None:
    """More alternatives than the vocabulary holds, a temperature too small to divide by, the
    largest seeds: answered, not failed."""
    for fields in (
        {"logprobs": True, "top_logprobs": 20, "max_tokens": 3},
        {"temperature": 1e-30, "max_tokens": 3},
        {"seed": 2**63 - 1, "n": 3, "max_tokens": 3},
        {"seed": -(2**63), "max_tokens": 3},
    ):
        answer = await chat(http, **fields)
        assert answer["choices"][0]["token_ids"], fields


async def test_one_sequences_failure_leaves_the_rest_of_its_batch(server: PolicyServer) -> None:
    """A sequence whose sampling fails ends in an error; the others generated with it in the
    same batch finish as they would have."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    prompt = server.tokenizer("3+4=", add_special_tokens=False)["input_ids"]

    def broken(_: list[int]) -> list[int]:
        raise RuntimeError("this sequence's own failure")

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    sequences = [
        Sequence(index=i, prompt_ids=prompt, params=params, loop=loop, events=events)
        for i in range(3)
    ]
    sequences[1].allowed_tokens = broken
    server.engine.pause("keep")  # all three are admitted as one batch on resume
    for seq in sequences:
        server.engine.submit(seq)
    server.engine.resume()
    ends: dict[int, object] = {}
    async with asyncio.timeout(60):
        while len(ends) < 3:
            index, item = await events.get()
            if not isinstance(item, TokenStep):
                ends[index] = item
    assert ends[0] == ends[2] == "length"
    assert str(ends[1]).startswith("error: RuntimeError")
    assert len(sequences[0].token_ids) == len(sequences[2].token_ids) == 4


async def test_pause_keep_freezes_and_resume_continues(http: httpx.AsyncClient) -> None:
    tokens: list[int] = []

    async def long_stream() -> str:
        async with http.stream(
            "POST",
            "/v1/chat/completions",
            json={
                **CHAT,
                "max_tokens": 300,
                "ignore_eos": True,
                "stream": True,
            },
        ) as response:
            finish = ""
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        tokens.extend(choice.get("token_ids", []))
                        finish = choice.get("finish_reason") or finish
            return finish

    streaming = asyncio.create_task(long_stream())
    async with asyncio.timeout(30):
        while len(tokens) < 5:
            await asyncio.sleep(0.01)
    assert (await http.post("/pause", params={"mode": "keep"})).json()["paused"]
    await asyncio.sleep(0.3)
    frozen = len(tokens)
    await asyncio.sleep(0.5)
    assert len(tokens) == frozen < 300  # no progress while paused
    assert (await http.get("/is_paused")).json() == {"is_paused": True}
    await http.post("/resume")
    assert await asyncio.wait_for(streaming, 60) == "length"
    assert len(tokens) == 300  # the kept sequence finished where it stopped


async def test_pause_abort_ends_sequences_in_flight(http: httpx.AsyncClient) -> None:
    pending = asyncio.create_task(chat(http, max_tokens=1500, ignore_eos=True))
    await asyncio.sleep(0.3)
    await http.post("/pause", params={"mode": "abort"})
    body = await asyncio.wait_for(pending, 30)
    await http.post("/resume")
    assert body["choices"][0]["finish_reason"] == "abort"
    assert 0 < len(body["choices"][0]["token_ids"]) < 1500


async def test_reload_weights_changes_the_policy_and_its_version(
    http: httpx.AsyncClient, server: PolicyServer, tmp_path: Path
) -> None:
    before = await chat(http, max_tokens=8, temperature=0)
    state = {
        k: v.clone() for k, v in server.engine.model.state_dict().items() if k != "lm_head.weight"
    }
    generator = torch.Generator().manual_seed(1)
    state = {k: v + 0.5 * torch.randn(v.shape, generator=generator) for k, v in state.items()}
    save_file(state, tmp_path / "model.safetensors")
    reloaded = await http.post("/reload_weights", json={"path": str(tmp_path), "version": 3})
    assert reloaded.json() == {"policy_version": 3}
    assert (await http.get("/version")).json()["policy_version"] == 3
    after = await chat(http, max_tokens=8, temperature=0)
    assert after["choices"][0]["token_ids"] != before["choices"][0]["token_ids"]
    missing = await http.post("/reload_weights", json={"path": str(tmp_path / "no"), "version": 4})
    assert missing.status_code == 400
    assert (await http.get("/version")).json()["policy_version"] == 3


async def test_pause_wait_answers_once_the_requests_in_flight_finished(
    http: httpx.AsyncClient, server: PolicyServer
) -> None:
    in_flight = asyncio.create_task(chat(http, max_tokens=400, ignore_eos=True))
    await asyncio.sleep(0.2)
    paused = (await http.post("/pause", params={"mode": "wait"})).json()
    assert paused["drained"] is True
    # Generation had finished when the pause answered (the engine is idle); the answer itself
    # may still be on its way to this client, so it is awaited, and must be whole.
    assert server.engine.wait_idle(0)
    assert len((await asyncio.wait_for(in_flight, 5))["choices"][0]["token_ids"]) == 400
    held = asyncio.create_task(chat(http, max_tokens=4))
    await asyncio.sleep(0.3)
    assert not held.done()  # new requests wait for resume
    await http.post("/resume")
    assert (await asyncio.wait_for(held, 30))["choices"][0]["finish_reason"] is not None


async def test_a_client_that_hangs_up_frees_the_engine(
    http: httpx.AsyncClient, server: PolicyServer
) -> None:
    long_call = asyncio.create_task(chat(http, max_tokens=1500, ignore_eos=True))
    await asyncio.sleep(0.3)
    assert not server.engine.wait_idle(0)
    long_call.cancel()  # the client closes its connection
    with contextlib.suppress(asyncio.CancelledError):
        await long_call
    # 1,500 tokens take seconds; a dropped request ends at the next decode step.
    assert await asyncio.to_thread(server.engine.wait_idle, 0.5)


# --- the policy version on answers, the response log, and the state file -------------------


def perturbed_checkpoint(model_dir: Path, out: Path, seed: int) -> dict[str, torch.Tensor]:
    """The model dir's weights, perturbed, saved as a checkpoint dir at `out` (no lm_head:
    tied embeddings); returns the saved tensors."""
    generator = torch.Generator().manual_seed(seed)
    own = load_file(model_dir / "model.safetensors")
    state = {
        k: v + 0.5 * torch.randn(v.shape, generator=generator)
        for k, v in own.items()
        if k != "lm_head.weight"
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, out / "model.safetensors")
    return state


@contextlib.asynccontextmanager
async def serving(policy: PolicyServer, tmp: Path, name: str) -> AsyncIterator[httpx.AsyncClient]:
    """A PolicyServer of the test's own, its engine running, behind a real uvicorn."""
    policy.engine.start()
    try:
        async with (
            served(create_policy_app(policy), tmp, name) as url,
            httpx.AsyncClient(base_url=url, timeout=60) as client,
        ):
            yield client
    finally:
        await asyncio.to_thread(policy.engine.stop)


async def reload(http: httpx.AsyncClient, path: Path, version: int) -> None:
    response = await http.post("/reload_weights", json={"path": str(path), "version": version})
    assert response.json() == {"policy_version": version}, response.text


async def streamed(http: httpx.AsyncClient, path: str, body: dict, **headers: str) -> tuple:
    """Reads a stream to its end; returns (response headers, token ids of choice 0)."""
    ids: list[int] = []
    async with http.stream("POST", path, json={**body, "stream": True}, headers=headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    ids.extend(choice.get("token_ids") or [])
    return r.headers, ids


def same_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> bool:
    state = model.state_dict()
    return all(torch.equal(state[k], v) for k, v in tensors.items())


async def test_every_answer_carries_the_version_of_the_weights_that_made_it(
    http: httpx.AsyncClient, model_dir: Path, tmp_path: Path
) -> None:
    completion = {"prompt": "abc", "max_tokens": 3}
    for version in (0, 4, 9):
        if version:
            perturbed_checkpoint(model_dir, tmp_path / f"v{version}", version)
            await reload(http, tmp_path / f"v{version}", version)
        chat_answer = await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3})
        completion_answer = await http.post("/v1/completions", json=completion)
        assert chat_answer.headers[VERSION_HEADER] == str(version)
        assert completion_answer.headers[VERSION_HEADER] == str(version)
        assert (await http.get("/version")).json()["policy_version"] == version


async def test_a_streamed_answer_carries_the_policy_version(
    http: httpx.AsyncClient, model_dir: Path, tmp_path: Path
) -> None:
    headers, ids = await streamed(http, "/v1/chat/completions", {**CHAT, "max_tokens": 4})
    assert headers[VERSION_HEADER] == "0" and ids
    perturbed_checkpoint(model_dir, tmp_path / "v2", 2)
    await reload(http, tmp_path / "v2", 2)
    headers, _ = await streamed(http, "/v1/completions", {"prompt": "abc", "max_tokens": 4})
    assert headers[VERSION_HEADER] == "2"


async def test_the_response_log_names_each_call_and_the_version_that_answered_it(
    model_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "responses.jsonl"
    policy = PolicyServer(model_dir, max_batch=8, response_log=log)
    async with serving(policy, tmp_path, "policy") as http:
        first = await http.post(
            "/v1/chat/completions",
            json={**CHAT, "max_tokens": 4},
            headers={CALL_ID_HEADER: "call-1"},
        )
        perturbed_checkpoint(model_dir, tmp_path / "v5", 5)
        await reload(http, tmp_path / "v5", 5)
        _, streamed_ids = await streamed(
            http,
            "/v1/completions",
            {"prompt": "abc", "max_tokens": 4, "return_token_ids": True},
            **{CALL_ID_HEADER: "call-2"},
        )
        anonymous = await http.post(
            "/v1/completions", json={"prompt": "abc", "max_tokens": 2, "return_token_ids": True}
        )
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(x["call_id"], x["policy_version"], x["endpoint"]) for x in lines] == [
        ("call-1", 0, "chat"),
        ("call-2", 5, "completion"),
        (None, 5, "completion"),
    ]
    assert lines[0]["token_ids"] == [first.json()["choices"][0]["token_ids"]]
    assert lines[0]["prompt_token_ids"] == first.json()["prompt_token_ids"]
    assert lines[1]["token_ids"] == [streamed_ids]
    assert lines[2]["token_ids"] == [anonymous.json()["choices"][0]["token_ids"]]


async def test_a_restarted_server_serves_the_weights_and_version_its_state_file_records(
    model_dir: Path, tmp_path: Path
) -> None:
    state_file = tmp_path / "state" / "policy.json"
    first = PolicyServer(model_dir, max_batch=8, state_file=state_file)
    perturbed_checkpoint(model_dir, tmp_path / "v6", 6)
    v7 = perturbed_checkpoint(model_dir, tmp_path / "v7", 7)
    async with serving(first, tmp_path, "first") as http:
        await reload(http, tmp_path / "v6", 6)
        assert json.loads(state_file.read_text()) == {
            "path": str((tmp_path / "v6").resolve()),
            "version": 6,
        }
        await reload(http, tmp_path / "v7", 7)
        before = await chat(http, max_tokens=8, temperature=0)
    assert json.loads(state_file.read_text()) == {
        "path": str((tmp_path / "v7").resolve()),
        "version": 7,
    }

    second = PolicyServer(model_dir, max_batch=8, state_file=state_file)
    assert second.policy_version == 7
    assert same_weights(second.engine.model, v7)
    assert not same_weights(second.engine.model, load_file(model_dir / "model.safetensors"))
    async with serving(second, tmp_path, "second") as http:
        assert (await http.get("/version")).json()["policy_version"] == 7
        answer = await http.post(
            "/v1/chat/completions", json={**CHAT, "max_tokens": 8, "temperature": 0}
        )
    assert answer.headers[VERSION_HEADER] == "7"
    assert answer.json()["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]


def unfit_checkpoint(model_dir: Path, path: Path, how: str) -> None:
    """A checkpoint at `path` that cannot be loaded: `deleted` (nothing there), `misfit` (no
    tensor of the model), `partial` (the model's tensors, changed, and one more), `corrupt`
    (a torn safetensors file)."""
    if how == "deleted":
        return
    path.mkdir()
    if how == "misfit":
        save_file({"not.a.layer": torch.zeros(2)}, path / "model.safetensors")
    elif how == "partial":
        own = load_file(model_dir / "model.safetensors")
        save_file(
            {**{k: v + 1.0 for k, v in own.items()}, "extra.weight": torch.zeros(1)},
            path / "model.safetensors",
        )
    else:
        (path / "model.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0" + b'{"a":')


@pytest.mark.parametrize(
    "checkpoint",
    ["deleted", "misfit", "partial", "corrupt"],
)
async def test_a_state_file_naming_an_unloadable_checkpoint_starts_unrestored(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, checkpoint: str
) -> None:
    path = tmp_path / "ckpt"
    unfit_checkpoint(model_dir, path, checkpoint)
    state_file = tmp_path / "policy.json"
    state_file.write_text(json.dumps({"path": str(path), "version": 9}))
    with caplog.at_level(logging.ERROR, logger="darl.serving.policy_server"):
        policy = PolicyServer(model_dir, max_batch=8, state_file=state_file)
    assert policy.policy_version == UNRESTORED_VERSION == -1
    (error,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "cannot restore version 9" in error.getMessage()
    assert str(path) in error.getMessage()
    assert same_weights(policy.engine.model, load_file(model_dir / "model.safetensors"))
    perturbed_checkpoint(model_dir, tmp_path / "v10", 10)
    async with serving(policy, tmp_path, "policy") as http:
        unrestored = await http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
        assert unrestored.headers[VERSION_HEADER] == "-1"
        await reload(http, tmp_path / "v10", 10)  # the next weight sync loads the run's weights
    assert json.loads(state_file.read_text())["version"] == 10


async def test_a_reload_that_does_not_fit_changes_neither_the_weights_nor_the_version(
    http: httpx.AsyncClient, server: PolicyServer, model_dir: Path, tmp_path: Path
) -> None:
    unfit_checkpoint(model_dir, tmp_path / "partial", "partial")
    refused = await http.post(
        "/reload_weights", json={"path": str(tmp_path / "partial"), "version": 3}
    )
    assert (await http.get("/version")).json()["policy_version"] == 0
    assert same_weights(server.engine.model, load_file(model_dir / "model.safetensors"))
    assert refused.status_code == 400


async def test_its_address_answers_an_index_and_detokenize_its_tokenizer(
    http: httpx.AsyncClient, server: PolicyServer
) -> None:
    index = (await http.get("/")).json()
    assert index["name"] == "DARL reference policy server" and index["model"] == server.model_name
    assert index["routes"]["chat completions"] == "/v1/chat/completions"
    assert (await http.get(index["docs"])).status_code == 200
    ids = (await http.post("/tokenize", json={"prompt": "hello there"})).json()["tokens"]
    text = await http.post("/detokenize", json={"tokens": ids})
    assert text.json() == {"prompt": "hello there"}
    refused = await http.post("/detokenize", json={"tokens": [10**6]})
    assert refused.status_code == 400
    assert "token ids must lie in" in refused.json()["error"]["message"]
