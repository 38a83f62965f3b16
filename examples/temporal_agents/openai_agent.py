"""An OpenAI Agents SDK agent written as a Temporal workflow, as Temporal's samples write them:
`Runner.run` in the workflow, each model call an activity (the OpenAI Agents plugin's), the
calculator tool an activity too. The task, instructions and tool are those of
examples/agents_sdk_calculator/agent.py, the same agent as a process. Nothing of DARL is in it:
the worker's plugins route its model calls (worker.py)."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from agents import Agent, ModelSettings, Runner
    from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError, UserError
    from temporalio.openai_agents.workflow import activity_as_tool

    from darl.examples.temporal_agents.calculator import calculator

INSTRUCTIONS = "Compute the answer with the calculator tool, then answer with the number only."
# Tool call, answer, and a spare turn for a model that calls the tool again.
MAX_TURNS = 3
MAX_TOKENS = 160
# The model's name as the policy server knows it; the worker's model provider picks the server.
MODEL = "policy"


@workflow.defn
class CalculatorAgentWorkflow:
    @workflow.run
    async def run(self, question: str) -> str:
        agent = Agent(
            name="calculator agent",
            instructions=INSTRUCTIONS,
            model=MODEL,
            tools=[activity_as_tool(calculator, start_to_close_timeout=timedelta(seconds=10))],
            # reset_tool_choice (the default) turns "required" into "auto" after the tool ran.
            model_settings=ModelSettings(tool_choice="required", max_tokens=MAX_TOKENS),
        )
        try:
            result = await Runner.run(agent, question, max_turns=MAX_TURNS)
        except (MaxTurnsExceeded, ModelBehaviorError, UserError) as err:
            # A model that misbehaves (an unknown tool, arguments the tool refuses, tool calls
            # until the turns run out) answers nothing, which scores 0. A model call that
            # fails is no such error: it fails the workflow.
            workflow.logger.info("no answer: %s: %s", type(err).__name__, err)
            return ""
        return str(result.final_output or "")
