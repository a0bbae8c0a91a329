"""Healing data: every source kind, packing, masks, the held-out split, determinism."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from surgeon import answers
from surgeon.checkpoints.sources import resolve_source
from surgeon.errors import DataError, ParamError
from surgeon.training.heal_data import DataSource, HealData, check_sources
from surgeon.training.text_set import build_train_set


@pytest.fixture
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def build(spec: dict, base: Path, tokenizer, teacher=None):
    data = HealData.model_validate(spec)
    return build_train_set(data, check_sources(data.sources, base), tokenizer, teacher, "teacher-fp")


def test_text_windows_start_with_bos_and_split_deterministically(text_dir, tokenizer):
    spec = {"sources": [{"text": "calibration.txt"}], "window": 64, "heldout_windows": 3, "seed": 5}
    first, second = build(spec, text_dir, tokenizer), build(spec, text_dir, tokenizer)
    assert first.digest() == second.digest()
    assert first.heldout_ids.shape == (3, 64) and first.train_ids.shape[1] == 64
    assert (first.train_ids[:, 0] == tokenizer.bos_token_id).all()
    # Every position predicts a text token, except the last (its target is in the next window).
    assert first.train_mask[:, :-1].all() and not first.train_mask[:, -1].any()
    other = build({**spec, "seed": 6}, text_dir, tokenizer)
    assert not torch.equal(other.train_ids, first.train_ids)
    capped = build({**spec, "tokens": 640}, text_dir, tokenizer)
    assert capped.train_ids.shape[0] == 10


def test_chat_jsonl_masks_only_assistant_tokens(tmp_path, tokenizer):
    records = [
        {
            "messages": [
                {"role": "user", "content": "the house and the garden"},
                {"role": "assistant", "content": "her sister was at the window"},
            ]
        },
        {"text": "the morning letter was from his father"},
    ] * 40
    (tmp_path / "chats.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    spec = {"sources": [{"jsonl": "chats.jsonl"}], "window": 32, "heldout_windows": 0, "assistant_only": True}
    data = build(spec, tmp_path, tokenizer)
    ids, mask = data.train_ids, data.train_mask
    # A position counts exactly when the token it predicts belongs to an assistant reply.
    decoded = [tokenizer.decode(ids[w, t + 1]) for w in range(ids.shape[0]) for t in range(31) if mask[w, t]]
    text = "".join(decoded)
    assert "sister" in text and "window" in text
    assert "garden" not in text and "user" not in text
    assert "father" in text  # plain-text records have no turns: all their tokens train
    everything = build({**spec, "assistant_only": False}, tmp_path, tokenizer)
    assert everything.train_mask.sum() > 1.3 * data.train_mask.sum()  # user turns and template tokens now train too


def test_bad_records_are_located(tmp_path, tokenizer):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"oops": 1}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: expected a 'text' string or a 'messages' list"):
        build({"sources": [{"jsonl": "bad.jsonl"}], "window": 16}, tmp_path, tokenizer)
    (tmp_path / "broken.jsonl").write_text('{"text": \n')
    with pytest.raises(DataError, match=r"broken.jsonl:1: not JSON"):
        build({"sources": [{"jsonl": "broken.jsonl"}], "window": 16}, tmp_path, tokenizer)
    with pytest.raises(ParamError) as info:
        check_sources(HealData.model_validate({"sources": [{"text": "missing.txt"}]}).sources, tmp_path)
    assert info.value.path == ("data", "sources", 0, "text")


def test_datasets_library_reads_local_files(tmp_path, tokenizer, text_dir):
    lines = (text_dir / "heldout.txt").read_text().splitlines()
    (tmp_path / "rows.json").write_text("\n".join(json.dumps({"body": line}) for line in lines))
    data = build(
        {
            "sources": [{"dataset": "json", "data_files": "rows.json", "field": "body"}],
            "window": 32,
            "heldout_windows": 1,
        },
        tmp_path,
        tokenizer,
    )
    assert data.train_ids.shape[0] > 10
    with pytest.raises(ValueError, match="needs `data_files`"):
        DataSource.model_validate({"dataset": "json"})


def test_self_distill_is_written_by_the_teacher_and_cached(tiny_llama, tokenizer, monkeypatch):
    teacher = resolve_source(str(tiny_llama), Path.cwd()).load_model()
    spec = {
        "sources": [
            {"self_distill": {"prompts": ["the garden", "a letter", "her sister"], "max_new_tokens": 12, "samples": 2}}
        ],
        "window": 16,
        "heldout_windows": 0,
    }
    calls = []
    original = answers._generate

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(answers, "_generate", counted)
    first = build(spec, Path.cwd(), tokenizer, teacher)
    assert calls and first.train_ids.shape[0] >= 1
    calls.clear()
    second = build(spec, Path.cwd(), tokenizer, teacher)
    assert not calls and second.digest() == first.digest()  # read from the cache, identical


def test_plan_says_whether_the_teacher_answers_are_cached(tiny_llama, tokenizer):
    from surgeon.training.heal_data import SelfDistill
    from surgeon.training.text_set import describe_self_distill, self_distill_chats

    teacher = resolve_source(str(tiny_llama), Path.cwd()).load_model()
    spec = SelfDistill(prompts=["a walk", "the ball"], samples=2, max_new_tokens=8, follow_up=1.0, seed=5)
    before = describe_self_distill(spec, {}, "fp-plan")
    assert "4 teacher answers to 2 prompts, 4 with a follow-up (not cached: about" in before
    made = self_distill_chats(spec, {}, tokenizer, teacher, "fp-plan")
    assert len(made.chats) == 4 and all(len(chat) == 4 for chat in made.chats) and not made.cached
    assert "(cached; generating them took" in describe_self_distill(spec, {}, "fp-plan")
    again = self_distill_chats(spec, {}, tokenizer, None, "fp-plan")  # no teacher needed once cached
    assert again.cached and again.chats == made.chats
