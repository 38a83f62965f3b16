"""Bad input to the gateway gets a clear 4xx with a JSON error body, never a 5xx, never a call
to the policy server, and loses nothing: the rollout it aimed at still completes."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from darl.workflows.contracts import (
    REPORT_MAX_BYTES,
    REPORTS_PER_ATTEMPT,
    AgentReport,
    LocalAgentSpec,
    RolloutSpec,
    rollout_workflow_id,
)
from darl.workflows.names import ROLLOUT_WORKFLOW
from darl.workflows.rollout_status import RolloutStatus
from tests.integration.stack import ADMIN_KEY, Stack

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.gateway_url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
async def live_rollout(stack: Stack) -> str:
    return await stack.start_idle_rollout("bad-input")


def chat_url(rollout_id: str) -> str:
    return f"/rollouts/{rollout_id}/v1/chat/completions"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def assert_refused(response: httpx.Response, status: int, words: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert words in body["error"]["message"], body


@pytest.fixture
def no_upstream_call(stack: Stack) -> Iterator[None]:
    before = len(stack.policy_responses())
    metrics_before = httpx.get(f"{stack.policy_url}/metrics").text
    yield
    assert len(stack.policy_responses()) == before
    assert httpx.get(f"{stack.policy_url}/metrics").text == metrics_before


@pytest.mark.usefixtures("no_upstream_call")
class TestRefusedBeforeThePolicyServer:
    def test_malformed_json(self, stack: Stack, http: httpx.Client, live_rollout: str) -> None:
        response = http.post(
            chat_url(live_rollout),
            content=b'{"messages": [',
            headers={**bearer(stack.token(live_rollout)), "content-type": "application/json"},
        )
        assert_refused(response, 400, "not valid JSON")

    def test_json_that_is_not_an_object(
        self, stack: Stack, http: httpx.Client, live_rollout: str
    ) -> None:
        response = http.post(
            chat_url(live_rollout), json=[1, 2], headers=bearer(stack.token(live_rollout))
        )
        assert_refused(response, 400, "JSON object")

    def test_missing_messages(self, stack: Stack, http: httpx.Client, live_rollout: str) -> None:
        response = http.post(
            chat_url(live_rollout), json={"model": "m"}, headers=bearer(stack.token(live_rollout))
        )
        assert_refused(response, 400, "messages")

    def test_batched_completion_prompts(
        self, stack: Stack, http: httpx.Client, live_rollout: str
    ) -> None:
        response = http.post(
            f"/rollouts/{live_rollout}/v1/completions",
            json={"model": "m", "prompt": ["a", "b"]},
            headers=bearer(stack.token(live_rollout)),
        )
        assert_refused(response, 400, "prompt")

    @pytest.mark.parametrize(
        ("field", "value", "words"),
        [
            ("seed", 2**70, "seed must be at least -9223372036854775808"),
            ("seed", True, "seed must be an integer"),
            ("temperature", -0.5, "temperature must be at least 0"),
            ("top_p", 0, "top_p must be over 0 and at most 1"),
            ("top_k", -7, "top_k must be at least -1"),
            ("max_tokens", 0, "max_tokens must be at least 1"),
            ("top_logprobs", 21, "top_logprobs must be at least 0 and at most 20"),
            ("logprobs", 3, "logprobs must be true or false"),
            ("presence_penalty", "a lot", "presence_penalty must be a finite number"),
        ],
    )
    def test_sampling_parameters_no_policy_server_takes(
        self,
        stack: Stack,
        http: httpx.Client,
        live_rollout: str,
        field: str,
        value: object,
        words: str,
    ) -> None:
        """The agent's error (400, naming the field), never a policy server's failure: a
        crash there would be DARL's incident, and the attempt would not count."""
        response = http.post(
            chat_url(live_rollout),
            json={**CHAT, field: value},
            headers=bearer(stack.token(live_rollout)),
        )
        assert_refused(response, 400, words)
        assert response.json()["error"]["param"] == field

    def test_missing_token(self, http: httpx.Client, live_rollout: str) -> None:
        assert_refused(http.post(chat_url(live_rollout), json=CHAT), 401, "missing rollout token")

    def test_forged_token(self, stack: Stack, http: httpx.Client, live_rollout: str) -> None:
        forged = stack.token(live_rollout, secret="not-the-secret")
        assert_refused(
            http.post(chat_url(live_rollout), json=CHAT, headers=bearer(forged)), 401, "signature"
        )

    def test_garbage_token(self, http: httpx.Client, live_rollout: str) -> None:
        assert_refused(
            http.post(chat_url(live_rollout), json=CHAT, headers=bearer("sk-1234")),
            401,
            "malformed",
        )

    def test_expired_token(self, stack: Stack, http: httpx.Client, live_rollout: str) -> None:
        expired = stack.token(live_rollout, ttl=-1)
        assert_refused(
            http.post(chat_url(live_rollout), json=CHAT, headers=bearer(expired)), 401, "expired"
        )

    def test_another_rollouts_token(
        self, stack: Stack, http: httpx.Client, live_rollout: str
    ) -> None:
        other = stack.token("some-other-rollout")
        assert_refused(
            http.post(chat_url(live_rollout), json=CHAT, headers=bearer(other)),
            403,
            "another rollout",
        )

    def test_another_attempts_token_on_agent_lightning_routes(
        self, stack: Stack, http: httpx.Client, live_rollout: str
    ) -> None:
        url = f"/proxy/rollout/{live_rollout}/attempt/2/mode/train/openai/v1/chat/completions"
        assert_refused(
            http.post(url, json=CHAT, headers=bearer(stack.token(live_rollout))),
            403,
            "another attempt",
        )

    def test_oversized_body(self, stack: Stack, http: httpx.Client, live_rollout: str) -> None:
        huge = {**CHAT, "messages": [{"role": "user", "content": "x" * (9 * 1024 * 1024)}]}
        response = http.post(
            chat_url(live_rollout), json=huge, headers=bearer(stack.token(live_rollout))
        )
        assert_refused(response, 413, "over")

    def test_unknown_rollout(self, stack: Stack, http: httpx.Client) -> None:
        ghost = f"ghost-{uuid.uuid4().hex[:8]}"
        assert_refused(
            http.post(chat_url(ghost), json=CHAT, headers=bearer(stack.token(ghost))),
            404,
            "unknown rollout",
        )

    def test_rollout_id_that_cannot_exist(self, stack: Stack, http: httpx.Client) -> None:
        bad = "..%2F..%2Fetc"
        assert (
            http.post(chat_url(bad), json=CHAT, headers=bearer(stack.token(bad))).status_code == 404
        )

    async def test_finished_rollout(self, stack: Stack, http: httpx.Client) -> None:
        spec = RolloutSpec(
            run_id="bad-input",
            rollout_id=f"done-{uuid.uuid4().hex[:8]}",
            task={},
            agent=LocalAgentSpec(command=["true"]),
        )
        await (await stack.start_rollout(spec)).result()
        token = stack.token(spec.rollout_id)
        for body in (CHAT, {**CHAT, "stream": True}):
            response = http.post(chat_url(spec.rollout_id), json=body, headers=bearer(token))
            assert_refused(response, 409, "has ended")
            assert response.json()["error"]["code"] == "rollout_finished"
        assert_refused(
            http.post(
                f"/rollouts/{spec.rollout_id}/result", json={"reward": 1.0}, headers=bearer(token)
            ),
            409,
            "has ended",
        )

    async def test_a_rollout_whose_agent_could_not_start(
        self, stack: Stack, http: httpx.Client
    ) -> None:
        """The worker opened the attempt at the gateway, then could not start its agent: it
        closes the attempt there, so its calls are refused."""
        spec = RolloutSpec(
            run_id="bad-input",
            rollout_id=f"never-{uuid.uuid4().hex[:8]}",
            task={},
            agent=LocalAgentSpec(command=["no-such-agent-binary"]),
        )
        result = await (await stack.start_rollout(spec)).result()
        assert result.status == RolloutStatus.FAILED_AGENT
        response = http.post(
            chat_url(spec.rollout_id), json=CHAT, headers=bearer(stack.token(spec.rollout_id))
        )
        assert_refused(response, 409, "attempt 1 of rollout")

    async def test_finished_rollout_the_gateway_never_heard_of(
        self, stack: Stack, http: httpx.Client
    ) -> None:
        """A rollout no worker ran (no worker polls its queue), so none opened it at the
        gateway: Temporal says it has ended."""
        rollout_id = f"unrun-{uuid.uuid4().hex[:8]}"
        spec = RolloutSpec(
            run_id="bad-input",
            rollout_id=rollout_id,
            task={},
            agent=LocalAgentSpec(command=["true"]),
        )
        handle = await stack.client.start_workflow(
            ROLLOUT_WORKFLOW,
            spec,
            id=rollout_workflow_id(rollout_id),
            task_queue=f"nobody-{uuid.uuid4().hex[:8]}",
        )
        await handle.terminate("a test: the rollout ends before any worker ran it")
        response = http.post(
            chat_url(rollout_id), json=CHAT, headers=bearer(stack.token(rollout_id))
        )
        assert_refused(response, 409, "has finished")

    def test_result_with_a_non_finite_reward(
        self, stack: Stack, http: httpx.Client, live_rollout: str
    ) -> None:
        response = http.post(
            f"/rollouts/{live_rollout}/result",
            content=b'{"reward": NaN}',
            headers={**bearer(stack.token(live_rollout)), "content-type": "application/json"},
        )
        assert response.status_code == 400, response.text

    def test_admin_api_refuses_rollout_tokens(
        self, stack: Stack, http: httpx.Client, live_rollout: str
    ) -> None:
        assert_refused(
            http.post("/admin/pause", headers=bearer(stack.token(live_rollout))),
            403,
            "not an admin key",
        )
        assert_refused(http.get("/admin/state"), 401, "missing admin key")
        assert not http.get("/admin/state", headers=bearer(ADMIN_KEY)).json()["paused"]

    def test_admin_input_is_validated(self, http: httpx.Client) -> None:
        response = http.post("/admin/pause", json={"mode": "sideways"}, headers=bearer(ADMIN_KEY))
        assert response.status_code == 400
        assert "mode" in response.json()["error"]["message"]


