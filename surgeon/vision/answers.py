"""Ask a grafted VLM image questions and score its answers (greedy decoding, exact match).

Examples are grouped by prompt length so a batch needs no padding: every row's positions and
masks are those of a batch of one, and the answers equal what generate() gives each example alone.
The tower runs once per image; the shuffled control re-pairs the same tower outputs with other
examples' questions (a derangement), which tells whether answers come from the pixels.
"""

from __future__ import annotations

import random
import re
from collections import Counter, defaultdict

import torch
from tqdm.auto import tqdm

from .features import tower_features
from .image_set import VisionExample

MAX_NEW_TOKENS = 8


def normalise(text: str) -> str:
    """Lower case, first line, no surrounding punctuation: "Red." and "red" are the same answer."""
    line = text.strip().split("\n", 1)[0].strip().lower()
    return re.sub(r"^[\W_]+|[\W_]+$", "", line)


@torch.no_grad()
def tower_outputs(vlm, processor, examples: list[VisionExample], batch: int = 32) -> list[torch.Tensor]:
    """Per example, its images' tower tokens (images, tokens, channels), as healing computes them."""
    computed = tower_features(vlm, processor, examples, batch=batch, desc="tower")
    return [computed.features[start:end] for start, end in computed.spans]


@torch.no_grad()
def greedy_answers(
    vlm,
    tokenizer,
    examples: list[VisionExample],
    tower: list[torch.Tensor],
    pairing: list[int] | None = None,
    batch: int = 16,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> list[str]:
    """The model's answer to each example's question, about example pairing[i]'s images."""
    pairing = pairing or list(range(len(examples)))
    prompts = [_prompt_ids(e) for e in examples]
    groups: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(prompts):
        groups[len(ids)].append(i)
    answers = [""] * len(examples)
    stops = {t for t in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")) if isinstance(t, int)}
    lm = vlm.language_model
    work = [
        (length, members[s : s + batch]) for length, members in groups.items() for s in range(0, len(members), batch)
    ]
    for _, members in tqdm(work, desc="answers", unit="batch", leave=False):
        ids = torch.tensor([prompts[i] for i in members])
        tokens = [tower[pairing[i]] for i in members]
        if any(
            t.shape[0] != examples[i].ids.count(vlm.config.image_token_id) // vlm.config.image_seq_length
            for t, i in zip(tokens, members)
        ):
            raise ValueError("shuffled pairing must keep each question's image count")
        with _autocast(vlm):
            embeds = vlm.embed(ids, tower_tokens=torch.cat(tokens) if tokens else None)
            out = lm(inputs_embeds=embeds, use_cache=True)
            generated, done = [], torch.zeros(len(members), dtype=torch.bool)
            for _ in range(max_new_tokens):
                next_ids = out.logits[:, -1].argmax(-1)
                generated.append(next_ids)
                done |= torch.tensor([int(t) in stops for t in next_ids])
                if done.all():
                    break
                out = lm(input_ids=next_ids[:, None], cache=out.cache, use_cache=True)
        rows = torch.stack(generated, 1).tolist()
        for i, row in zip(members, rows):
            cut = next((k for k, t in enumerate(row) if t in stops), len(row))
            answers[i] = tokenizer.decode(row[:cut], skip_special_tokens=True)
    return answers


def derangement(n: int, seed: int = 0) -> list[int]:
    """A permutation with no fixed point: every question meets another example's image."""
    if n < 2:
        return list(range(n))
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return [order[(order.index(i) + 1) % n] for i in range(n)]


def score(examples: list[VisionExample], answers: list[str]) -> dict:
    """Accuracy overall and per kind, and the chance level a prior-only guesser reaches (always
    the commonest answer of the kind)."""
    right, total, by_kind_answers = Counter(), Counter(), defaultdict(Counter)
    for example, answer in zip(examples, answers):
        total[example.kind] += 1
        right[example.kind] += normalise(answer) == normalise(example.answer)
        by_kind_answers[example.kind][normalise(example.answer)] += 1
    n = sum(total.values())
    chance = sum(c.most_common(1)[0][1] for c in by_kind_answers.values()) / max(n, 1)
    return {
        "accuracy": sum(right.values()) / max(n, 1),
        "examples": n,
        "chance": chance,
        **{f"accuracy_{kind}": right[kind] / total[kind] for kind in sorted(total)},
        **{f"examples_{kind}": total[kind] for kind in sorted(total)},
    }


def _prompt_ids(example: VisionExample) -> list[int]:
    """The example's ids up to the first answer token (the prompt generation continues from)."""
    first = next((t for t, m in enumerate(example.mask) if m), len(example.ids))
    return example.ids[:first]


def _autocast(vlm):
    from ..training.driver import resolve_precision

    precision = resolve_precision("auto", next(vlm.parameters()).device)
    if precision == "fp32" or vlm.projector_dtype != torch.float32:
        from contextlib import nullcontext

        return nullcontext()
    return torch.autocast(
        next(vlm.parameters()).device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16
    )
