"""A test agent that reads its task as Agent Lightning's `swe_smith` agent does
(`fetch_eval_meta` in its `examples/swe_smith/agents/smith_agent.py`): `GET
<server>/api/rollouts/<rollout id>`, the server and id taken from `AGL_EVENT_URL` by the same
pattern, `AGL_KEY` as a Bearer token, with urllib; then `rollout.input` for `FAIL_TO_PASS` and
`PASS_TO_PASS`. It sends what it read back as an Agent Lightning event (`task_read`), which the
gateway keeps with the attempt, and exits 1 when the task it read has no `FAIL_TO_PASS`, as
that agent does when its eval meta is unavailable."""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.request
from typing import Any


def rollout_url(event_url: str) -> str:
    match = re.match(r"^(?P<base>.*)/api/rollouts/(?P<rid>[^/]+)/attempt/", event_url)
    if match is None:
        raise SystemExit(f"cannot derive the rollout id from AGL_EVENT_URL={event_url!r}")
    return f"{match.group('base')}/api/rollouts/{match.group('rid')}"


def fetch(url: str, key: str) -> dict[str, Any]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        payload: dict[str, Any] = json.loads(response.read().decode("utf-8"))
    return payload


def send_event(event_url: str, key: str, data: dict[str, Any]) -> None:
    body = json.dumps({"event_type": "task_read", "data": data}).encode()
    request = urllib.request.Request(
        event_url,
        data=body,
        method="POST",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()


def main() -> int:
    event_url, key = os.environ["AGL_EVENT_URL"], os.environ["AGL_KEY"]
    payload = fetch(rollout_url(event_url), key)
    task = (payload.get("rollout") or {}).get("input") or {}
    send_event(event_url, key, {"payload": payload})
    return 0 if task.get("FAIL_TO_PASS") else 1


if __name__ == "__main__":
    sys.exit(main())
