"""A test agent for replay (rule 10): a multi-turn harness on the official SDKs that runs a
deterministic tool on every answer and sends the conversation so far each turn, as long-horizon
agents do. Run as a file (`{python} .../replay_agent.py`) or, in an agent service, through
`run_episode`: it imports nothing of DARL's.

Settings (environment): PROTOCOL `chat` | `responses` | `messages` | `tokens` (text completions
on token ids, the prompt extended by the answer's ids and the tool's: a token-in, token-out
agent whose calls merge into one training row); STREAM `1` to stream;
TURNS; PARALLEL `2` for two concurrent calls per turn (sub-agents on one conversation); TOOL
`count` (a pure function of the answer), `clock` (the time at turn CLOCK_TURN, else count) or
`pytest` (pytest's summary line, whose duration differs on every run); MAX_TOKENS.

KILL_AFTER=k: on attempt 1, once k answers arrived the agent notes it in
`$MARKER_DIR/<rollout>.<attempt>` and waits, so the test kills it from outside at exactly that
point (`k1,k2,...`: attempt n waits after kn answers). With KILL_IN_FLIGHT=1 it waits there
only until the test writes `<marker>.go`, then sends its next call, for the test to kill it
while that call is at the policy server. Every answer is noted in $AGENT_LOG
(call id, the call it replays, its text). KILL_RATE=p instead: each of attempts 1 and 2
waits to be killed with probability p, after a number of answers drawn at random (seeded by
the rollout and attempt). With CHAOS_AGENT_LOG the agent also notes its run and the answers
it received in the chaos tier's format (tests/chaos/local_agent.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI

SYSTEM = "You are a careful agent. Use the tool's output to decide the next step."


# Token ids the tokens agent writes itself: 1..14, which every tiny model has (digits: 15).
def _token(value: int) -> int:
    return 1 + value % 14


def token_tool(answer: str) -> str:
    """The tokens agent's tool: token ids (as JSON) that are a pure function of the answer's."""
    ids = json.loads(answer) if answer.startswith("[") else []
    return json.dumps([_token(sum(ids)), _token(len(ids)), 1])


def tool_output(tool: str, turn: int, text: str, clock_turn: int) -> str:
    """What the harness's tool prints for this turn's answer."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:6]
    if tool == "clock" and turn == clock_turn:
        return f"clock: it is {time.time_ns()} ns since the epoch"
    if tool == "pytest":
        return f"pytest: === {len(text) % 7 + 1} passed in {random.uniform(0.05, 3.0):.2f}s ==="
    return f"count: {len(text)} characters, digest {digest}"


class Ask:
    """One model call in the protocol the agent speaks: returns the text and the headers."""

    def __init__(self, settings: Mapping[str, str]) -> None:
        self.protocol = settings.get("PROTOCOL", "chat")
        self.stream = settings.get("STREAM") == "1"
        self.max_tokens = int(settings.get("MAX_TOKENS", "6"))
        self.openai = OpenAI(
            base_url=settings["OPENAI_BASE_URL"], api_key=settings["OPENAI_API_KEY"], max_retries=6
        )
        if self.protocol == "messages":
            # Imported only here: the SDK takes ~2 s of CPU to import on this machine.
            from anthropic import Anthropic

            self.anthropic = Anthropic(
                base_url=settings["ANTHROPIC_BASE_URL"],
                api_key=settings["ANTHROPIC_API_KEY"],
                max_retries=6,
            )

    def __call__(self, messages: list[dict[str, str]]) -> tuple[str, Mapping[str, str]]:
        if self.protocol == "tokens":
            return self._tokens(messages)
        if self.protocol == "responses":
            return self._responses(messages)
        if self.protocol == "messages":
            return self._messages(messages)
        return self._chat(messages)

    def _chat(self, messages: list[dict[str, str]]) -> tuple[str, Mapping[str, str]]:
        chat = [{"role": "system", "content": SYSTEM}, *messages]
        raw = self.openai.chat.completions.with_raw_response.create(
            model="policy", messages=chat, max_tokens=self.max_tokens, stream=self.stream
        )
        if not self.stream:
            return raw.parse().choices[0].message.content or "", raw.headers
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
        return text, raw.headers

    def _tokens(self, messages: list[dict[str, str]]) -> tuple[str, Mapping[str, str]]:
        """The conversation as token ids: a fixed opening, then each turn's answer ids and
        the tool's ids (carried in the messages as JSON lists)."""
        prompt = [ids for m in messages for ids in json.loads(m["content"])]
        raw = self.openai.completions.with_raw_response.create(
            model="policy", prompt=prompt, max_tokens=self.max_tokens, stream=self.stream
        )
        if not self.stream:
            choice = raw.parse().choices[0]
            return json.dumps((choice.model_extra or {})["token_ids"]), raw.headers
        ids: list[int] = []
        for chunk in raw.parse():
            for part in chunk.choices:
                ids += (part.model_extra or {}).get("token_ids") or []
        return json.dumps(ids), raw.headers

    def _responses(self, messages: list[dict[str, str]]) -> tuple[str, Mapping[str, str]]:
        raw = self.openai.responses.with_raw_response.create(
            model="policy",
            instructions=SYSTEM,
            input=messages,  # type: ignore[arg-type]
            max_output_tokens=self.max_tokens,
            stream=self.stream,
        )
        if not self.stream:
            return raw.parse().output_text, raw.headers
        text = ""
        for event in raw.parse():
            if event.type == "response.completed":
                text = event.response.output_text
        return text, raw.headers

    def _messages(self, messages: list[dict[str, str]]) -> tuple[str, Mapping[str, str]]:
        raw = self.anthropic.messages.with_raw_response.create(
            model="policy",
            system=SYSTEM,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=self.max_tokens,
            stream=self.stream,
        )
        if not self.stream:
            message = raw.parse()
            return "".join(b.text for b in message.content if b.type == "text"), raw.headers
        text = ""
        for event in raw.parse():
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                text += event.delta.text
        return text, raw.headers