# An agent reporting too much: REPORTS_PER_ATTEMPT + 1 reports, each with a metadata key of
# its own (together past a report's budget), then a report over the budget on each route.
# Writes what each post was answered to the file named by its third argument.
FLOODING_REPORTER = """
import json, os, sys, urllib.error, urllib.request

def post(url, body):
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                 "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return [response.status, ""]
    except urllib.error.HTTPError as err:
        return [err.code, json.loads(err.read())["error"]["code"]]

count, size = int(sys.argv[1]), int(sys.argv[2])
answers = [
    post(os.environ["DARL_RESULT_URL"], {"reward": 0.5, "metadata": {f"k{i}": "x" * 3000}})
    for i in range(count + 1)
]
answers.append(post(os.environ["DARL_RESULT_URL"], {"reward": 1.0, "answer": "y" * size}))
reward_event = {"event_type": "reward", "data": {"value": 1.0, "note": "z" * size}}
answers.append(post(os.environ["AGL_EVENT_URL"], reward_event))
with open(sys.argv[3], "w") as out:
    json.dump(answers, out)
"""


async def test_an_agent_cannot_report_past_its_budget(stack: Stack, tmp_path: Path) -> None:
    """Every report is a signal into the rollout's history and its fields reach the result:
    past REPORTS_PER_ATTEMPT the gateway refuses (400), a report over its budget is refused
    (413) on DARL's route and Agent Lightning's, and the reports it took, merged, stay within
    one report's budget. The refused ones change nothing: the reward is the last one taken."""
    spec = RolloutSpec(
        run_id="bad-input",
        rollout_id=f"flood-{uuid.uuid4().hex[:8]}",
        task={},
        agent=LocalAgentSpec(
            command=[
                sys.executable,
                "-c",
                FLOODING_REPORTER,
                str(REPORTS_PER_ATTEMPT),
                str(REPORT_MAX_BYTES),
                str(tmp_path / "answers.json"),
            ]
        ),
    )
    result = await asyncio.wait_for((await stack.start_rollout(spec)).result(), 120)
    assert result.status == RolloutStatus.SUCCEEDED, result.error
    answers = json.loads((tmp_path / "answers.json").read_text())
    assert answers == [[200, ""]] * REPORTS_PER_ATTEMPT + [
        [400, "too_many_reports"],
        [413, "report_too_large"],
        [413, "report_too_large"],
    ]
    assert result.reward == 0.5 and result.answer is None
    kept = AgentReport(metadata=result.metadata)
    assert kept.over_budget() is None and f"k{REPORTS_PER_ATTEMPT - 1}" in result.metadata
    assert "k0" not in result.metadata  # merging went past the budget: the later report stood
    assert await stack.store().incidents(spec.rollout_id, 1) == []


