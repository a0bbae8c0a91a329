"""Prompts for a model to answer: inline lists, prompt files, and instructions built over passages
of any text file, so a user without a chat dataset still gets thousands of distinct prompts.

Self-distillation (the parent writes the heal data) and the chat evaluation (the parent's answers
are the reference) both read prompts through `PromptSources`; what comes out is a list of
conversations, each ending with a user turn.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import DataError, ParamError
from .instruction_prompts import TopicPrompts, topic_prompts
from .text import read_jsonl, resolve_files

# Over a passage: what a reader asks of a text they have in front of them. "{p}" is the passage.
PASSAGE_TASKS: tuple[str, ...] = (
    "Summarise this passage in two or three sentences.\n\n{p}",
    "Give a one-sentence summary of the following text.\n\n{p}",
    "Here is a passage from a novel:\n\n{p}\n\nWhat happens in it?",
    "Continue this passage for a few sentences, in the same style.\n\n{p}",
    "{p}\n\nWhat might happen next? Write a short continuation.",
    "Explain what is going on in this passage to someone who has not read the book.\n\n{p}",
    "Rewrite this passage in simpler, modern English.\n\n{p}",
    "{p}\n\nRewrite the text above in plain words a child could follow.",
    "List the people mentioned in this passage.\n\n{p}",
    "Who are the characters in the following passage, and what is each of them doing?\n\n{p}",
    "What is the mood of this passage? Explain briefly.\n\n{p}",
    "Read the passage and answer: what does the speaker want?\n\n{p}",
    "Suggest a title for this passage.\n\n{p}",
    "Give three key points from this text as a bulleted list.\n\n{p}",
    "{p}\n\nWhat is the main idea of this text?",
    "Describe the setting of this passage.\n\n{p}",
    "Turn this passage into a short dialogue between two of its characters.\n\n{p}",
    "Quote the sentence that matters most in this passage and say why.\n\n{p}",
    "Write a question a teacher might ask about this passage, then answer it.\n\n{p}",
    "What does this passage tell us about the narrator's opinion? Answer in a few sentences.\n\n{p}",
    "Explain any old-fashioned words or phrases in this passage.\n\n{p}",
    "{p}\n\nWrite a short reply to this text as if you were one of its characters.",
)

# A second user turn, asked after the model's first answer (cheap multi-turn data).
FOLLOW_UPS: tuple[str, ...] = (
    "Can you say that in one sentence?",
    "Thanks. Can you give an example?",
    "Why do you think so?",
    "Explain that more simply, please.",
    "What else should I know about this?",
    "Could you make it shorter?",
    "Now list the main points.",
    "Is there another way to look at it?",
)


class PassagePrompts(BaseModel):
    """`count` instructions (summarise, continue, explain, list the people in, ...) over passages of
    about `passage_words` words cut from `text` (files or globs), drawn with `seed`."""

    model_config = ConfigDict(extra="forbid")

    text: str | list[str]
    count: int = Field(gt=0, le=200_000)
    passage_words: int = Field(90, ge=10, le=2000)
    seed: int = 0


class PromptSources(BaseModel):
    """Any of `prompts` (inline), `prompts_file` (text: one prompt per line; jsonl: records with
    `prompt` or chat `messages`), `from_text` (instructions over passages) and `from_topics`
    (instructions composed over surgeon's own topics, with answer-format constraints), in that order.
    `follow_up`: the share of conversations that get a second user turn after the first answer.
    `system`: a system message put before each conversation."""

    model_config = ConfigDict(extra="forbid")

    prompts: list[str] | None = Field(None, min_length=1)
    prompts_file: str | list[str] | None = None
    from_text: PassagePrompts | None = None
    from_topics: TopicPrompts | None = None
    follow_up: float = Field(0.0, ge=0.0, le=1.0)
    system: str | None = None

    @model_validator(mode="after")
    def _some(self):
        if all(s is None for s in (self.prompts, self.prompts_file, self.from_text, self.from_topics)):
            raise ValueError("give prompts: `prompts` (a list), `prompts_file`, `from_text` or `from_topics`")
        return self

    def check_files(self, base_dir: Path) -> dict[str, list[Path]]:
        """The files the prompts come from, checked now (a ParamError names the field)."""
        found = {}
        if self.prompts_file is not None:
            found["prompts_file"] = resolve_files(self.prompts_file, base_dir, "prompts_file")
        if self.from_text is not None:
            try:
                found["from_text"] = resolve_files(self.from_text.text, base_dir, "text")
            except ParamError as exc:
                raise exc.under(("from_text",)) from None
        return found


def conversations(spec: PromptSources, files: dict[str, list[Path]]) -> list[list[dict]]:
    """Every prompt as a conversation ending with a user turn (duplicates kept: `samples` and
    repeated prompts are the caller's choice)."""
    chats: list[list[dict]] = [[user(p)] for p in spec.prompts or []]
    chats += read_prompt_files(files.get("prompts_file", []))
    if spec.from_text is not None:
        chats += [[user(p)] for p in passage_prompts(spec.from_text, files["from_text"])]
    if spec.from_topics is not None:
        chats += [[user(p)] for p in topic_prompts(spec.from_topics)]
    if spec.system:
        chats = [[{"role": "system", "content": spec.system}, *chat] for chat in chats]
    return chats


def follow_ups(count: int, share: float, seed: int) -> list[str | None]:
    """For each of `count` conversations, a follow-up question or None, `share` of them asked."""
    rng = random.Random(seed)
    return [rng.choice(FOLLOW_UPS) if rng.random() < share else None for _ in range(count)]


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def read_prompt_files(paths: list[Path]) -> list[list[dict]]:
    chats = []
    for path in paths:
        if path.suffix == ".jsonl":
            chats += [_jsonl_prompt(record, where) for record, where, _ in read_jsonl([path])]
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                chats.append([user(line.strip().replace("\\n", "\n"))])
    return chats


def _jsonl_prompt(record, where: str) -> list[dict]:
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return [user(record["prompt"])]
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise DataError(f"{where}: expected a 'prompt' string or a 'messages' list")
    # The model writes the answer: keep the conversation up to its last user turn.
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        raise DataError(f"{where}: the conversation has no user turn to answer")
    return messages[: last_user + 1]


def passage_prompts(spec: PassagePrompts, files: list[Path]) -> list[str]:
    """`spec.count` distinct prompts; fewer (with an error) only when the text runs out."""
    passages = [p for path in files for p in _passages(path, spec.passage_words)]
    if not passages:
        raise DataError(f"{', '.join(f.name for f in files)}: no passage of {spec.passage_words} words")
    rng = random.Random(spec.seed)
    seen: set[str] = set()
    prompts: list[str] = []
    possible = len(passages) * len(PASSAGE_TASKS)
    if spec.count > possible:
        raise DataError(
            f"from_text: {spec.count} prompts asked, but {len(passages)} passages x {len(PASSAGE_TASKS)} tasks "
            f"give at most {possible}; lower count or passage_words, or add text"
        )
    while len(prompts) < spec.count:
        prompt = rng.choice(PASSAGE_TASKS).format(p=rng.choice(passages))
        if prompt not in seen:
            seen.add(prompt)
            prompts.append(prompt)
    return prompts


_GUTENBERG_END = re.compile(r"\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG", re.IGNORECASE)


def _passages(path: Path, words: int) -> list[str]:
    """Consecutive paragraphs joined until about `words` words (at most twice that), whitespace
    normalised; chapter headings and scraps shorter than half a passage are skipped."""
    text = path.read_text(encoding="utf-8", errors="replace")
    end = _GUTENBERG_END.search(text)
    text = text[: end.start()] if end else text
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    passages, current = [], []
    for paragraph in paragraphs:
        if not paragraph or paragraph.isupper() or len(paragraph.split()) < 4:
            current = []  # a heading or a break: passages never straddle one
            continue
        current.append(paragraph)
        size = sum(len(p.split()) for p in current)
        if size >= words:
            if size <= 2 * words:
                passages.append("\n\n".join(current))
            current = []
    return passages
