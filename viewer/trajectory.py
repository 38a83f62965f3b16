"""A rollout's trajectory as the store keeps it: an attempt's calls, failed calls, incidents and
events, the tail of its agent's log, and the text of its tokens. Light to import (no torch):
`darl trajectory` reads through it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from darl.activities.runners.local import LOG_FILE
from darl.gateway.store.base import TrajectoryStore
from darl.gateway.store.record import CallRecord, FailedCall
from darl.workflows.training_config import TrainingConfig

log = logging.getLogger(__name__)

LOG_TAIL_BYTES = 16_000


@dataclass(frozen=True)
class Trajectory:
    """What the store holds of one attempt of a rollout."""

    rollout_id: str
    attempt: int | None
    attempts: list[int]
    calls: list[CallRecord]
    failed_calls: list[FailedCall]
    incidents: list[str]
    events: list[dict[str, Any]]

    @property
    def in_store(self) -> bool:
        return bool(self.attempts)


async def load_trajectory(
    store: TrajectoryStore, rollout_id: str, attempt: int | None
) -> Trajectory:
    """The attempt's calls in order (default: the last attempt in the store)."""
    attempts = await store.attempts(rollout_id)
    chosen = attempt if attempt is not None else (attempts[-1] if attempts else None)
    if chosen is None or chosen not in attempts:
        return Trajectory(rollout_id, chosen, attempts, [], [], [], [])
    return Trajectory(
        rollout_id,
        chosen,
        attempts,
        await store.read(rollout_id, chosen),
        await store.failed_calls(rollout_id, chosen),
        await store.incidents(rollout_id, chosen),
        await store.events(rollout_id, chosen),
    )


def agent_log_tail(agents_dir: Path, rollout_id: str, attempt: int | None) -> str | None:
    """The end of a local agent's log (activities/runners/local.py); None when this machine
    has none (another worker's machine, an HTTP or Kubernetes agent)."""
    if attempt is None:
        return None
    path = agents_dir / rollout_id / f"attempt-{attempt}" / LOG_FILE
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - LOG_TAIL_BYTES))
            return f.read().decode("utf-8", errors="replace")
    except (FileNotFoundError, NotADirectoryError):
        return None


@lru_cache(maxsize=8)
def _tokenizer(model_dir: str) -> Tokenizer | None:
    path = Path(model_dir) / "tokenizer.json"
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - tokenizers raises its own untyped Exception
        log.info("no tokenizer at %s (%s): token ids shown without their text", path, err)
        return None


class TokenText:
    """Text of token ids as the model that served the calls decodes them, never another's.

    Candidates: the policy server that answered (`served`: what its `/detokenize` said) and
    the run's model directory's tokenizer; the first that reads every call as it was made
    decodes them all: each completion token as the server said when it answered (the token
    strings it returned with the logprobs), and each prompt so that it holds the text the
    agent sent (its prompt, or every message's text). Without one, a completion token shows
    the string the server returned and any other token its id."""

    def __init__(
        self,
        records: Sequence[CallRecord],
        served: Mapping[int, str] | None = None,
        config: TrainingConfig | None = None,
    ) -> None:
        self._returned: dict[int, str] = {}
        for record in records:
            for token_id, text in zip(
                record.completion_token_ids(), returned_token_texts(record), strict=False
            ):
                if text is not None:
                    self._returned.setdefault(token_id, text)
        candidates: list[tuple[str, Callable[[int], str | None]]] = []
        if served:
            candidates.append(("the policy server that answered the calls", served.get))
        model_dir = config.backend.model_dir if config is not None else None
        tokenizer = _tokenizer(model_dir) if model_dir else None
        if tokenizer is not None:
            candidates.append(
                (
                    f"the run's model directory ({model_dir})",
                    lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False),
                )
            )
        # What decodes the tokens (None: only the completion tokens' returned strings).
        self.source: str | None = None
        self._decode: Callable[[int], str | None] | None = None
        for name, decode in candidates:
            if _reads_every_call(decode, records, self._returned):
                self.source, self._decode = name, decode
                break

    def text(self, token_id: int) -> str | None:
        if self._decode is not None:
            decoded = self._decode(token_id)
            if decoded is not None:
                return decoded
        return self._returned.get(token_id)


def _reads_every_call(
    decode: Callable[[int], str | None],
    records: Sequence[CallRecord],
    returned: Mapping[int, str],
) -> bool:
    """Whether `decode` is the serving model's own: it decodes each completion token as the
    server returned it (there must be some) and each prompt as the agent sent it."""
    if not returned or any(decode(i) != text for i, text in returned.items()):
        return False
    return all(_reads_the_prompt(decode, record) for record in records)


def _reads_the_prompt(decode: Callable[[int], str | None], record: CallRecord) -> bool:
    """Whether `decode` turns the call's prompt ids into the text the agent sent: its prompt,
    or a rendering that holds each of its messages' text."""
    pieces = [decode(i) for i in record.prompt_token_ids]
    if any(piece is None for piece in pieces):
        return False
    decoded = "".join(piece for piece in pieces if piece is not None)
    prompt = record.request.get("prompt")
    if isinstance(prompt, str):
        return decoded == prompt
    texts = [
        message["content"]
        for message in record.request.get("messages") or []
        if isinstance(message, dict) and isinstance(message.get("content"), str)
    ]
    return all(text in decoded for text in texts)


def returned_token_texts(record: CallRecord) -> list[str | None]:
    """The token strings of the completion as the server returned them with its logprobs."""
    choices = record.response.get("choices") or [{}]
    logprobs = choices[0].get("logprobs") or {}
    if "content" in logprobs:
        return [entry.get("token") for entry in logprobs.get("content") or []]
    return list(logprobs.get("tokens") or [])
