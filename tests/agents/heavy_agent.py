"""A test agent for SWE-sized rows: it reads its task (~210 KB: a PASS_TO_PASS list of 2,000
test ids, a 20 KB patch, a 30 KB test patch) from DARL_TASK_FILE, checks it arrived whole and
that DARL_TASK was left unset (a task over 64 KiB), makes one completion through the gateway,
tries to report a ~1 MB answer (which must come back 413), and reports the completion with
~60 KB of metadata, within the report's budget. Exit status 3-5 names what was wrong."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import httpx


def fingerprint(task: dict) -> str:
    heavy = json.dumps([task["PASS_TO_PASS"], task["patch"], task["test_patch"]])
    return hashlib.sha256(heavy.encode()).hexdigest()


def main() -> None:
    task = json.loads(Path(os.environ["DARL_TASK_FILE"]).read_text())
    if "DARL_TASK" in os.environ:
        sys.exit(3)
    if fingerprint(task) != task["fingerprint"]:
        sys.exit(4)
    auth = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
    with httpx.Client(timeout=60) as http:
        completion = http.post(
            f"{os.environ['OPENAI_BASE_URL']}/completions",
            headers=auth,
            json={"model": "policy", "prompt": task["prompt"], "max_tokens": task["max_tokens"]},
        )
        completion.raise_for_status()
        answer = completion.json()["choices"][0]["text"]
        result_url = os.environ["DARL_RESULT_URL"]
        refused = http.post(result_url, headers=auth, json={"answer": "a" * 1_000_000})
        if refused.status_code != 413 or "at most" not in refused.text:
            sys.exit(5)
        report = {"answer": answer, "metadata": {"log": "m" * 60_000}}
        http.post(result_url, headers=auth, json=report).raise_for_status()


if __name__ == "__main__":
    main()
