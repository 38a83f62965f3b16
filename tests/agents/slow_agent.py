"""A test agent: notes each start of itself, makes CALLS model calls with PAUSE seconds between
them through the official OpenAI SDK (MAX_RETRIES retries of a failed call, 8 by default), and
reports how many answers it received, and their call ids, in its report's metadata."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
from openai import OpenAI


def main() -> None:
    with Path(os.environ["LAUNCH_LOG"]).open("a") as log:
        log.write(f"{os.environ['DARL_ROLLOUT_ID']} {os.getpid()} {os.environ['DARL_ATTEMPT']}\n")
    calls = int(os.environ.get("CALLS", "2"))
    pause = float(os.environ.get("PAUSE", "1"))
    client = OpenAI(max_retries=int(os.environ.get("MAX_RETRIES", "8")))
    received = []
    messages = [{"role": "user", "content": json.loads(os.environ["DARL_TASK"])["question"]}]
    for turn in range(calls):
        if turn:
            time.sleep(pause)
        raw = client.chat.completions.with_raw_response.create(
            model="m", messages=messages, max_tokens=4
        )
        received.append(raw.headers["x-darl-call-id"])
        reply = raw.parse()
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            {"role": "user", "content": f"turn {turn + 1}"},
        ]
    httpx.post(
        os.environ["DARL_RESULT_URL"],
        json={"reward": 1.0, "answer": "done", "metadata": {"calls": calls, "received": received}},
        headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"},
        timeout=30,
    ).raise_for_status()


if __name__ == "__main__":
    main()
