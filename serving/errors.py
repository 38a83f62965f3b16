"""The policy servers' exceptions (`darl.serving`), under `ServingError`:

ServingError
├── GenerationRejectedError   a request the engine cannot serve (400)      ValueError
│   └── ContextLengthExceededError  a prompt over the model's context (400, vLLM's words)
├── ToolSpecError             tools or a tool_choice it cannot serve (400) ValueError
├── BadRequestError           any other request answered 400               ValueError
├── GenerationFailedError     the engine failed on the request's batch (500) RuntimeError
├── ModelSpecError            a tiny model spec that cannot be built       ValueError
├── ModelDirError             not a Hugging Face model directory           ValueError
└── VllmServerError           vLLM did not start, died, or refused a label RuntimeError
"""

from __future__ import annotations

from darl.workflows.errors import DarlError


class ServingError(DarlError):
    """Raised by `darl.serving`: a policy server's request, model or vLLM launch failed."""
