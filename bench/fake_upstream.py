"""A fast fake policy server for the gateway benchmark (named a fake: it samples nothing). It
answers every chat completion at once with a fixed vLLM-shaped body (prompt_token_ids,
token_ids, logprobs), so the benchmark measures the gateway, not a model.

A request carrying `"bench_follow_text": true` (the long-context phase) gets token ids that
follow its text instead: one id per UTF-8 byte of each message's content after an id for its
role, and a generation prompt; its answer is 16 bytes of text whose ids are those bytes. So
each call's prompt extends the previous call's prompt and answer, as a real chat template's do.

    python -m bench.fake_upstream --ready-file F
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

PROMPT_IDS = list(range(100, 160))
COMPLETION_IDS = list(range(10, 26))
BODY = json.dumps(
    {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 0,
        "model": "fake",
        "prompt_token_ids": PROMPT_IDS,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "x" * len(COMPLETION_IDS)},
                "finish_reason": "length",
                "token_ids": COMPLETION_IDS,
                "logprobs": {
                    "content": [
                        {"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []}
                        for _ in COMPLETION_IDS
                    ]
                },
            }
        ],
        "usage": {"prompt_tokens": 60, "completion_tokens": 16, "total_tokens": 76},
    }
).encode()
MODELS = json.dumps({"object": "list", "data": [{"id": "fake", "object": "model"}]}).encode()


ROLE_IDS = {"system": 1, "user": 2, "assistant": 3, "tool": 4}
ANSWER = "The answer is 4."


def following_text(request: dict) -> bytes:
    """The answer to a `bench_follow_text` request: ids that follow its text (see above)."""
    prompt: list[int] = []
    for message in request["messages"]:
        prompt.append(ROLE_IDS.get(message["role"], 5))
        prompt += message.get("content", "").encode()
    prompt.append(ROLE_IDS["assistant"])  # the generation prompt
    completion = list(ANSWER.encode())
    entry = {"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []}
    return json.dumps(
        {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 0,
            "model": "fake",
            "prompt_token_ids": prompt,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": ANSWER},
                    "finish_reason": "stop",
                    "token_ids": completion,
                    "logprobs": {"content": [entry] * len(completion)},
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(completion),
                "total_tokens": len(prompt) + len(completion),
            },
        }
    ).encode()


async def app(scope: dict, receive, send) -> None:
    if scope["type"] != "http":
        return
    received = bytearray()
    more = True
    while more:
        message = await receive()
        received += message.get("body", b"")
        more = message.get("more_body", False)
    body = MODELS if scope["path"].endswith("/models") else BODY
    if b'"bench_follow_text"' in received:
        body = following_text(json.loads(received))
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            # The version of its weights, as DARL's policy servers prove it on every answer.
            "headers": [(b"content-type", b"application/json"), (b"x-darl-policy-version", b"0")],
        }
    )
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    from darl.deploy.serving import serve_app

    ready = Path(sys.argv[sys.argv.index("--ready-file") + 1])

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        import signal

        loop.add_signal_handler(signal.SIGTERM, stop.set)
        await serve_app(app, "127.0.0.1", 0, stop, ready, "fake-upstream")

    asyncio.run(run())


if __name__ == "__main__":
    main()
