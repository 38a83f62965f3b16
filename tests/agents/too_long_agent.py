"""An agent whose prompts do not fit the policy's context: one through the Anthropic SDK (from
ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY), one through the OpenAI SDK, and FLOOD more through the
OpenAI SDK (0 unless set); all are refused (400). It then makes one call that fits and reports
reward 0.5."""

from __future__ import annotations

import asyncio
import contextlib
import os

import anthropic
import httpx
import openai

TOO_LONG = "x" * 5000  # the reference policy's context is 2048 tokens


async def main() -> None:
    chat = openai.AsyncOpenAI(max_retries=0)
    claude = anthropic.AsyncAnthropic(max_retries=0)
    try:
        await claude.messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": TOO_LONG}]
        )
    except anthropic.BadRequestError as err:
        print("refused:", err.status_code, err.body)
    try:
        await chat.responses.create(model="m", input=TOO_LONG, max_output_tokens=4)
    except openai.BadRequestError as err:
        print("refused:", err.status_code, err.body)
    for _ in range(int(os.environ.get("FLOOD", "0"))):
        with contextlib.suppress(openai.BadRequestError):
            await chat.responses.create(model="m", input=TOO_LONG, max_output_tokens=4)
    await chat.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    async with httpx.AsyncClient() as http:
        response = await http.post(
            os.environ["DARL_RESULT_URL"],
            json={"reward": 0.5},
            headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"},
        )
        response.raise_for_status()


if __name__ == "__main__":
    asyncio.run(main())
