"""A fast fake policy server for the gateway benchmark (named a fake: it samples nothing). It
answers every chat completion at once with a fixed vLLM-shaped body (prompt_token_ids,
token_ids, logprobs), so the benchmark measures the gateway, not a model.

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


async def app(scope: dict, receive, send) -> None:
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    body = MODELS if scope["path"].endswith("/models") else BODY
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
