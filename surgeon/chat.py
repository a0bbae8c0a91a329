"""Chat rendering and tokenising, shared by training data, the engine and the evaluations: a
conversation through the tokenizer's chat template, and which of its tokens are assistant turns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .errors import DataError


@dataclass
class Document:
    ids: list[int]
    mask: list[bool]


Encode = Callable[[str], list[int]]  # rendered chat text -> token ids


def render_chat(
    tokenizer, messages: list[dict], assistant_only: bool, where: str = "chat", encode: Encode | None = None
) -> Document:
    """Render with the chat template; with assistant_only, only assistant turns are targets.
    `encode` turns the rendered text into ids (default: the tokenizer, special tokens parsed).

    Assistant spans are found by rendering each prefix of the conversation, which works for any
    template that renders a prefix as a prefix (ChatML, Llama, Gemma).
    """
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages
    ):
        raise DataError(f"{where}: 'messages' must be a list of {{role, content}}")
    if tokenizer.chat_template is None:
        raise DataError(f"{where}: chat data needs a tokenizer with a chat template")
    ids = chat_ids(tokenizer, messages, generation_prompt=False, encode=encode)
    mask = [not assistant_only] * len(ids)
    if assistant_only:
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = len(chat_ids(tokenizer, messages[:i], generation_prompt=True, encode=encode))
            end = len(chat_ids(tokenizer, messages[: i + 1], generation_prompt=False, encode=encode))
            for t in range(start, min(end, len(ids))):
                mask[t] = True
    return Document(ids, mask)


def chat_ids(tokenizer, messages: list[dict], generation_prompt: bool, encode: Encode | None = None) -> list[int]:
    if not messages:
        return []
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return encode(text) if encode is not None else tokenizer(text, add_special_tokens=False)["input_ids"]
