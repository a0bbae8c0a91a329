"""A small instruction-following check with answers a program can verify.

Capitals, arithmetic, short lists and yes/no facts: easy for an instruction-tuned model, and the
first thing surgery breaks. It answers "does generation survive?", which KL on prose does not.
Greedy decoding through the chat template; each answer is checked by a pattern, not by a judge.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm


@dataclass(frozen=True)
class Item:
    prompt: str
    check: Callable[[str], bool]
    expected: str  # what a reader should see in a right answer


def _has(pattern: str) -> Callable[[str], bool]:
    compiled = re.compile(pattern, re.IGNORECASE)
    return lambda answer: bool(compiled.search(answer))


def _at_least(count: int, *patterns: str) -> Callable[[str], bool]:
    compiled = [re.compile(rf"\b(?:{p})\b", re.IGNORECASE) for p in patterns]
    return lambda answer: sum(bool(c.search(answer)) for c in compiled) >= count


def _yes_no(expected: str) -> Callable[[str], bool]:
    def check(answer: str) -> bool:
        found = re.search(r"\b(yes|no)\b", answer, re.IGNORECASE)
        return bool(found) and found.group(1).lower() == expected

    return check


def _capital(country: str, city: str) -> Item:
    return Item(f"What is the capital of {country}?", _has(rf"\b{city}\b"), city)


ITEMS: tuple[Item, ...] = (
    _capital("France", "Paris"),
    _capital("Japan", "Tokyo"),
    _capital("Italy", "Rome"),
    _capital("Germany", "Berlin"),
    _capital("Spain", "Madrid"),
    _capital("England", "London"),
    _capital("Russia", "Moscow"),
    _capital("China", "Beijing"),
    Item("What is 2 + 2?", _has(r"\b(4|four)\b"), "4"),
    Item("What is 3 + 5?", _has(r"\b(8|eight)\b"), "8"),
    Item("What is 10 - 3?", _has(r"\b(7|seven)\b"), "7"),
    Item("What is 6 times 2?", _has(r"\b(12|twelve)\b"), "12"),
    Item("What is half of 10?", _has(r"\b(5|five)\b"), "5"),
    Item("How many legs does a dog have?", _has(r"\b(4|four)\b"), "4"),
    Item("List the three primary colors.", _at_least(2, "red", "blue", "yellow"), "red, blue, yellow"),
    Item(
        "Name the four seasons of the year.",
        _at_least(3, "spring", "summer", "autumn|fall", "winter"),
        "spring, summer, autumn, winter",
    ),
    Item(
        "List the first five days of the week.",
        _at_least(3, "monday", "tuesday", "wednesday", "thursday", "friday"),
        "Monday ... Friday",
    ),
    Item(
        "Name three planets in our solar system.",
        _at_least(2, "mercury", "venus", "earth", "mars", "jupiter", "saturn", "uranus", "neptune"),
        "three planets",
    ),
    Item("What color is the sky on a clear day?", _has(r"\bblue\b"), "blue"),
    Item("What is the opposite of hot?", _has(r"\bcold\b"), "cold"),
    Item("Is the sun a star? Answer yes or no.", _yes_no("yes"), "yes"),
    Item("Is the Earth flat? Answer yes or no.", _yes_no("no"), "no"),
    Item("Can fish breathe underwater? Answer yes or no.", _yes_no("yes"), "yes"),
    Item("Is ice cold? Answer yes or no.", _yes_no("yes"), "yes"),
    Item("Do cats have wings? Answer yes or no.", _yes_no("no"), "no"),
    Item("Is Paris in France? Answer yes or no.", _yes_no("yes"), "yes"),
)


@torch.inference_mode()
def instruction_check(model, tokenizer, max_new_tokens: int = 40, batch: int = 8) -> dict:
    """{"score": fraction right, "correct": n, "total": n, "answers": [{prompt, answer, ok}]}."""
    answers = []
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        for start in tqdm(range(0, len(ITEMS), batch), desc="instructions", unit="batch", leave=False):
            group = ITEMS[start : start + batch]
            texts = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": item.prompt}], tokenize=False, add_generation_prompt=True
                )
                for item in group
            ]
            inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            inputs = {k: v.to(next(model.parameters()).device) for k, v in inputs.items()}
            out = model.generate(
                **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
            for item, row in zip(group, out[:, inputs["input_ids"].shape[1] :], strict=True):
                answer = tokenizer.decode(row, skip_special_tokens=True).strip()
                answers.append({"prompt": item.prompt, "answer": answer, "ok": item.check(answer)})
    finally:
        tokenizer.padding_side = side
    correct = sum(a["ok"] for a in answers)
    return {"score": correct / len(answers), "correct": correct, "total": len(answers), "answers": answers}
