"""An agent written for Agent Lightning v1.0's runner, unchanged: a class whose `run()` reads
AGL_OPENAI_BASE_URL / AGL_KEY, makes a call, and posts a reward event to AGL_EVENT_URL."""

from __future__ import annotations

import os

import httpx
from openai import AsyncOpenAI


class AglStyleAgent:
    async def run(self) -> None:
        key = os.environ["AGL_KEY"]
        client = AsyncOpenAI(base_url=os.environ["AGL_OPENAI_BASE_URL"], api_key=key)
        reply = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": os.environ["QUESTION"]}],
            max_tokens=4,
        )
        value = 0.25 if reply.choices[0].message.content is not None else 0.0
        async with httpx.AsyncClient() as http:
            response = await http.post(
                os.environ["AGL_EVENT_URL"],
                json={"event_type": "reward", "data": {"value": value}},
                headers={"Authorization": f"Bearer {key}"},
            )
            response.raise_for_status()
