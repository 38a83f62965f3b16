"""The user's side of the test agents, outside the workflow sandbox: the OpenAI agent's function
tool, an activity that reports the attempt it runs under, and a LangGraph graph whose nodes call
ChatOpenAI through DARL's httpx clients."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, TypedDict

from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from temporalio import activity

from darl.temporal_agents import current_attempt, darl_async_httpx_client, darl_httpx_client


@activity.defn
async def add(a: int, b: int) -> str:
    """Adds two numbers (the agent's tool), saying which rollout it ran for."""
    attempt = current_attempt()
    return f"{a + b} for rollout {attempt.rollout_id if attempt else None}"


@activity.defn
async def attempt_seen() -> dict[str, Any] | None:
    attempt = current_attempt()
    return attempt.to_value() if attempt else None


# The user's model client, as LangChain users write it: only the httpx clients are DARL's (the
# URL and key are replaced per request by the running activity's attempt).
llm = ChatOpenAI(
    model="policy",
    base_url="http://model.invalid/v1",
    api_key="unused",
    max_retries=0,
    http_client=darl_httpx_client(timeout=30),
    http_async_client=darl_async_httpx_client(timeout=30),
)


class AnswerState(TypedDict):
    question: str
    answer: str


async def ask_twice(state: AnswerState) -> dict[str, str]:
    first = await llm.ainvoke(state["question"])
    second = await llm.ainvoke(f"check {first.content}")
    return {"answer": str(second.content)}


def ask_in_thread(state: AnswerState) -> dict[str, str]:
    reply = llm.invoke(state["answer"])
    return {"answer": str(reply.content)}


def answer_graph() -> StateGraph[AnswerState]:
    """A new graph per LangGraphPlugin (the plugin takes the activity options out of its
    nodes' metadata)."""
    in_activity = {"execute_in": "activity", "start_to_close_timeout": timedelta(seconds=30)}
    built = StateGraph(AnswerState)
    built.add_node("ask_twice", ask_twice, metadata=in_activity)
    built.add_node("ask_in_thread", ask_in_thread, metadata=in_activity)
    built.add_edge(START, "ask_twice")
    built.add_edge("ask_twice", "ask_in_thread")
    built.add_edge("ask_in_thread", END)
    return built
