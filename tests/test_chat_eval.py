"""Answers through the engine (cached), and chat_kl: a model teacher-forced on its parent's answers."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from surgeon import answers
from surgeon.answers import AnswerSettings, answer, answers_key, cached_entry, estimate_seconds
from surgeon.checkpoints.sources import resolve_source
from surgeon.measure.chat_kl import FIRST_TOKENS, chat_compare

CHATS = [[{"role": "user", "content": text}] for text in ("the garden", "a letter came", "her sister said", "rain")]


def load(path):
    source = resolve_source(str(path), Path.cwd())
    return source.load_model().eval(), source.load_tokenizer()


def hf_greedy(model, tokenizer, chat, max_new_tokens):
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return out[0, ids["input_ids"].shape[1] :].tolist()


def test_engine_answers_are_transformers_greedy_and_cached(tiny_llama, monkeypatch):
    model, tokenizer = load(tiny_llama)
    settings = AnswerSettings(max_new_tokens=12, dtype="float32")
    calls = []
    original = answers._generate
    monkeypatch.setattr(answers, "_generate", lambda *a, **k: calls.append(1) or original(*a, **k))
    first = answer(model, tokenizer, CHATS, settings, "fp-tiny")
    assert calls and not first.cached and first.tokens == sum(len(ids) for ids in first.answer_ids)
    for chat, ids in zip(CHATS, first.answer_ids):
        assert ids == hf_greedy(model, tokenizer, chat, 12)[: len(ids)]
    calls.clear()
    second = answer(model, tokenizer, CHATS, settings, "fp-tiny")
    assert not calls and second.cached and second.answer_ids == first.answer_ids
    assert cached_entry(answers_key("fp-tiny", CHATS, [None] * 4, settings))["conversations"] == 4
    # Another teacher, seed or bound is another entry.
    for other in (("fp-other", settings), ("fp-tiny", settings.model_copy(update={"max_new_tokens": 11}))):
        assert cached_entry(answers_key(other[0], CHATS, [None] * 4, other[1])) is None
    seconds, origin = estimate_seconds(100, 0, settings)
    assert seconds > 0 and "tokens/s" in origin


def test_follow_ups_are_answered_in_a_second_turn(tiny_llama):
    model, tokenizer = load(tiny_llama)
    settings = AnswerSettings(max_new_tokens=6, temperature=0.8, seed=2, dtype="float32")
    done = answer(model, tokenizer, CHATS, settings, "fp-follow", follow=[None, "Why?", None, "Shorter?"])
    assert [len(c) for c in done.chats] == [2, 4, 2, 4]
    assert done.chats[1][2] == {"role": "user", "content": "Why?"}
    assert done.chats[1][3]["role"] == "assistant"


def test_chat_kl_is_zero_against_itself_and_first16_matches_generation(tiny_llama):
    parent, tokenizer = load(tiny_llama)
    settings = AnswerSettings(max_new_tokens=24, dtype="float32")
    made = answer(parent, tokenizer, CHATS, settings, "fp-chat")
    same = chat_compare(parent, parent, tokenizer, made.chats, made.answer_ids)
    assert same["chat_kl_mean"] < 1e-6 and same["chat_top1"] == 1.0
    assert same["chat_first16"] == 1.0 and same["parent_first16"] == 1.0
    assert same["tokens"] == sum(len(ids) for ids in made.answer_ids)

    child = copy.deepcopy(parent)
    with torch.no_grad():
        for layer in child.model.layers[2:4]:
            layer.mlp.down_proj.weight.mul_(3.0)
    moved = chat_compare(child, parent, tokenizer, made.chats, made.answer_ids)
    assert moved["chat_kl_mean"] > 1e-3 and moved["chat_kl_p99"] >= moved["chat_kl_median"]
    # First-16 agreement says exactly whether the child's own greedy answer starts like the parent's.
    expected = [
        hf_greedy(child, tokenizer, chat, FIRST_TOKENS)[: min(FIRST_TOKENS, len(ids))] == ids[:FIRST_TOKENS]
        for chat, ids in zip(CHATS, made.answer_ids)
    ]
    assert moved["chat_first16"] == sum(expected) / len(expected)
