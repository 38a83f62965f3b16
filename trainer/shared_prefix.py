"""Log-probs of a batch's response tokens with each group's shared prompt prefix computed once:
the members of a GRPO group (a branching group's above all: they share the seed's replayed
calls) send the same first prompt tokens, so the model runs over those tokens once, and every
member's continuation (the rest of its prompt and its response) attends to that one pass's
keys and values. Gradients flow back through the shared pass to the weights, summed over the
members, as the members' separate passes would give them.

Equal to the per-row computation (`per_row_log_probs`) within float tolerance: the positions,
the causal mask and the tokens each logit sees are the same; only the order of the sums in the
matmuls differs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, Qwen2ForCausalLM
from verl import DataProto
from verl.utils.torch_functional import entropy_from_logits


def per_row_log_probs(
    model: Qwen2ForCausalLM, data: DataProto, index: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the response tokens of rows `index` under `model`, one forward pass per
    row (the logits at P-1 .. P+R-2 predict them), and the entropy of those distributions."""
    b = data.batch
    prompt_len = b["prompts"].shape[1]
    response_len = b["responses"].shape[1]
    out = model(
        input_ids=b["input_ids"][index],
        attention_mask=b["attention_mask"][index],
        position_ids=b["position_ids"][index],
        use_cache=False,
    )
    logits = out.logits[:, prompt_len - 1 : prompt_len + response_len - 1].float()
    return _chosen(logits, b["responses"][index], with_entropy)


def shared_prefix_log_probs(
    model: Qwen2ForCausalLM,
    data: DataProto,
    index: torch.Tensor,
    with_entropy: bool,
    min_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What `per_row_log_probs` gives, with the prompt prefix that the rows of one group
    (`uid`) among `index` share computed once for the group, where it is at least
    `min_tokens` long. Rows in no such group are computed one pass per row."""
    b = data.batch
    response_len = b["responses"].shape[1]
    rows = [int(i) for i in index]
    prompts = [_prompt(data, i) for i in rows]
    log_probs = torch.zeros((len(rows), response_len))
    entropy = torch.zeros((len(rows), response_len)) if with_entropy else None
    alone: list[int] = []
    for places in _groups(data, rows):
        shared = _shared_length([prompts[p] for p in places])
        if len(places) < 2 or shared < min_tokens:
            alone += places
            continue
        lp, ent = _group_log_probs(
            model,
            data,
            [rows[p] for p in places],
            [prompts[p] for p in places],
            shared,
            with_entropy,
        )
        log_probs[places] = lp
        if entropy is not None and ent is not None:
            entropy[places] = ent
    if alone:
        lp, ent = per_row_log_probs(model, data, index[alone], with_entropy)
        log_probs[alone] = lp
        if entropy is not None and ent is not None:
            entropy[alone] = ent
    return log_probs, entropy


def _chosen(
    logits: torch.Tensor, responses: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    log_probs = torch.log_softmax(logits, dim=-1)
    chosen = log_probs.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    return chosen, entropy_from_logits(logits) if with_entropy else None


def _prompt(data: DataProto, row: int) -> torch.Tensor:
    """The row's prompt without its left padding."""
    prompt_len = data.batch["prompts"].shape[1]
    real = data.batch["attention_mask"][row, :prompt_len].bool()
    return data.batch["prompts"][row][real]


def _groups(data: DataProto, rows: Sequence[int]) -> list[list[int]]:
    """Places in `rows` by group id, in order of first appearance."""
    by_uid: dict[object, list[int]] = {}
    for place, row in enumerate(rows):
        by_uid.setdefault(data.non_tensor_batch["uid"][row], []).append(place)
    return list(by_uid.values())


def _shared_length(prompts: Sequence[torch.Tensor]) -> int:
    """Tokens the prompts share from their start, short of each one's last token: the logit
    at a prompt's last token predicts its first response token, so that token is in every
    member's continuation."""
    shortest = min(len(p) for p in prompts)
    shared = 0
    while shared < shortest - 1 and all(p[shared] == prompts[0][shared] for p in prompts[1:]):
        shared += 1
    return shared


def _group_log_probs(
    model: Qwen2ForCausalLM,
    data: DataProto,
    rows: Sequence[int],
    prompts: Sequence[torch.Tensor],
    shared: int,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One pass over the group's shared prefix, then one over its members' continuations
    (the rest of each prompt and the response, right-padded) attending to it."""
    b = data.batch
    prompt_len = b["prompts"].shape[1]
    responses = b["responses"][list(rows)]
    response_len = responses.shape[1]
    cache = DynamicCache()
    model(
        input_ids=prompts[0][:shared].unsqueeze(0),
        position_ids=torch.arange(shared).unsqueeze(0),
        past_key_values=cache,
        use_cache=True,
    )
    cache.batch_repeat_interleave(len(rows))
    rests = [p[shared:] for p in prompts]
    width = max(len(r) for r in rests) + response_len
    tokens = torch.zeros((len(rows), width), dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for k, (row, rest) in enumerate(zip(rows, rests, strict=True)):
        tokens[k, : len(rest)] = rest
        tokens[k, len(rest) : len(rest) + response_len] = b["responses"][row]
        mask[k, : len(rest)] = 1
        mask[k, len(rest) : len(rest) + response_len] = b["attention_mask"][row, prompt_len:]
    out = model(
        input_ids=tokens,
        attention_mask=torch.cat([torch.ones((len(rows), shared), dtype=torch.int64), mask], 1),
        position_ids=(shared + torch.arange(width)).expand(len(rows), width),
        past_key_values=cache,
        use_cache=True,
    )
    # A member's response token j is predicted at its continuation's place len(rest) - 1 + j.
    starts = torch.tensor([len(r) - 1 for r in rests])
    places = starts.unsqueeze(1) + torch.arange(response_len).unsqueeze(0)
    logits = out.logits.gather(1, places.unsqueeze(-1).expand(-1, -1, out.logits.shape[-1])).float()
    return _chosen(logits, responses, with_entropy)