def run_episode(
    settings: Mapping[str, str], wait_to_be_killed: Callable[[], None]
) -> dict[str, Any]:
    """The episode: TURNS turns, each PARALLEL calls on the conversation so far; returns the
    report. Calls `wait_to_be_killed` at the kill point (it returns only to send the call
    the test kills the agent in: KILL_IN_FLIGHT)."""
    rollout = settings["DARL_ROLLOUT_ID"]
    attempt = int(settings["DARL_ATTEMPT"])
    turns = int(settings.get("TURNS", "10"))
    parallel = int(settings.get("PARALLEL", "1"))
    tool = settings.get("TOOL", "count")
    clock_turn = int(settings.get("CLOCK_TURN", "-1"))
    kills = [int(k) for k in settings.get("KILL_AFTER", "0").split(",")]
    kill_after = kills[attempt - 1] if attempt <= len(kills) else 0
    if settings.get("KILL_RATE"):
        chance = random.Random(f"{rollout}/{attempt}")
        if attempt < 3 and chance.random() < float(settings["KILL_RATE"]):
            kill_after = chance.randint(1, turns * parallel - 1)
    ask = Ask(settings)
    tokens = ask.protocol == "tokens"
    task = json.loads(settings["DARL_TASK"])
    question = task.get("question") or settings["DARL_TASK"]
    # The tokens agent opens with ids of its own question (no two tasks share a prompt).
    opening = (
        json.dumps([_token(b) for b in hashlib.sha256(question.encode()).digest()[:8]])
        if tokens
        else question
    )
    messages: list[dict[str, str]] = [{"role": "user", "content": opening}]
    answers = 0
    log_path = Path(settings["AGENT_LOG"])
    with log_path.open("a") as log:
        log.write(json.dumps({"rollout": rollout, "attempt": attempt, "start": time.time()}) + "\n")
    chaos_log = settings.get("CHAOS_AGENT_LOG")
    run = uuid.uuid4().hex
    if chaos_log:
        _note(chaos_log, run=run, rollout_id=rollout, attempt=attempt, pid=os.getpid())
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        for turn in range(turns):
            asks = [
                [*messages, {"role": "user", "content": f"sub-agent {i}: go on."}]
                if parallel > 1
                else messages
                for i in range(parallel)
            ]
            replies = list(pool.map(ask, asks))
            for text, headers in replies:
                answers += 1
                line = {
                    "rollout": rollout,
                    "attempt": attempt,
                    "turn": turn,
                    "call_id": headers.get("x-darl-call-id"),
                    "replayed_from": headers.get("x-darl-replayed-from"),
                    "text": text,
                    "at": time.time(),
                }
                with log_path.open("a") as log:
                    log.write(json.dumps(line) + "\n")
                if chaos_log:
                    _note(chaos_log, run=run, call_id=line["call_id"])
            texts = [text for text, _ in replies]
            if tokens:
                observation = token_tool(texts[0])
                messages = [*messages, {"role": "assistant", "content": texts[0]}]
            else:
                observation = tool_output(tool, turn, " ".join(texts), clock_turn)
                messages = [
                    *messages,
                    {"role": "assistant", "content": " | ".join(texts) or "(nothing)"},
                ]
            messages.append({"role": "user", "content": observation})
            if kill_after and answers >= kill_after:
                wait_to_be_killed()
    return {"reward": 1.0, "answer": messages[-2]["content"], "metadata": {"answers": answers}}


def _note(path: str, **line: object) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def _wait_for_sigkill(settings: Mapping[str, str]) -> Callable[[], None]:
    def wait() -> None:
        marker = (
            Path(settings["MARKER_DIR"])
            / f"{settings['DARL_ROLLOUT_ID']}.{settings['DARL_ATTEMPT']}"
        )
        marker.write_text(str(os.getpid()))
        go = marker.with_name(f"{marker.name}.go")
        while settings.get("KILL_IN_FLIGHT") == "1" and not go.exists():
            time.sleep(0.05)
        while settings.get("KILL_IN_FLIGHT") != "1":
            time.sleep(60)

    return wait


def main() -> None:
    settings = dict(os.environ)
    report = run_episode(settings, _wait_for_sigkill(settings))
    httpx.post(
        settings["DARL_RESULT_URL"],
        json=report,
        headers={"Authorization": f"Bearer {settings['OPENAI_API_KEY']}"},
        timeout=30,
    ).raise_for_status()


if __name__ == "__main__":
    main()
