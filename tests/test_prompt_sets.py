"""Prompt sources (inline, files, instructions over passages) and the shipped prompt sets: what heals
never overlaps what evaluates (chat-eval.txt, IFEval, the instruction check)."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from conftest import ROOT, SHARED_DATA, requires_shared_data
from surgeon.errors import DataError
from surgeon.instruction_prompts import CONSTRAINTS, TASKS, TOPICS, TopicPrompts, topic_prompts
from surgeon.measure.instructions import ITEMS
from surgeon.prompts import PASSAGE_TASKS, PassagePrompts, PromptSources, conversations, follow_ups, read_prompt_files

PROMPTS = ROOT / "recipes" / "prompts"
IFEVAL = SHARED_DATA / "ifeval" / "input_data.jsonl"


def normalised(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def prompt_texts(path) -> set[str]:
    return {normalised(chat[-1]["content"]) for chat in read_prompt_files([path])}


def test_shipped_sets_are_disjoint_from_every_evaluation():
    heal, evaluation = prompt_texts(PROMPTS / "chat-heal.txt"), prompt_texts(PROMPTS / "chat-eval.txt")
    checks = {normalised(item.prompt) for item in ITEMS}
    assert len(heal) >= 140 and len(evaluation) >= 40
    assert not heal & evaluation
    assert not heal & checks and not evaluation & checks
    if IFEVAL.is_file():
        ifeval = {normalised(json.loads(line)["prompt"]) for line in IFEVAL.read_text().splitlines() if line.strip()}
        assert len(ifeval) == 541
        assert not heal & ifeval and not evaluation & ifeval


def _evaluation_texts() -> set[str]:
    texts = prompt_texts(PROMPTS / "chat-eval.txt") | {normalised(item.prompt) for item in ITEMS}
    if IFEVAL.is_file():
        texts |= {normalised(json.loads(line)["prompt"]) for line in IFEVAL.read_text().splitlines() if line.strip()}
    return texts


def test_composed_instructions_are_distinct_varied_and_never_an_evaluation_prompt():
    prompts = topic_prompts(TopicPrompts(count=20000))
    assert prompts == topic_prompts(TopicPrompts(count=20000)) and len(set(prompts)) == 20000
    assert prompts[:100] != topic_prompts(TopicPrompts(count=100, seed=1))
    assert not {normalised(p) for p in prompts} & _evaluation_texts()
    # Every task and nearly every topic is asked about; about half carry an answer-format constraint.
    assert all(any(p.startswith(task.split("{")[0]) for p in prompts) for task in TASKS)
    assert sum(any(topic in p for p in prompts[:5000]) for topic in TOPICS) >= 0.95 * len(TOPICS)
    starts = [c.split("{")[0].split("'")[0] for c in CONSTRAINTS]
    # (on the first 2,000: at 20,000 the unconstrained combinations run short and the rest carry one)
    carrying = sum(any(f". {s}" in p or f"? {s}" in p for s in starts) for p in prompts[:2000])
    assert 0.4 < carrying / 2000 < 0.6
    constrained = topic_prompts(TopicPrompts(count=2000, constrained=1.0))
    unconstrained = topic_prompts(TopicPrompts(count=2000, constrained=0.0))
    assert sum(len(p) for p in constrained) > 1.3 * sum(len(p) for p in unconstrained)
    with pytest.raises(DataError, match="distinct prompts"):
        topic_prompts(TopicPrompts(count=100_000, constrained=0.0))


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_composed_instructions_a_recipe_heals_on_are_not_evaluated(path):
    recipe = yaml.safe_load(path.read_text())
    for heal in _sources(recipe, "heal"):
        for source in heal.get("data", {}).get("sources", []):
            topics = (source.get("self_distill") or {}).get("from_topics")
            if topics:
                composed = {normalised(p) for p in topic_prompts(TopicPrompts(**topics))}
                assert not composed & _evaluation_texts()


def _sources(recipe: dict, op: str):
    for step in recipe["steps"]:
        ((name, params),) = step.items()
        if name == op:
            yield params or {}


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_no_recipe_heals_on_what_it_evaluates(path):
    recipe = yaml.safe_load(path.read_text())
    trained, evaluated = set(), set()
    for heal in _sources(recipe, "heal"):
        for source in heal.get("data", {}).get("sources", []):
            distil = source.get("self_distill") or {}
            files = distil.get("prompts_file") or []
            trained |= {files} if isinstance(files, str) else set(files)
            if distil.get("from_text"):
                text = distil["from_text"]["text"]
                trained |= {text} if isinstance(text, str) else set(text)
            trained |= {normalised(p) for p in distil.get("prompts") or []}
    for evaluate in _sources(recipe, "evaluate"):
        chat = evaluate.get("chat") or {}
        files = chat.get("prompts_file") or []
        evaluated |= {files} if isinstance(files, str) else set(files)
        evaluated |= {normalised(p) for p in chat.get("prompts") or []}
    for ifeval in _sources(recipe, "ifeval"):
        evaluated.add(ifeval.get("data", "google/IFEval"))
    assert not trained & evaluated, f"{path.name} trains on {trained & evaluated}"
    assert not any("ifeval" in str(t) or "chat-eval" in str(t) for t in trained)


def test_passage_prompts_are_distinct_seeded_and_quote_the_text(tmp_path):
    words = " ".join(f"word{i}" for i in range(40))
    (tmp_path / "book.txt").write_text("\n\n".join(f"Paragraph {n} says {words}." for n in range(60)))
    spec = PassagePrompts(text="book.txt", count=200, passage_words=40, seed=3)
    first = conversations(PromptSources(from_text=spec), {"from_text": [tmp_path / "book.txt"]})
    again = conversations(PromptSources(from_text=spec), {"from_text": [tmp_path / "book.txt"]})
    texts = [chat[-1]["content"] for chat in first]
    assert texts == [chat[-1]["content"] for chat in again]
    assert len(set(texts)) == 200
    assert all("Paragraph" in t for t in texts)
    # Every task template is used, so a user gets varied instructions, not one.
    used = {
        task
        for task in PASSAGE_TASKS
        for t in texts
        if t.startswith(task.split("{p}")[0]) and t.endswith(task.split("{p}")[1])
    }
    assert len(used) > len(PASSAGE_TASKS) // 2
    other = conversations(
        PromptSources(from_text=spec.model_copy(update={"seed": 4})), {"from_text": [tmp_path / "book.txt"]}
    )
    assert [c[-1]["content"] for c in other] != texts
    with pytest.raises(DataError, match="at most"):
        conversations(
            PromptSources(from_text=spec.model_copy(update={"count": 10**5})), {"from_text": [tmp_path / "book.txt"]}
        )


def test_prompt_files_text_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("# a comment\nFirst prompt\n\nSecond\\nwith a break\n")
    (tmp_path / "b.jsonl").write_text(
        json.dumps({"prompt": "Third"})
        + "\n"
        + json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello"},
                    {"role": "user", "content": "Fourth"},
                    {"role": "assistant", "content": "to be rewritten by the teacher"},
                ]
            }
        )
        + "\n"
    )
    spec = PromptSources(prompts=["Zeroth"], prompts_file=["a.txt", "b.jsonl"], system="Be brief.")
    chats = conversations(spec, spec.check_files(tmp_path))
    assert [c[-1]["content"] for c in chats] == ["Zeroth", "First prompt", "Second\nwith a break", "Third", "Fourth"]
    assert all(c[0] == {"role": "system", "content": "Be brief."} for c in chats)
    assert len(chats[-1]) == 4  # system + the conversation up to its last user turn
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "assistant", "content": "x"}]}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: the conversation has no user turn"):
        read_prompt_files([tmp_path / "bad.jsonl"])


def test_follow_ups_ask_the_stated_share():
    asked = follow_ups(2000, 0.25, seed=0)
    assert asked == follow_ups(2000, 0.25, seed=0)
    assert 0.2 < sum(q is not None for q in asked) / 2000 < 0.3
    assert not any(follow_ups(50, 0.0, seed=1))


@requires_shared_data
def test_passages_of_a_real_novel():
    spec = PassagePrompts(text="x", count=1000, passage_words=90)
    prompts = conversations(PromptSources(from_text=spec), {"from_text": [SHARED_DATA / "text/austen/emma.txt"]})
    assert len({c[-1]["content"] for c in prompts}) == 1000
    assert not any("PROJECT GUTENBERG" in c[-1]["content"].upper() for c in prompts)
