"""A LangGraph agent written as a Temporal workflow (temporalio-langgraph): a StateGraph whose
`model` node, run as an activity, asks a LangChain `ChatOpenAI` for the next step, and whose
`tools` node, an activity too, runs the calculator. The task, instructions and tool are those
of examples/agents_sdk_calculator/agent.py. Its one touch of DARL is the model's HTTP clients:
DARL's transport sends each call to the gateway of the rollout attempt that made it."""

from __future__ import annotations

import functools
import json
import operator
from datetime import timedelta
from typing import Annotated, Any, TypedDict

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from langchain_core.messages import convert_to_openai_messages
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph
    from temporalio.langgraph import graph

    from darl.examples.temporal_agents.calculator import OPERATIONS, calculator
    from darl.temporal_agents import darl_async_httpx_client, darl_httpx_client

GRAPH = "calculator-agent"
INSTRUCTIONS = "Compute the answer with the calculator tool, then answer with the number only."
# Tool call, answer, and a spare turn for a model that calls the tool again.
MAX_TURNS = 3
MAX_TOKENS = 160
MODEL = "policy"
ACTIVITY = {"execute_in": "activity", "start_to_close_timeout": timedelta(seconds=60)}


class CalculatorState(TypedDict):
    # OpenAI chat messages: plain JSON, as the state crosses into and out of activities.
    messages: Annotated[list[dict[str, Any]], operator.add]


@functools.cache
def chat_model() -> ChatOpenAI:
    """One model client for the worker: its transport sends each request to the gateway of
    the attempt whose activity makes it, with that attempt's token (so the key here is only a
    placeholder; attempts run concurrently in this one process, so no environment variable
    could say which gateway URL and token a request is for)."""
    return ChatOpenAI(
        model=MODEL,
        api_key="replaced-per-attempt",  # type: ignore[arg-type]  # a str is a SecretStr here
        max_tokens=MAX_TOKENS,  # type: ignore[call-arg]  # an alias of max_completion_tokens
        max_retries=6,
        # DARL: the one change to a LangChain model.
        http_client=darl_httpx_client(),
        http_async_client=darl_async_httpx_client(),
    )


async def call_model(state: CalculatorState) -> dict[str, Any]:
    """The model's next message; its first call must use the tool, as the process agent's."""
    called = any(message["role"] == "tool" for message in state["messages"])
    model = chat_model().bind_tools([calculator], tool_choice="auto" if called else "required")
    reply = await model.ainvoke(state["messages"])
    return {"messages": [convert_to_openai_messages(reply)]}


async def run_tools(state: CalculatorState) -> dict[str, Any]:
    """A tool message for each call of the model's last message."""
    results = []
    for call in state["messages"][-1]["tool_calls"]:
        output = await run_calculator(call["function"]["name"], call["function"]["arguments"])
        results.append({"role": "tool", "tool_call_id": call["id"], "content": output})
    return {"messages": results}


async def run_calculator(name: str, arguments: str) -> str:
    """The calculator's answer, or an error the model reads, for a call it got wrong."""
    if name != calculator.__name__:
        return f"error: no tool {name!r}"
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        return f"error: the arguments are not JSON: {arguments!r}"
    if not (
        isinstance(args, dict)
        and set(args) == {"a", "b", "op"}
        and all(type(args[k]) is int for k in "ab")
        and args["op"] in OPERATIONS
    ):
        return 'error: the arguments are {"a": <integer>, "b": <integer>, "op": add|sub|mul}'
    return await calculator(args["a"], args["b"], args["op"])


async def after_model(state: CalculatorState) -> str:
    """To the tools while the model calls one and has turns left; else the end (async: the
    workflow's event loop runs no threads, where LangGraph would run a plain function)."""
    turns = sum(message["role"] == "assistant" for message in state["messages"])
    if state["messages"][-1].get("tool_calls") and turns < MAX_TURNS:
        return "tools"
    return END


def build_graph() -> StateGraph[CalculatorState, Any, Any, Any]:
    """The agent's graph; the worker registers it: `LangGraphPlugin(graphs={GRAPH: ...})`."""
    builder = StateGraph(CalculatorState)
    builder.add_node("model", call_model, metadata=ACTIVITY)
    builder.add_node("tools", run_tools, metadata=ACTIVITY)
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", after_model, ["tools", END])
    builder.add_edge("tools", "model")
    return builder


@workflow.defn
class CalculatorGraphWorkflow:
    @workflow.run
    async def run(self, question: str) -> dict[str, Any]:
        """{"answer": the model's last message when it called no tool, else ""; "calls": the
        number of model calls}."""
        messages = [
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": question},
        ]
        state = await graph(GRAPH).compile().ainvoke({"messages": messages})
        last = state["messages"][-1]
        answer = "" if last.get("tool_calls") else str(last.get("content") or "")
        calls = sum(message["role"] == "assistant" for message in state["messages"])
        return {"answer": answer, "calls": calls}