async def test_the_live_rollout_still_completes(
    stack: Stack, http: httpx.Client, live_rollout: str
) -> None:
    """After all that, a genuine call and result on the same rollout go through (a seed at
    the edge of what policy servers take among its parameters), and nothing it was refused
    was DARL's incident."""
    token = stack.token(live_rollout)
    extreme = {**CHAT, "seed": 2**63 - 1, "top_logprobs": 20, "temperature": 1e-30}
    response = http.post(chat_url(live_rollout), json=extreme, headers=bearer(token))
    assert response.status_code == 200, response.text
    assert json.loads(response.text)["choices"][0]["token_ids"]
    handle = stack.client.get_workflow_handle(f"rollout/{live_rollout}")
    assert await stack.wait_for_calls(handle, 1) == 1
    assert await stack.store().incidents(live_rollout, 1) == []


# --- the Responses and Messages APIs: the same refusals, in each protocol's own shape -------

RESPONSES = {"model": "m", "input": "hi", "max_output_tokens": 2}
MESSAGES = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def responses_url(rollout_id: str) -> str:
    return f"/rollouts/{rollout_id}/v1/responses"


def messages_url(rollout_id: str) -> str:
    return f"/rollouts/{rollout_id}/v1/messages"


def assert_anthropic_error(response: httpx.Response, status: int, kind: str, words: str) -> None:
    """Anthropic's shape: {"type": "error", "error": {"type": ..., "message": ...}}."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert words in body["error"]["message"], body


RESPONSES_REFUSED = [
    ({"model": "m"}, "input"),
    ({**RESPONSES, "input": 5}, "input"),
    ({**RESPONSES, "max_output_tokens": "many"}, "max_output_tokens"),
    ({**RESPONSES, "temperature_of_the_room": 20}, "unsupported field(s): temperature_of_the_room"),
    ({**RESPONSES, "tools": [{"type": "web_search"}]}, "tools.0"),
    ({**RESPONSES, "input": [{"type": "reasoning", "summary": []}]}, "input item type 'reasoning'"),
    ({**RESPONSES, "input": [{"role": "user", "content": "a", "x": 1}]}, "input.0.x"),
    ({**RESPONSES, "input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input_file"),
    ({**RESPONSES, "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({**RESPONSES, "previous_response_id": "resp_" + "0" * 32}, "not found in this rollout"),
]

MESSAGES_REFUSED = [
    ({"model": "m", "messages": MESSAGES["messages"]}, "max_tokens"),
    ({**MESSAGES, "max_tokens": "x"}, "max_tokens"),
    ({**MESSAGES, "messages": []}, "messages"),
    ({**MESSAGES, "messages": [{"role": "tool", "content": "hi"}]}, "messages.0.role"),
    ({**MESSAGES, "top_k": -1}, "top_k"),
    ({**MESSAGES, "unknown_knob": 1}, "unsupported field(s): unknown_knob"),
    ({**MESSAGES, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({**MESSAGES, "tools": [{"type": "bash_20250124", "name": "bash"}]}, "tool type"),
    ({**MESSAGES, "tools": [{"name": "t"}]}, "tools.0.input_schema"),
    (
        {**MESSAGES, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
        "content block type 'document'",
    ),
    (
        {**MESSAGES, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages.0.content.0.text",
    ),
]


@pytest.mark.usefixtures("no_upstream_call")
class TestOtherProtocolsRefusedBeforeThePolicyServer:
    @pytest.mark.parametrize(("body", "words"), RESPONSES_REFUSED)
    def test_responses_bad_input(
        self, stack: Stack, http: httpx.Client, live_rollout: str, body: Any, words: str
    ) -> None:
        response = http.post(
            responses_url(live_rollout), json=body, headers=bearer(stack.token(live_rollout))
        )
        assert_refused(response, 400, words)

    @pytest.mark.parametrize(("body", "words"), MESSAGES_REFUSED)
    def test_messages_bad_input(
        self, stack: Stack, http: httpx.Client, live_rollout: str, body: Any, words: str
    ) -> None:
        response = http.post(
            messages_url(live_rollout),
            json=body,
            headers={"x-api-key": stack.token(live_rollout), "anthropic-version": "2023-06-01"},
        )
        assert_anthropic_error(response, 400, "invalid_request_error", words)

    @pytest.mark.parametrize("url", [responses_url, messages_url])
    def test_malformed_and_oversized(
        self, stack: Stack, http: httpx.Client, live_rollout: str, url: Any
    ) -> None:
        headers = {**bearer(stack.token(live_rollout)), "content-type": "application/json"}
        broken = http.post(url(live_rollout), content=b'{"input": [', headers=headers)
        huge = http.post(
            url(live_rollout),
            content=b'{"x": "' + b"x" * (9 * 1024 * 1024) + b'"}',
            headers=headers,
        )
        if url is messages_url:
            assert_anthropic_error(broken, 400, "invalid_request_error", "not valid JSON")
            assert_anthropic_error(huge, 413, "request_too_large", "over")
        else:
            assert_refused(broken, 400, "not valid JSON")
            assert_refused(huge, 413, "over")

    def test_tokens(self, stack: Stack, http: httpx.Client, live_rollout: str) -> None:
        other = stack.token("some-other-rollout")
        forged = stack.token(live_rollout, secret="not-the-secret")
        assert_refused(http.post(responses_url(live_rollout), json=RESPONSES), 401, "missing")
        assert_refused(
            http.post(responses_url(live_rollout), json=RESPONSES, headers=bearer(other)),
            403,
            "another rollout",
        )
        for headers, status, kind, words in [
            ({}, 401, "authentication_error", "missing"),
            ({"x-api-key": forged}, 401, "authentication_error", "signature"),
            ({"x-api-key": other}, 403, "permission_error", "another rollout"),
        ]:
            response = http.post(messages_url(live_rollout), json=MESSAGES, headers=headers)
            assert_anthropic_error(response, status, kind, words)
        ghost = f"ghost-{uuid.uuid4().hex[:8]}"
        response = http.post(
            messages_url(ghost), json=MESSAGES, headers={"x-api-key": stack.token(ghost)}
        )
        assert_anthropic_error(response, 404, "not_found_error", "unknown rollout")

    def test_count_tokens_bad_input(
        self, stack: Stack, http: httpx.Client, live_rollout: str
    ) -> None:
        response = http.post(
            messages_url(live_rollout) + "/count_tokens",
            json={"messages": "hi"},
            headers={"x-api-key": stack.token(live_rollout)},
        )
        assert_anthropic_error(response, 400, "invalid_request_error", "messages")
