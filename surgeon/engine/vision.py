"""Images for a grafted VLM: pixels, a content digest, and the projected image tokens, encoded once.

The digest hashes the preprocessed pixels, so the same picture sent twice (even re-encoded as a
different file) is recognised: the prefix cache reuses its keys, and this encoder's small LRU cache
skips the tower when only the text before the image changed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

from .sequence import ImageSpan


class VisionEncoder:
    def __init__(self, vlm, processor, device: torch.device, cached_images: int = 32):
        self.vlm, self.processor, self.device = vlm, processor, device
        self.image_token_id = processor.image_token_id
        self.tokens_per_image = processor.image_seq_length
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.cached_images = cached_images
        self.encoded = 0  # images run through the tower (tests and benchmarks read it)

    def spans(self, ids: list[int], images: list) -> list[ImageSpan]:
        """One span per run of placeholders, in order, each with its image's pixels and digest."""
        starts = [i for i, token in enumerate(ids)
                  if token == self.image_token_id and (i == 0 or ids[i - 1] != self.image_token_id)]
        if len(starts) != len(images):
            raise ValueError(f"{len(starts)} image placeholders in the prompt but {len(images)} images")
        spans = []
        for start, image in zip(starts, images):
            pixels = self.processor.transform(image)
            digest = hashlib.sha256(pixels.numpy().tobytes()).hexdigest()
            spans.append(ImageSpan(start, self.tokens_per_image, digest, pixels))
        return spans

    @torch.inference_mode()
    def features(self, span: ImageSpan) -> torch.Tensor:
        """[tokens_per_image, hidden] for one image."""
        hit = self.cache.get(span.digest)
        if hit is not None:
            self.cache.move_to_end(span.digest)
            return hit
        pixels = span.pixels[None].to(self.device)
        found = self.vlm.image_features(pixels)[0]
        self.encoded += 1
        self.cache[span.digest] = found
        if len(self.cache) > self.cached_images:
            self.cache.popitem(last=False)
        return found
