"""A multi-turn tool-use agent written with the Anthropic SDK: Messages API calls with a
`calculator` tool, the first forced to use it (`tool_choice: any`); each `tool_use` block is run
and its `tool_result` sent back until the model answers in text or the turns run out. Nothing of
DARL but the task in DARL_TASK and the report to DARL_RESULT_URL; the SDK finds the gateway and
the rollout's token in ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY.

    python -m darl.examples.anthropic_tools.agent [--stream]   # or AGENT_STREAM=1
"""

from __future__ import annotations

import argparse
import json
import operator
import os
from typing import Any

from anthropic import Anthropic
from anthropic.types import Message, ToolUseBlock

from darl.examples.arithmetic.agent import final_answer, question_of, report_result

SYSTEM = "Compute the answer with the calculator tool, then answer with the number only."
MAX_TURNS = 4
OPERATIONS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul}
# Integers and an enum only: what the gateway's constrained decoding generates.
CALCULATOR = {
    "name": "calculator",
    "description": "Compute `a op b` on integers.",
    "input_schema": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "description": "the left operand"},
            "b": {"type": "integer", "description": "the right operand"},
            "op": {"type": "string", "enum": sorted(OPERATIONS)},
        },
        "required": ["a", "b", "op"],
    },
}


def calculate(arguments: object) -> str:
    """The calculator: raises ValueError on anything but two integers and a known op."""
    if not isinstance(arguments, dict):
        raise ValueError("arguments must be an object")
    a, b, op = arguments.get("a"), arguments.get("b"), arguments.get("op")
    if type(a) is not int or type(b) is not int or op not in OPERATIONS:
        raise ValueError(f"want integers a, b and op in {sorted(OPERATIONS)}")
    return str(OPERATIONS[op](a, b))


def tool_result(block: ToolUseBlock) -> dict[str, Any]:
    try:
        if block.name != CALCULATOR["name"]:
            raise ValueError(f"no tool named {block.name!r}")
        return {"type": "tool_result", "tool_use_id": block.id, "content": calculate(block.input)}
    except ValueError as err:
        return {
            "type": "tool_result",
            "tool_use_id": block.id,
            "content": f"error: {err}",
            "is_error": True,
        }


def ask(client: Anthropic, messages: list[dict[str, Any]], first: bool, stream: bool) -> Message:
    """One Messages call; streamed through `messages.stream`, read to its final message."""
    request: dict[str, Any] = {
        "model": os.environ.get("ANTHROPIC_MODEL", "policy"),
        "max_tokens": int(os.environ.get("AGENT_MAX_TOKENS", "160")),
        "system": SYSTEM,
        "tools": [CALCULATOR],
        "messages": messages,
    }
    if first:
        request["tool_choice"] = {"type": "any"}
    if not stream:
        return client.messages.create(**request)
    with client.messages.stream(**request) as events:
        return events.get_final_message()


def assistant_turn(reply: Message) -> dict[str, Any]:
    """The reply as the next request's assistant message: its text and tool_use blocks."""
    content: list[dict[str, Any]] = []
    for block in reply.content:
        if block.type == "text":
            content.append({"type": "text", "text": block.text})
        elif block.type == "tool_use":
            content.append(
                {"type": "tool_use", "id": block.id, "name": block.name, "input": block.input}
            )
    return {"role": "assistant", "content": content}


def solve(client: Anthropic, question: str, stream: bool) -> dict[str, Any]:
    """Turns until a reply without tool use; the last reply's text is the answer."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    text, tool_calls = "", 0
    for turn in range(MAX_TURNS):
        reply = ask(client, messages, first=turn == 0, stream=stream)
        text = "".join(block.text for block in reply.content if block.type == "text")
        uses = [block for block in reply.content if block.type == "tool_use"]
        if not uses:
            break
        tool_calls += len(uses)
        messages.append(assistant_turn(reply))
        messages.append({"role": "user", "content": [tool_result(use) for use in uses]})
    metadata = {"calls": turn + 1, "tool_calls": tool_calls, "text": text}
    return {"answer": final_answer(text), "metadata": metadata}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stream", action="store_true", help="stream each reply")
    args = parser.parse_args()
    stream = args.stream or os.environ.get("AGENT_STREAM") == "1"
    question = question_of(json.loads(os.environ["DARL_TASK"]))
    with Anthropic(max_retries=6) as client:
        body = solve(client, question, stream)
    print(f"question: {question!r} report: {body}")
    report_result(body)


if __name__ == "__main__":
    main()
