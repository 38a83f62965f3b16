"""The tutorial's agent: an ordinary OpenAI SDK program. It knows DARL only by the environment
a rollout hands it: the task in DARL_TASK, the gateway and the rollout's token in
OPENAI_BASE_URL and OPENAI_API_KEY (which the SDK reads by itself), and where to report its
answer in DARL_RESULT_URL. Without DARL_RESULT_URL it just prints the answer, so you can run
it by hand against any OpenAI-compatible server.
"""

import json
import os

import httpx
from openai import OpenAI


def main() -> None:
    task = json.loads(os.environ["DARL_TASK"])  # {"prompt": "7=", "answer": "7"}
    client = OpenAI()  # base URL and key from OPENAI_BASE_URL, OPENAI_API_KEY
    completion = client.completions.create(model="policy", prompt=task["prompt"], max_tokens=2)
    answer = completion.choices[0].text
    print(f"prompt {task['prompt']!r} -> answer {answer!r}")

    result_url = os.environ.get("DARL_RESULT_URL")
    if result_url:  # under DARL: report the answer; reward.py scores it
        token = os.environ["OPENAI_API_KEY"]
        reply = httpx.post(
            result_url,
            json={"answer": answer},
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        )
        reply.raise_for_status()


if __name__ == "__main__":
    main()
