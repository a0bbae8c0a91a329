"""Images and chats -> model inputs for a grafted VLM.

A chat turn's content may be a string or a list of parts ({"type": "image"} / {"type": "text"}).
Each image part becomes a run of `image_seq_length` placeholder tokens followed by a newline, so
any text-only chat template renders it; the images themselves become pixel_values in the order
their parts appear. The whole image is resized to the tower's square input (no crop: an object at
the edge of a picture is still in it) and normalised with the donor's mean and std.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from PIL import Image

from ..chat import Document, chat_ids, render_chat
from ..errors import DataError

IMAGE_TOKEN = "<image>"
# Stands for a placeholder a user typed while the chat template renders (a Unicode noncharacter,
# itself removed from users' text): image parts insert the real placeholder run, typed ones this,
# so only image parts become image slots. With nothing typed, the text is tokenised in one call,
# exactly as a chat without this care would be.
TYPED_PLACEHOLDER = "\uffff"


def add_image_token(tokenizer, token: str = IMAGE_TOKEN) -> int:
    """The placeholder's id, adding it to the tokenizer as a special token if it is not there."""
    if token not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": [token]}, replace_extra_special_tokens=False)
    return tokenizer.convert_tokens_to_ids(token)


def typed_token_ids(tokenizer, image_token: str, image_token_id: int) -> list[int]:
    """The ids of the placeholder's characters as text, never the image token: split as a special
    token would be, or, where the tokenizer holds it as an ordinary added token, in two pieces."""
    ids = tokenizer(image_token, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    if image_token_id in ids:
        ids = [
            t
            for piece in (image_token[:1], image_token[1:])
            for t in tokenizer(piece, add_special_tokens=False)["input_ids"]
        ]
    return ids


def text_ids(tokenizer, text: str, image_token: str, image_token_id: int) -> list[int]:
    """Ids of plain text (no chat template) in which a typed placeholder is text; the special
    tokens the tokenizer adds around a text (BOS, EOS) stay where tokenizer(text) puts them."""
    full = tokenizer(text)["input_ids"]
    if image_token not in text:
        return full
    bare = tokenizer(text, add_special_tokens=False)["input_ids"]
    at = next((i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare), 0)
    typed = typed_token_ids(tokenizer, image_token, image_token_id)
    return full[:at] + _joined(tokenizer, text.split(image_token), typed) + full[at + len(bare) :]


def _joined(tokenizer, pieces: list[str], between: list[int]) -> list[int]:
    ids: list[int] = []
    for index, piece in enumerate(pieces):
        if index:
            ids += between
        if piece:
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
    return ids


@dataclass
class ImageTransform:
    """PIL image -> (3, size, size) float tensor, normalised per channel."""

    size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    def __call__(self, image: Image.Image) -> torch.Tensor:
        image = image.convert("RGB").resize((self.size, self.size), Image.Resampling.BICUBIC)
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(self.size, self.size, 3)
        pixels = pixels.permute(2, 0, 1).float().div(255)
        return (pixels - torch.tensor(self.mean).view(3, 1, 1)) / torch.tensor(self.std).view(3, 1, 1)


@dataclass
class Encoded:
    ids: list[int]
    mask: list[bool]  # training targets
    pixel_values: torch.Tensor  # (images, 3, size, size)


class VLMProcessor:
    def __init__(self, tokenizer, transform: ImageTransform, image_seq_length: int, image_token: str = IMAGE_TOKEN):
        self.tokenizer, self.transform = tokenizer, transform
        self.image_seq_length, self.image_token = image_seq_length, image_token
        self.image_token_id = add_image_token(tokenizer, image_token)
        self._typed_ids = typed_token_ids(tokenizer, image_token, self.image_token_id)  # once, not per chat

    def flatten(self, messages: list[dict], images: int, where: str) -> list[dict]:
        """Structured content -> strings with placeholder runs; checks the image count."""
        seen, flat = 0, []
        for message in messages:
            content = message.get("content")
            if isinstance(content, list):
                text = []
                for part in content:
                    if part.get("type") == "image":
                        seen += 1
                        text.append(self.image_token * self.image_seq_length + "\n")
                    elif part.get("type") == "text":
                        text.append(self._typed(str(part.get("text", ""))))
                    else:
                        raise DataError(f"{where}: unknown content part {part.get('type')!r} (image or text)")
                content = "".join(text)
            elif isinstance(content, str):
                content = self._typed(content)
            flat.append({**message, "content": content})
        if seen != images:
            raise DataError(f"{where}: {seen} image parts in the messages but {images} images given")
        return flat

    def encode(self, record: dict, assistant_only: bool = True, where: str = "record") -> Encoded:
        """A training record {"images": [...], "messages": [...]}: ids, target mask, pixels."""
        images = record.get("images") or []
        ids, mask = self.encode_text(record["messages"], len(images), assistant_only, where)
        return Encoded(ids, mask, self.pixels(images))

    def encode_text(
        self, messages: list[dict], images: int, assistant_only: bool = True, where: str = "record"
    ) -> tuple[list[int], list[bool]]:
        """Token ids and the targets mask of a chat with `images` image parts."""
        flat = self.flatten(messages, images, where)
        document: Document = render_chat(self.tokenizer, flat, assistant_only, where, encode=self.encode_rendered)
        # Placeholders are never targets (their id lies past the LM's vocabulary).
        return document.ids, [m and t != self.image_token_id for t, m in zip(document.ids, document.mask)]

    def prompt(self, messages: list[dict], images: list[Image.Image]) -> dict:
        """Generation inputs for one chat: input_ids (1, n) ending in the assistant prompt, and pixel_values."""
        flat = self.flatten(messages, len(images), "prompt")
        ids = chat_ids(self.tokenizer, flat, generation_prompt=True, encode=self.encode_rendered)
        return {"input_ids": torch.tensor([ids]), "pixel_values": self.pixels(images) if images else None}

    def _typed(self, text: str) -> str:
        return text.replace(TYPED_PLACEHOLDER, "").replace(self.image_token, TYPED_PLACEHOLDER)

    def encode_rendered(self, text: str) -> list[int]:
        """A rendered chat's ids: placeholder runs from image parts, typed placeholders as text."""
        return _joined(self.tokenizer, text.split(TYPED_PLACEHOLDER), self._typed_ids)

    def text_ids(self, text: str) -> list[int]:
        return text_ids(self.tokenizer, text, self.image_token, self.image_token_id)

    def pixels(self, images: list) -> torch.Tensor:
        if not images:
            return torch.empty(0, 3, self.transform.size, self.transform.size)
        return torch.stack([self.transform(image) for image in images])


def collate(batch: list[Encoded], pad_id: int) -> dict:
    """Right-padded ids, attention mask, -100 labels outside the targets, and every image of the
    batch in order (rows with more or fewer images need no padding of their own)."""
    length = max(len(item.ids) for item in batch)
    ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    attention = torch.zeros(len(batch), length, dtype=torch.long)
    labels = torch.full((len(batch), length), -100, dtype=torch.long)
    for row, item in enumerate(batch):
        n = len(item.ids)
        ids[row, :n] = torch.tensor(item.ids)
        attention[row, :n] = 1
        labels[row, :n] = ids[row, :n].masked_fill(~torch.tensor(item.mask), -100)
    pixels = [item.pixel_values for item in batch if item.pixel_values.shape[0]]
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "labels": labels,
        "pixel_values": torch.cat(pixels) if pixels else None,
    }
