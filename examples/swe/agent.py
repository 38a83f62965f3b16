"""DARL's own minimal coding agent: the OpenAI SDK, two tools (`bash`, a command run in the
working directory, and `submit`, which ends the episode), every answer forced to call one, and
a step limit. It reports no reward: DARL's grader scores the workspace after it exits.

    python examples/swe/agent.py   # in the task's workspace, with DARL_TASK and OPENAI_*

One file that imports nothing of DARL, so a sandbox shows it alone (examples/swe/rollout.json).
The task is a SWE-bench / SWE-smith instance (its `problem_statement`), read from
DARL_TASK_FILE or DARL_TASK; the SDK finds the gateway and the rollout's token in
OPENAI_BASE_URL / OPENAI_API_KEY. Settings: AGENT_STEP_LIMIT, AGENT_TIME_LIMIT (seconds, 0
for none: end before the rollout's timeout would, so the attempt is graded), AGENT_MAX_TOKENS,
AGENT_COMMAND_TIMEOUT (seconds), AGENT_OUTPUT_CHARS, AGENT_PAUSE_SECONDS (how long to wait
out a paused gateway's 429s), OPENAI_MODEL.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
from openai import OpenAI
from openai.types.chat import (
    ChatCompletionAssistantMessageParam,
    ChatCompletionFunctionToolParam,
    ChatCompletionMessage,
    ChatCompletionMessageFunctionToolCallParam,
    ChatCompletionMessageParam,
)

SYSTEM = (
    "You are a software engineer fixing an issue in the repository that is your working "
    "directory. Use the bash tool to read and change files and to run tests; each command "
    "runs in a fresh shell in the repository. When the fix is done, call submit."
)
BASH: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a bash command in the repository; returns its exit code and output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "the command"}},
            "required": ["command"],
        },
    },
}
SUBMIT: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "submit",
        "description": "End the episode: the repository as it is now is your answer.",
        "parameters": {"type": "object", "properties": {}},
    },
}
# The variables of DARL's agent contract that hold the rollout token.
TOKEN_VARIABLES = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "AGL_KEY")
_PR_SET_DUMPABLE = 4


@dataclass(frozen=True)
class Settings:
    step_limit: int = 30
    time_limit: float = 0.0
    max_tokens: int = 512
    command_timeout: float = 60.0
    output_chars: int = 4000
    pause_seconds: float = 900.0
    model: str = "policy"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        return cls(
            step_limit=int(env.get("AGENT_STEP_LIMIT", cls.step_limit)),
            time_limit=float(env.get("AGENT_TIME_LIMIT", cls.time_limit)),
            max_tokens=int(env.get("AGENT_MAX_TOKENS", cls.max_tokens)),
            command_timeout=float(env.get("AGENT_COMMAND_TIMEOUT", cls.command_timeout)),
            output_chars=int(env.get("AGENT_OUTPUT_CHARS", cls.output_chars)),
            pause_seconds=float(env.get("AGENT_PAUSE_SECONDS", cls.pause_seconds)),
            model=env.get("OPENAI_MODEL", cls.model),
        )


def read_task(env: Mapping[str, str]) -> Any:
    path = env.get("DARL_TASK_FILE")
    if path:
        return json.loads(Path(path).read_text())
    if "DARL_TASK" not in env:
        raise SystemExit("no task: set DARL_TASK (JSON) or DARL_TASK_FILE")
    return json.loads(env["DARL_TASK"])


def problem_statement(task: Any) -> str:
    statement = task.get("problem_statement") if isinstance(task, dict) else task
    if not isinstance(statement, str) or not statement.strip():
        raise SystemExit(f"the task has no 'problem_statement': {str(task)[:200]}")
    return statement


def command_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of the model's commands: the agent's, without the rollout token.

    The commands are the model's, not ours: with the token a command could post a reward to
    DARL_RESULT_URL, make model calls that would enter the trajectory as the agent's, or read
    the rollout at the gateway. So the token's variables are blank and any other variable
    holding it is dropped (the grader ignores a posted reward anyway; this keeps the token
    out of reach, as far as a process can)."""
    token = environ.get("OPENAI_API_KEY", "")
    env = {k: v for k, v in environ.items() if not (token and token in v)}
    return env | dict.fromkeys(TOKEN_VARIABLES, "")


