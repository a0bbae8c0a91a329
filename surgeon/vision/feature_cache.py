"""Frozen-tower outputs on disk, so a second run over the same images skips the tower.

A frozen tower is a pure function of its weights and its input pixels, so its outputs are data
preparation, like the parent's answers or logits: computed once, then read. Entries are keyed by
a fingerprint of the tower (class, token layout, every tensor's bytes, the dtypes it runs and is
kept in) and a digest of each image's preprocessed pixels, so a changed drawing, processor or
checkpoint can never read another's features, while the same images in another order, batch or
mix are found again. One small safetensors file per image, written atomically.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..checkpoints.atomic import atomic_file
from ..checkpoints.cache import cache_dir, prune_entries

FORMAT = 1  # bump when what a tower's forward returns changes for the same weights
MAX_BYTES = 16 * 2**30  # least recently used towers' entries go beyond this


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().reshape(-1).contiguous().cpu()
    return memoryview(flat.view(torch.uint8).numpy())


def tower_fingerprint(tower: torch.nn.Module, run_dtype: torch.dtype, keep_dtype: torch.dtype) -> str:
    digest = hashlib.sha256()
    layout = {k: getattr(tower, k, None) for k in ("grid", "tokens", "drop_prefix", "drop_cls", "layer")}
    digest.update(f"{FORMAT}|{type(tower).__name__}|{layout}|{run_dtype}|{keep_dtype}".encode())
    for name, tensor in sorted(tower.state_dict().items()):
        digest.update(f"|{name}:{tensor.dtype}:{tuple(tensor.shape)}|".encode())
        digest.update(_tensor_bytes(tensor))
    return digest.hexdigest()[:24]


class FeatureCache:
    def __init__(self, tower: torch.nn.Module, run_dtype: torch.dtype, keep_dtype: torch.dtype):
        self.folder: Path = cache_dir("tower_features") / tower_fingerprint(tower, run_dtype, keep_dtype)
        self.folder.mkdir(parents=True, exist_ok=True)
        prune_entries(self.folder.parent, MAX_BYTES, keep=self.folder)

    def path(self, image: torch.Tensor) -> Path:
        """Where one image's outputs live, from its preprocessed pixels [channels, height, width]."""
        digest = hashlib.sha256(f"{image.dtype}:{tuple(image.shape)}|".encode())
        digest.update(_tensor_bytes(image))
        return self.folder / f"{digest.hexdigest()[:32]}.safetensors"

    def read(self, path: Path) -> torch.Tensor | None:
        if not path.is_file():
            return None
        try:
            return load_file(str(path))["features"]
        except Exception:  # a damaged entry is recomputed, never trusted
            path.unlink(missing_ok=True)
            return None

    def write(self, path: Path, features: torch.Tensor) -> None:
        with atomic_file(path) as tmp:
            save_file({"features": features.clone(memory_format=torch.contiguous_format)}, str(tmp))  # not a view
