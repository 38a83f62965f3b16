"""An arithmetic agent written with the OpenAI Agents SDK: one `Agent` with a `calculator`
function tool, run by `Runner.run` (or `Runner.run_streamed`) over the Responses API. Nothing of
DARL but the task in DARL_TASK and the report to DARL_RESULT_URL; the SDK's client finds the
gateway and the rollout's token in OPENAI_BASE_URL / OPENAI_API_KEY.

    python -m darl.examples.agents_sdk_calculator.agent [--stream]   # or AGENT_STREAM=1

The first model call must use the tool (`tool_choice="required"`); the SDK then resets the
choice to `auto`, so the model can answer. Tracing is off: the SDK would otherwise send its
traces, with the rollout token as the key, to api.openai.com.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import operator
import os
from typing import Any, Literal

from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    RunResult,
    RunResultStreaming,
    function_tool,
    set_tracing_disabled,
)
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
from agents.items import ToolCallItem
from openai import AsyncOpenAI

from darl.examples.arithmetic.agent import final_answer, question_of, report_result

INSTRUCTIONS = "Compute the answer with the calculator tool, then answer with the number only."
# Tool call, answer, and a spare turn for a model that calls the tool again.
MAX_TURNS = 3

Operation = Literal["add", "sub", "mul"]
OPERATIONS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul}


@function_tool
def calculator(a: int, b: int, op: Operation) -> str:
    """Compute `a op b` on integers.

    Args:
        a: the left operand.
        b: the right operand.
        op: add, sub or mul.
    """
    return str(OPERATIONS[op](a, b))


def build_agent(client: AsyncOpenAI, model: str, max_tokens: int) -> Agent:
    return Agent(
        name="calculator agent",
        instructions=INSTRUCTIONS,
        tools=[calculator],
        model=OpenAIResponsesModel(model=model, openai_client=client),
        # reset_tool_choice (the default) turns "required" into "auto" after the tool ran.
        model_settings=ModelSettings(tool_choice="required", max_tokens=max_tokens),
    )


async def run_agent(agent: Agent, question: str, stream: bool) -> RunResult | RunResultStreaming:
    if not stream:
        return await Runner.run(agent, question, max_turns=MAX_TURNS)
    result = Runner.run_streamed(agent, question, max_turns=MAX_TURNS)
    async for _event in result.stream_events():
        pass
    return result


async def solve(question: str, stream: bool) -> dict[str, Any]:
    """The report for one task. A model that misbehaves (an unknown tool, tool calls until the
    turns run out) answers nothing, which scores 0; a gateway that fails raises."""
    model = os.environ.get("OPENAI_MODEL", "policy")
    max_tokens = int(os.environ.get("AGENT_MAX_TOKENS", "160"))
    async with AsyncOpenAI(max_retries=6) as client:
        agent = build_agent(client, model, max_tokens)
        try:
            result = await run_agent(agent, question, stream)
        except (MaxTurnsExceeded, ModelBehaviorError) as err:
            return {"answer": "", "metadata": {"error": f"{type(err).__name__}: {err}"}}
    text = str(result.final_output or "")
    tool_calls = sum(isinstance(item, ToolCallItem) for item in result.new_items)
    metadata = {"calls": len(result.raw_responses), "tool_calls": tool_calls, "text": text}
    return {"answer": final_answer(text), "metadata": metadata}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stream", action="store_true", help="Runner.run_streamed")
    args = parser.parse_args()
    stream = args.stream or os.environ.get("AGENT_STREAM") == "1"
    set_tracing_disabled(True)
    question = question_of(json.loads(os.environ["DARL_TASK"]))
    body = asyncio.run(solve(question, stream))
    print(f"question: {question!r} report: {body}")
    report_result(body)


if __name__ == "__main__":
    main()
