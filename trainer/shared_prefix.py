"""Log-probs of a batch's response tokens with each group's shared prompt prefix computed once:
the members of a GRPO group (a branching group's above all: they share the seed's replayed
calls) send the same first prompt tokens, so the model runs over those tokens once, and every
member's continuation (the rest of its prompt and its response) attends to that one pass's
keys and values: one forward pass over the groups' prefixes, one over all continuations.
Gradients flow back through the shared pass to the weights, summed over the members, as the
members' separate passes would give them.

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
    rows = [int(i) for i in index]
    prompts = [_prompt(data, i) for i in rows]
    shared_groups: list[tuple[list[int], int]] = []
    alone: list[int] = []
    for places in _groups(data, rows):
        shared = _shared_length([prompts[p] for p in places])
        if len(places) < 2 or shared < min_tokens:
            alone += places
        else:
            shared_groups.append((places, shared))
    response_len = data.batch["responses"].shape[1]
    log_probs = torch.zeros((len(rows), response_len))
    entropy = torch.zeros((len(rows), response_len)) if with_entropy else None
    parts = []
    if shared_groups:
        parts.append(
            (
                [p for places, _ in shared_groups for p in places],
                _shared_groups_log_probs(model, data, rows, prompts, shared_groups, with_entropy),
            )
        )
    if alone:
        parts.append((alone, per_row_log_probs(model, data, index[alone], with_entropy)))
    for places, (lp, ent) in parts:
        log_probs[places] = lp
        if entropy is not None and ent is not None:
            entropy[places] = ent
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
    if shortest < 2:
        return 0
    heads = torch.stack([p[: shortest - 1] for p in prompts])
    differs = (heads != heads[0]).any(0).nonzero()
    return int(differs[0]) if len(differs) else shortest - 1


def _shared_groups_log_probs(
    model: Qwen2ForCausalLM,
    data: DataProto,
    rows: Sequence[int],
    prompts: Sequence[torch.Tensor],
    groups: Sequence[tuple[list[int], int]],
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One pass over every group's shared prefix (left-padded to the longest, as prompts
    are), then one over every member's continuation (the rest of its prompt and its
    response, right-padded) attending to its group's prefix. Rows come out in the order of
    the groups' places."""
    b = data.batch
    prompt_len, response_len = b["prompts"].shape[1], b["responses"].shape[1]
    longest = max(shared for _, shared in groups)
    prefixes = torch.zeros((len(groups), longest), dtype=torch.int64)
    prefix_mask = torch.zeros((len(groups), longest), dtype=torch.int64)
    for g, (places, shared) in enumerate(groups):
        prefixes[g, longest - shared :] = prompts[places[0]][:shared]
        prefix_mask[g, longest - shared :] = 1
    cache = DynamicCache()
    model(
        input_ids=prefixes,
        attention_mask=prefix_mask,
        position_ids=(prefix_mask.cumsum(1) - 1).clamp(min=0),
        past_key_values=cache,
        use_cache=True,
    )
    members = [(g, place) for g, (places, _) in enumerate(groups) for place in places]
    cache.batch_select_indices(torch.tensor([g for g, _ in members]))
    rests = [prompts[place][groups[g][1] :] for g, place in members]
    width = max(len(r) for r in rests) + response_len
    tokens = torch.zeros((len(members), width), dtype=torch.int64)
    mask = torch.zeros((len(members), width), dtype=torch.int64)
    for k, ((_, place), rest) in enumerate(zip(members, rests, strict=True)):
        tokens[k, : len(rest)] = rest
        tokens[k, len(rest) : len(rest) + response_len] = b["responses"][rows[place]]
        mask[k, : len(rest)] = 1
        mask[k, len(rest) : len(rest) + response_len] = b["attention_mask"][
            rows[place], prompt_len:
        ]
    starts = torch.tensor([groups[g][1] for g, _ in members])
    out = model(
        input_ids=tokens,
        attention_mask=torch.cat([prefix_mask[[g for g, _ in members]], mask], 1),
        position_ids=starts.unsqueeze(1) + torch.arange(width).unsqueeze(0),
        past_key_values=cache,
        use_cache=True,
    )
    # A member's response token j is predicted at its continuation's place len(rest) - 1 + j.
    first = torch.tensor([len(r) - 1 for r in rests])
    at = first.unsqueeze(1) + torch.arange(response_len).unsqueeze(0)
    logits = out.logits.gather(1, at.unsqueeze(-1).expand(-1, -1, out.logits.shape[-1]))
    responses = b["responses"][[rows[place] for _, place in members]]
    return _chosen(logits.float(), responses, with_entropy)
