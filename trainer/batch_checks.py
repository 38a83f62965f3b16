"""What every trainer backend checks of a batch before it trains on it: the keys aggregation
puts in a DataProto, consistent shapes, token ids inside the vocabulary, finite log-probs."""

from __future__ import annotations

import torch
from verl import DataProto

from darl.trainer.backend import BatchError

# What trainer/aggregation.py puts in a DataProto's batch and every backend trains on.
REQUIRED_KEYS = (
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "old_log_probs",
    "token_level_rewards",
)


def validate_batch(batch: DataProto, vocab_size: int) -> DataProto:
    """The batch if it has trainer/aggregation.py's keys (REQUIRED_KEYS) with consistent
    shapes, token ids below `vocab_size` and finite rollout log-probs; else BatchError."""
    present = set(batch.batch.keys())
    missing = [key for key in REQUIRED_KEYS if key not in present]
    if missing:
        raise BatchError(f"the batch lacks {missing}")
    b = batch.batch
    rows, prompt_len = b["prompts"].shape
    response_len = b["responses"].shape[1]
    expected = {
        "input_ids": (rows, prompt_len + response_len),
        "attention_mask": (rows, prompt_len + response_len),
        "position_ids": (rows, prompt_len + response_len),
        "response_mask": (rows, response_len),
        "old_log_probs": (rows, response_len),
        "token_level_rewards": (rows, response_len),
    }
    for key, shape in expected.items():
        if tuple(b[key].shape) != shape:
            raise BatchError(f"{key} has shape {tuple(b[key].shape)}, expected {shape}")
    if prompt_len == 0 or not b["response_mask"].any():
        raise BatchError("the batch has no prompt or no trainable response token")
    ids = b["input_ids"]
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise BatchError(f"token ids must lie in [0, {vocab_size})")
    if not torch.isfinite(b["old_log_probs"][b["response_mask"].bool()]).all():
        raise BatchError("old_log_probs holds a non-finite value on a trained token")
    return batch
