"""Run a frozen LM's shared prompt opening once, not once per training example.

Every image question starts with the same chat-template opening (SmolLM2's system prompt and
"<|im_start|>user\\n": 24 of about 56 tokens at 16 image tokens) before its image. While no LM
parameter trains, that opening's keys and values never change, so they are computed once and each
step runs the LM on the rest of the sequence only. The result is the full forward's: the opening
depends on nothing that trains, and positions and masks continue from it as generation's do.

Only for LMs whose forward takes a plain DynamicCache as given (Llama, Qwen2, Qwen3): sparse
attention keeps indexer keys beside its cache and Gemma and Mistral slide windows, so those run the
whole sequence, as does any LM with LoRA or unfrozen layers.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..families import has_plain_cache

MAX_OPENINGS = 32  # distinct openings kept (each well under a megabyte for a small LM)


class SharedPrefix:
    """`split(lm, input_ids, attention_mask, targets)` -> (start, cache): the batch's leading
    positions that every row shares and that score nothing, as a cache; the forward runs from `start`."""

    def __init__(self, image_token_id: int):
        self.image_token_id = image_token_id
        self._states: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def split(self, lm, input_ids: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor):
        start = self._shared_length(input_ids, attention_mask, targets)
        if start == 0 or not has_plain_cache(lm.config.model_type) or any(p.requires_grad for p in lm.parameters()):
            return 0, None
        device = input_ids.device
        autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        key = (tuple(input_ids[0, :start].tolist()), autocast, str(device))
        if key not in self._states:
            if len(self._states) >= MAX_OPENINGS:  # jsonl chats may open differently: keep the newest
                del self._states[next(iter(self._states))]
            with torch.no_grad():
                out = lm.model(input_ids=input_ids[:1, :start], use_cache=True)
            self._states[key] = [(layer.keys, layer.values) for layer in out.cache.layers]
        rows = input_ids.shape[0]
        data = [(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for k, v in self._states[key]]
        return start, DynamicCache(ddp_cache_data=data)

    def _shared_length(self, input_ids, attention_mask, targets) -> int:
        """Leading positions equal in every row, unpadded, before any image and any scored target,
        leaving at least one position to run."""
        same = (input_ids == input_ids[:1]).all(0) & (attention_mask == 1).all(0)
        same &= input_ids[0] != self.image_token_id
        same &= (targets == -100).all(0)
        differs = (~same).nonzero()
        length = int(differs[0]) if len(differs) else input_ids.shape[1]
        return min(length, input_ids.shape[1] - 1)
