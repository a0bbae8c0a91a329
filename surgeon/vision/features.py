"""A frozen tower's outputs for many images, computed one way for healing and for evaluation.

Both batch the images of a list of examples through the tower once (the tower does not train, so
its outputs are a cache) and keep them in bf16 beside an fp32 projector: half of fp32's memory
(5,000 images of 64 x 1280 tokens take 0.8 GB), and the rounding is far below what separates one
image's features from another's. A CNN runs channels_last, ~2x faster on a CPU for depthwise
convolutions. Outputs are cached on disk (feature_cache.py): a second run over the same images
reads them instead of running the tower.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..modeling.towers import TimmTower
from .feature_cache import FeatureCache

log = logging.getLogger(__name__)


@dataclass
class TowerFeatures:
    features: torch.Tensor  # every image's tower tokens [images, tokens, channels], on the CPU
    spans: list[tuple[int, int]]  # per example, the [start, end) of its images in `features`
    from_cache: int = 0  # images whose outputs were read from the disk cache
    seconds: float = 0.0

    def summary(self) -> dict:
        return {"images": len(self.features), "from_cache": self.from_cache, "seconds": round(self.seconds, 1)}


@torch.no_grad()
def tower_features(
    vlm, processor, examples: list, batch: int = 32, device=None, desc: str = "tower features"
) -> TowerFeatures:
    """The tower's outputs for every image of `examples`, read from the disk cache where present."""
    began = time.perf_counter()
    tower = vlm.vision_tower
    device = device if device is not None else next(tower.parameters()).device
    dtype = vlm.projector_dtype
    keep = torch.bfloat16 if dtype == torch.float32 else dtype
    cnn = isinstance(tower, TimmTower) and not hasattr(tower.model, "patch_embed")
    spans, loaders = [], []
    for example in examples:
        spans.append((len(loaders), len(loaders) + len(example.images)))
        loaders.extend(example.images)
    store = FeatureCache(tower, dtype, keep) if loaders else None  # the loop below runs only with images
    if cnn:
        tower.to(memory_format=torch.channels_last)
    outputs, from_cache = [], 0
    try:
        for start in tqdm(range(0, len(loaders), batch), desc=desc, unit="batch", leave=False):
            pixels = processor.pixels([load() for load in loaders[start : start + batch]])
            entries = [store.path(image) for image in pixels]
            found = [store.read(entry) for entry in entries]
            missing = [i for i, out in enumerate(found) if out is None]
            from_cache += len(pixels) - len(missing)
            if missing:  # only the images not in the cache go through the tower, still as one batch
                todo = pixels[missing].to(device, dtype)
                if cnn:
                    todo = todo.contiguous(memory_format=torch.channels_last)
                computed = tower(todo).to(keep).cpu()
                for row, i in enumerate(missing):
                    found[i] = computed[row]
                    store.write(entries[i], computed[row])
            outputs.append(torch.stack(found))
    finally:
        if cnn:
            tower.to(memory_format=torch.contiguous_format)
    if outputs:
        features = torch.cat(outputs)
    else:
        features = torch.empty(0, vlm.config.vision_tokens, vlm.config.vision_hidden_size, dtype=keep)
    result = TowerFeatures(features, spans, from_cache, time.perf_counter() - began)
    log.info("%s: %d images in %.0f s (%d read from the disk cache)", desc, len(features), result.seconds, from_cache)
    return result