def hide_own_environ() -> None:
    """Make this process non-dumpable: its /proc/<pid>/environ (which still holds the token)
    is then readable only with CAP_SYS_PTRACE, which a sandboxed command lacks."""
    if sys.platform != "linux":
        return
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def truncated(text: str, limit: int) -> str:
    """The head and tail of `text` within `limit` characters."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


def run_bash(command: str, env: Mapping[str, str], settings: Settings) -> str:
    """Run `command` in a fresh bash in the working directory; its exit code and output."""
    proc = subprocess.Popen(
        ["bash", "-c", command],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(env),
        start_new_session=True,  # a group of its own, so a timeout kills what it started
    )
    try:
        out, _ = proc.communicate(timeout=settings.command_timeout)
        status = f"exit code {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        status = f"timed out after {settings.command_timeout:g}s (killed)"
    text = out.decode("utf-8", errors="replace")
    return f"{status}\n{truncated(text, settings.output_chars)}"


def tool_result(name: str, arguments: str, env: Mapping[str, str], settings: Settings) -> str:
    if name != "bash":
        return f"error: no tool named {name!r}; the tools are bash and submit"
    try:
        command = json.loads(arguments).get("command")
    except (ValueError, AttributeError):
        command = None
    if not isinstance(command, str):
        return 'error: bash takes {"command": "<a bash command>"}'
    return run_bash(command, env, settings)


def ask(
    client: OpenAI, messages: list[ChatCompletionMessageParam], settings: Settings
) -> ChatCompletionMessage:
    """One forced tool call; a 429 (the gateway is paused for a weight update) is waited out
    for up to `pause_seconds`, honouring Retry-After."""
    deadline = time.monotonic() + settings.pause_seconds
    delay = 1.0
    while True:
        try:
            completion = client.chat.completions.create(
                model=settings.model,
                messages=messages,
                tools=[BASH, SUBMIT],
                tool_choice="required",
                max_tokens=settings.max_tokens,
            )
            return completion.choices[0].message
        except openai.RateLimitError as err:
            wait = float(err.response.headers.get("retry-after") or delay)
            if time.monotonic() + wait > deadline:
                raise
            time.sleep(wait)
            delay = min(delay * 2, 30.0)


def assistant_turn(message: ChatCompletionMessage) -> ChatCompletionAssistantMessageParam:
    """The model's answer as the next request carries it: its text and function calls."""
    turn: ChatCompletionAssistantMessageParam = {"role": "assistant", "content": message.content}
    calls: list[ChatCompletionMessageFunctionToolCallParam] = [
        {
            "id": call.id,
            "type": "function",
            "function": {"name": call.function.name, "arguments": call.function.arguments},
        }
        for call in message.tool_calls or []
        if call.type == "function"
    ]
    if calls:
        turn["tool_calls"] = calls
    return turn


def run_episode(client: OpenAI, statement: str, env: Mapping[str, str], settings: Settings) -> str:
    """Ask and act until the model submits, the steps run out or the context is full; says
    which."""
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Fix this issue:\n\n{statement}"},
    ]
    ends = time.monotonic() + settings.time_limit
    for step in range(1, settings.step_limit + 1):
        if settings.time_limit and time.monotonic() >= ends:
            return f"the time limit ({settings.time_limit:g} s) was reached"
        try:
            message = ask(client, messages, settings)
        except openai.BadRequestError as err:
            if err.code == "context_length_exceeded":
                # The episode is over, not failed: the grader scores what the workspace holds.
                return "the context window is full"
            raise
        messages.append(assistant_turn(message))
        if not message.tool_calls:
            messages.append({"role": "user", "content": "Call bash to act, or submit."})
            continue
        for call in message.tool_calls:
            if call.type != "function":
                continue
            if call.function.name == "submit":
                return "submitted"
            result = tool_result(call.function.name, call.function.arguments, env, settings)
            print(f"step {step}: {call.function.arguments[:200]} -> {result[:200]!r}", flush=True)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return f"the step limit ({settings.step_limit}) was reached"


def main() -> None:
    settings = Settings.from_env(os.environ)
    statement = problem_statement(read_task(os.environ))
    env = command_env(os.environ)
    hide_own_environ()
    with OpenAI() as client:
        ending = run_episode(client, statement, env, settings)
    print(f"episode ended: {ending}")


if __name__ == "__main__":
    main()
