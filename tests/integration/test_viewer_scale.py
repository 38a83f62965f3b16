"""A rollout of 1,000 model calls opens whole in the viewer: every call, its tokens and the rows
the trainer makes, against the real dev server (which knows no workflow of it: the page says
so and shows the store's record). The time it takes is printed, not asserted: a figure for a
report, not a flaky timed test."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from temporalio.testing import WorkflowEnvironment

from darl.gateway.store.directory import DirectoryTrajectoryStore
from darl.gateway.store.record import CallRecord
from darl.viewer.app import Viewer, ViewerSettings, create_viewer_app
from darl.viewer.temporal_view import TemporalView

CALLS = 1000
ANSWER_TOKENS = 16
TOOL_TOKENS = 8


def _record(rollout_id: str, call: int, prompt: list[int], messages: list[dict]) -> CallRecord:
    answer = [(call + i) % 90 + 1 for i in range(ANSWER_TOKENS)]
    return CallRecord(
        call_id=f"c{call}",
        rollout_id=rollout_id,
        attempt=1,
        sequence=-1,
        endpoint="chat.completions",
        upstream="http://policy",
        policy_version=call // 100,
        created_at=1.0 + call,
        latency_ms=3.0,
        retry_count=0,
        streamed=False,
        request={"model": "m", "messages": list(messages)},
        response={
            "id": f"x{call}",
            "prompt_token_ids": prompt,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": f"step {call} <b>"},
                    "finish_reason": "stop",
                    "token_ids": answer,
                    "logprobs": {
                        "content": [{"token": chr(64 + t % 26), "logprob": -t / 50} for t in answer]
                    },
                }
            ],
        },
        prompt_token_ids=prompt,
    )


async def _write_rollout(store: DirectoryTrajectoryStore, rollout_id: str) -> None:
    """A conversation whose every call extends the last (trajectory mode merges them)."""
    prompt = list(range(1, 40))
    messages: list[dict] = [{"role": "user", "content": "start"}]
    for call in range(CALLS):
        record = await store.append(_record(rollout_id, call, prompt, messages))
        tool = [95] * TOOL_TOKENS
        prompt = prompt + record.completion_token_ids() + tool
        messages += [
            {"role": "assistant", "content": f"step {call} <b>"},
            {"role": "user", "content": f"tool said {call}"},
        ]


async def test_a_rollout_of_a_thousand_calls_opens_whole(
    dev_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    store = DirectoryTrajectoryStore(tmp_path / "trajectories")
    await _write_rollout(store, "long-1")
    settings = ViewerSettings(store.root, tmp_path / "runs", tmp_path / "agents")
    app = create_viewer_app(Viewer(TemporalView(dev_env.client), settings))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://viewer") as client:
        timings = []
        for _ in range(3):
            started = time.perf_counter()
            response = await client.get("/rollouts/long-1")
            timings.append(time.perf_counter() - started)
    assert response.status_code == 200
    text = response.text
    assert text.count('<section class="call"') == CALLS
    assert text.index('id="call-0"') < text.index('id="call-999"')
    assert text.count('class="tok"') >= CALLS * ANSWER_TOKENS
    assert 'id="no-workflow"' in text
    assert "&lt;b&gt;" in text and "step 999 <b>" not in text
    # All calls merge into one row, cut to the default 256 response tokens.
    assert "1 rows from 1000 calls; 999 merged" in text
    print(
        f"\n1,000-call rollout page: {len(text) / 1e6:.1f} MB of HTML, "
        f"{', '.join(f'{t:.3f}' for t in timings)} s (3 loads, in process)"
    )
