"""A rollout's trajectory as the store keeps it: an attempt's calls, failed calls, incidents and
events, the tail of its agent's log, and the text of its tokens. Light to import (no torch):
`darl trajectory` reads through it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from darl.activities.runners.local import LOG_FILE
from darl.gateway.store import CallRecord, FailedCall, TrajectoryStore
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
    """Text of single token ids: from the run's model directory's tokenizer when this machine
    has it, else from the token strings the policy server returned with the logprobs."""

    def __init__(self, config: TrainingConfig | None) -> None:
        model_dir = config.backend.model_dir if config is not None else None
        self.tokenizer = _tokenizer(model_dir) if model_dir else None
        self._known: dict[int, str] = {}

    def learn(self, record: CallRecord) -> None:
        """Remember the text the server gave each completion token of `record`."""
        for token_id, text in zip(
            record.completion_token_ids(), returned_token_texts(record), strict=False
        ):
            if text is not None:
                self._known.setdefault(token_id, text)

    def text(self, token_id: int) -> str | None:
        if self.tokenizer is not None:
            return self.tokenizer.decode([token_id], skip_special_tokens=False)
        return self._known.get(token_id)


def returned_token_texts(record: CallRecord) -> list[str | None]:
    """The token strings of the completion as the server returned them with its logprobs."""
    choices = record.response.get("choices") or [{}]
    logprobs = choices[0].get("logprobs") or {}
    if "content" in logprobs:
        return [entry.get("token") for entry in logprobs.get("content") or []]
    return list(logprobs.get("tokens") or [])
