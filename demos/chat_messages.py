"""Gradio's chat history and new message -> the engine's chat messages and images.

Gradio hands over the history with each message's content as parts ({"type": "text"} and
{"type": "file", "file": {"path"}}) and the new message as {"text", "files"}. The engine wants
{"role", "content"} with {"type": "image"} placeholders and the images in the same order; a
text-only model wants plain strings.
"""

from __future__ import annotations

from PIL import Image, UnidentifiedImageError


class NotAnImage(ValueError):
    """A file the chat cannot read as an image."""


def engine_chat(message: dict | str, history: list[dict], vision: bool) -> tuple[list[dict], list[Image.Image]]:
    turns = [(turn["role"], _parts(turn["content"])) for turn in history]
    if isinstance(message, str):
        message = {"text": message, "files": []}
    files = [{"type": "file", "path": _path(file)} for file in message.get("files") or []]
    turns.append(("user", files + ([{"type": "text", "text": message["text"]}] if message.get("text") else [])))
    messages, images = [], []
    for role, parts in _merged(turns):
        content = []
        for part in parts:
            if part["type"] == "file":
                images.append(_image(part["path"]))
                content.append({"type": "image"})
            else:
                content.append(part)
        if not vision and not images:  # with images, the engine itself says a text model cannot see
            content = "".join(part["text"] for part in content)
        messages.append({"role": role, "content": content})
    return messages, images


def _merged(turns: list[tuple[str, list[dict]]]) -> list[tuple[str, list[dict]]]:
    """Gradio shows an uploaded image and the text after it as two messages of one role; a chat
    template wants one turn per role change."""
    merged: list[tuple[str, list[dict]]] = []
    for role, parts in turns:
        if merged and merged[-1][0] == role:
            merged[-1][1].extend(parts)
        else:
            merged.append((role, list(parts)))
    return merged


def _parts(content) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, dict):
        content = [content]
    parts = []
    for part in content or []:
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
        elif part.get("type") == "text":
            parts.append({"type": "text", "text": part["text"]})
        elif part.get("type") == "file" or "path" in part:
            parts.append({"type": "file", "path": _path(part.get("file", part))})
        # other components (plots, html) carry nothing a language model reads
    return parts


def _path(file) -> str:
    return file if isinstance(file, str) else file["path"]


def _image(path: str) -> Image.Image:
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError):
        raise NotAnImage(f"{path.rsplit('/', 1)[-1]} is not an image this chat can read") from None
