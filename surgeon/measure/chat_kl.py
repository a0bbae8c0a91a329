"""How far a model is from its parent where users meet it: in conversation.

The parent answers each prompt greedily once (surgeon/answers.py caches it); the model is then
teacher-forced on those answers. Per answer token: KL(parent || model) and whether both pick the
same top token. Per prompt: whether the model's greedy answer would start with the same 16 tokens
as the parent's, which teacher forcing tells exactly (greedy decoding follows the parent's tokens
for as long as its argmax equals them).
"""

from __future__ import annotations

import torch

from ..chat import chat_ids
from .metrics import log_probabilities

FIRST_TOKENS = 16


@torch.inference_mode()
def chat_compare(
    model, parent, tokenizer, chats: list[list[dict]], answer_ids: list[list[int]], batch: int = 8
) -> dict:
    """chats: conversations ending with the parent's answer; answer_ids: that answer's token ids."""
    kls, agree, first_model, first_parent = [], [], [], []
    rows = [_row(tokenizer, chat, ids) for chat, ids in zip(chats, answer_ids, strict=True) if ids]
    device = next(model.parameters()).device
    for start in range(0, len(rows), batch):
        group = rows[start : start + batch]
        width = max(len(ids) for ids, _ in group)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(group), width), pad, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for i, (row, _) in enumerate(group):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        ids, mask = ids.to(device), mask.to(device)
        mine = model(input_ids=ids, attention_mask=mask).logits.float()
        theirs = parent(input_ids=ids, attention_mask=mask).logits.float()
        for i, (row, answer_start) in enumerate(group):
            # Positions answer_start-1 .. len-2 predict the answer's tokens.
            span = slice(answer_start - 1, len(row) - 1)
            p_log = log_probabilities(theirs[i, span].clone())
            q_log = log_probabilities(mine[i, span].clone())
            kls.append((p_log.exp() * (p_log - q_log)).sum(-1).clamp_min(0).cpu())
            target = ids[i, answer_start : len(row)]
            my_top, their_top = mine[i, span].argmax(-1), theirs[i, span].argmax(-1)
            agree.append((my_top == their_top).cpu())
            first_model.append(bool((my_top[:FIRST_TOKENS] == target[:FIRST_TOKENS]).all()))
            first_parent.append(bool((their_top[:FIRST_TOKENS] == target[:FIRST_TOKENS]).all()))
    kl = torch.cat(kls).double()
    return {
        "chat_kl_mean": float(kl.mean()),
        "chat_kl_median": float(kl.median()),
        "chat_kl_p99": float(torch.quantile(kl, 0.99)),
        "chat_top1": float(torch.cat(agree).float().mean()),
        "chat_first16": sum(first_model) / len(first_model),
        # The parent against its own answers: 1.0 unless the engine's and this forward's numerics
        # break a near-tie differently (a sanity check on the reference).
        "parent_first16": sum(first_parent) / len(first_parent),
        "prompts": len(rows),
        "tokens": int(kl.numel()),
    }


def _row(tokenizer, chat: list[dict], answer: list[int]) -> tuple[list[int], int]:
    """(prompt ids + answer ids, where the answer starts)."""
    prompt = chat_ids(tokenizer, chat[:-1], generation_prompt=True)
    return prompt + list(answer), len(prompt)
