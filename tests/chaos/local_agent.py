"""The chaos runs' local-process digits agent: one raw completion through the gateway, its
answer posted to DARL_RESULT_URL, its run and the call id it received noted in
$CHAOS_AGENT_LOG (the same lines as tests/chaos/agents.py). Exits 1 if the gateway fails it.
Run as a file (`{python} .../local_agent.py`): it imports nothing of DARL's."""

from __future__ import annotations

import json
import os
import sys
import uuid

import httpx


def note(**line: object) -> None:
    with open(os.environ["CHAOS_AGENT_LOG"], "a") as f:
        f.write(json.dumps(line) + "\n")


def main() -> int:
    run = uuid.uuid4().hex
    rollout_id, attempt = os.environ["DARL_ROLLOUT_ID"], int(os.environ["DARL_ATTEMPT"])
    note(run=run, rollout_id=rollout_id, attempt=attempt, pid=os.getpid())
    task = json.loads(os.environ["DARL_TASK"])
    auth = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
    try:
        response = httpx.post(
            f"{os.environ['OPENAI_BASE_URL']}/completions",
            headers=auth,
            json={"model": "policy", "prompt": task["prompt"], "max_tokens": task["max_tokens"]},
            timeout=120,
        )
        response.raise_for_status()
        call_id = response.headers["x-darl-call-id"]
        httpx.post(
            os.environ["DARL_RESULT_URL"],
            headers=auth,
            json={"answer": response.json()["choices"][0]["text"]},
            timeout=30,
        ).raise_for_status()
    except httpx.HTTPError as err:
        note(run=run, error=repr(err))
        return 1
    note(run=run, call_id=call_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
