"""DarlModelProvider: the OpenAI Agents SDK's models for an agent workflow's model activities,
chat-completions models on an OpenAI client aimed at the running activity's DARL attempt. This
module imports the SDK; darl.temporal_agents imports it only when the name is asked for."""

from __future__ import annotations

from agents import Model, ModelProvider, OpenAIChatCompletionsModel
from openai import AsyncOpenAI

from darl.temporal_agents.attempt import current_activity_attempt
from darl.temporal_agents.transport import darl_async_httpx_client

# The model name when the agent names none: what process agents get as OPENAI_MODEL.
DEFAULT_MODEL = "policy"


class DarlModelProvider(ModelProvider):
    """Give it to `OpenAIAgentsPlugin(model_provider=...)`: `get_model` runs in each model
    activity and builds an `OpenAIChatCompletionsModel` on an `AsyncOpenAI` with the attempt's
    base_url and token, whose requests carry the activity's `Idempotency-Key` (the OpenAI
    client's own retries of a request keep its key). One per worker: its httpx client pools
    the connections."""

    def __init__(self, *, default_model: str = DEFAULT_MODEL, max_retries: int = 6) -> None:
        self._default_model = default_model
        self._max_retries = max_retries
        self._http = darl_async_httpx_client()

    def get_model(self, model_name: str | None) -> Model:
        """The model for this activity's attempt; NoAgentAttemptError outside an activity of an
        agent workflow DARL started, or on a worker without DarlPlugin."""
        running = current_activity_attempt()
        client = AsyncOpenAI(
            base_url=running.attempt.base_url,
            api_key=running.attempt.token,
            max_retries=self._max_retries,
            # Typed as an httpx2 client; the SDK takes an httpx one as well (LangChain's too).
            http_client=self._http,  # type: ignore[arg-type]
        )
        return OpenAIChatCompletionsModel(
            model=model_name or self._default_model, openai_client=client
        )

    async def aclose(self) -> None:
        await self._http.aclose()
