"""Images for a VLM export: chat + images -> token ids with placeholder runs and pixels, and the
projected image tokens, each image encoded once.

Two kinds of export: surgeon's own VLM class (a timm or transformers tower, any projector) and the
LLaVA layout (CLIP/SigLIP + mlp2x_gelu, saved as LlavaForConditionalGeneration). Each has a small
front end that knows its processor and its feature call; the rest of the engine sees only ids,
placeholder spans and [tokens, hidden] features.

A span's digest hashes its preprocessed pixels, so the same picture sent twice (even re-encoded as
a different file) is recognised: the prefix cache reuses its keys, and the small LRU cache here
skips the tower when only the text before the image changed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

from .sequence import ImageSpan


class SurgeonVLMFront:
    def __init__(self, vlm, tokenizer):
        from ..vision.graft import processor_for

        self.vlm, self.processor = vlm, processor_for(vlm, tokenizer)
        self.image_token_id = self.processor.image_token_id
        self.tokens_per_image = self.processor.image_seq_length

    def encode(self, messages: list[dict], images: list) -> tuple[list[int], torch.Tensor]:
        inputs = self.processor.prompt(messages, images)  # typed placeholders stay text there
        pixels = inputs["pixel_values"]
        return inputs["input_ids"][0].tolist(), pixels if pixels is not None else torch.empty(0)

    def plain_ids(self, prompt: str) -> list[int]:
        return self.processor.text_ids(prompt)

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.vlm.image_features(pixels)


class LlavaFront:
    def __init__(self, llava, processor):
        self.llava, self.processor = llava, processor
        self.image_token_id = llava.config.image_token_id
        self.tokens_per_image = llava.config.image_seq_length
        self.image_token = processor.tokenizer.convert_ids_to_tokens(self.image_token_id)

    def plain_ids(self, prompt: str) -> list[int]:
        from ..vision.processor import text_ids

        return text_ids(self.processor.tokenizer, prompt, self.image_token, self.image_token_id)

    def encode(self, messages: list[dict], images: list) -> tuple[list[int], torch.Tensor]:
        # LLaVA's processor turns every "<image>" in the text into an image's tokens, so one a user
        # typed is escaped first (a word joiner after "<"); only image parts make image slots.
        messages = [_escape_typed(message, self.image_token) for message in messages]
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = self.processor(text=text, images=images or None, return_tensors="pt")
        pixels = inputs.get("pixel_values")
        return inputs["input_ids"][0].tolist(), pixels if pixels is not None else torch.empty(0)

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        dtype = next(self.llava.model.multi_modal_projector.parameters()).dtype
        return torch.stack(self.llava.model.get_image_features(pixel_values=pixels.to(dtype)).pooler_output)


def _escape_typed(message: dict, token: str) -> dict:
    escaped = token[:1] + "\u2060" + token[1:]
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": content.replace(token, escaped)}
    if isinstance(content, list):
        parts = [
            {**part, "text": part["text"].replace(token, escaped)}
            if part.get("type") == "text" and isinstance(part.get("text"), str)
            else part
            for part in content
        ]
        return {**message, "content": parts}
    return message


class VisionEncoder:
    def __init__(self, front, device: torch.device, cached_images: int = 32):
        self.front, self.device = front, device
        self.image_token_id = front.image_token_id
        self.tokens_per_image = front.tokens_per_image
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.cached_images = cached_images
        self.encoded = 0  # images run through the tower (tests and benchmarks read it)

    def plain_ids(self, prompt: str) -> list[int]:
        """A plain text prompt's ids, in which a typed placeholder is text, not an image slot."""
        return self.front.plain_ids(prompt)

    def encode(self, messages: list[dict], images: list) -> tuple[list[int], list[ImageSpan]]:
        """Token ids of a chat and one span per image, in order, with its pixels and digest."""
        ids, pixels = self.front.encode(messages, images)
        starts = [
            i
            for i, token in enumerate(ids)
            if token == self.image_token_id and (i == 0 or ids[i - 1] != self.image_token_id)
        ]
        if len(starts) != len(images):
            raise ValueError(f"{len(starts)} image placeholder runs in the prompt but {len(images)} images")
        spans = []
        for start, image_pixels in zip(starts, pixels):
            digest = hashlib.sha256(image_pixels.float().numpy().tobytes()).hexdigest()
            spans.append(ImageSpan(start, self.tokens_per_image, digest, image_pixels))
        return ids, spans

    @torch.inference_mode()
    def features(self, span: ImageSpan) -> torch.Tensor:
        """[tokens_per_image, hidden] for one image."""
        hit = self.cache.get(span.digest)
        if hit is not None:
            self.cache.move_to_end(span.digest)
            return hit
        found = self.front.features(span.pixels[None].to(self.device))[0]
        self.encoded += 1
        self.cache[span.digest] = found
        if len(self.cache) > self.cached_images:
            self.cache.popitem(last=False)
        return found
