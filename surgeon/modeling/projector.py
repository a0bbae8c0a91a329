"""Projectors: vision tokens (B, N, C_vision) -> LM embeddings (B, N', C_lm).

- `linear`: one Linear (LLaVA-1).
- `mlp2x_gelu`: Linear, GELU, Linear (LLaVA-1.5).
- `pixel_shuffle`: groups each f x f block of the token grid into one token with f*f times the
  channels, then one Linear (nanoVLM / SmolVLM): f*f fewer image tokens for the LM to read.
- `pixel_shuffle_mlp`: the same grouping, then Linear, GELU, Linear: a non-linear map per block.
- `pixel_shuffle_pooled`: `pixel_shuffle`'s tokens plus one more, the sum over the blocks of a
  per-block Linear + GELU, then a Linear. Attention averages what it reads, so a frozen LM finds
  "how many" hard to read off a grid; a sum carries it in the token's magnitude and direction.
"""

from __future__ import annotations

import torch
from torch import nn

PROJECTORS = ("linear", "mlp2x_gelu", "pixel_shuffle", "pixel_shuffle_mlp", "pixel_shuffle_pooled")


def shuffles(kind: str) -> bool:
    """Whether a projector of this kind groups the token grid into blocks."""
    return kind.startswith("pixel_shuffle")


def image_tokens(kind: str, vision_tokens: int, factor: int) -> int:
    """LM positions one image takes after a projector of this kind."""
    if not shuffles(kind):
        return vision_tokens
    return vision_tokens // (factor * factor) + (kind == "pixel_shuffle_pooled")


def pixel_shuffle(tokens: torch.Tensor, grid: tuple[int, int], factor: int) -> torch.Tensor:
    """(B, rows*cols, C) laid out row-major -> (B, rows*cols/f^2, C*f^2); each output token holds
    one f x f block, its rows concatenated in order."""
    batch, count, channels = tokens.shape
    rows, cols = grid
    if count != rows * cols or rows % factor or cols % factor:
        raise ValueError(f"pixel shuffle by {factor} needs a token grid divisible by it, got {rows}x{cols}")
    x = tokens.reshape(batch, rows // factor, factor, cols // factor, factor, channels)
    x = x.permute(0, 1, 3, 2, 4, 5)  # (B, block row, block col, row in block, col in block, C)
    return x.reshape(batch, (rows // factor) * (cols // factor), factor * factor * channels)


class Projector(nn.Module):
    def __init__(self, kind: str, vision_size: int, lm_size: int, grid: tuple[int, int] | None = None, factor: int = 2):
        super().__init__()
        if kind not in PROJECTORS:
            raise ValueError(f"unknown projector {kind!r}; choose one of {', '.join(PROJECTORS)}")
        if shuffles(kind) and grid is None:
            raise ValueError("pixel_shuffle needs a tower whose tokens form a grid (drop the CLS token)")
        self.kind, self.grid, self.factor = kind, grid, factor
        width = vision_size * factor * factor if shuffles(kind) else vision_size  # of one token the LM reads
        if kind in ("linear", "pixel_shuffle", "pixel_shuffle_pooled"):
            self.proj = nn.Linear(width, lm_size, bias=kind == "linear")
        else:  # mlp2x_gelu, pixel_shuffle_mlp
            self.proj = nn.Sequential(nn.Linear(width, lm_size), nn.GELU(), nn.Linear(lm_size, lm_size))
        if kind == "pixel_shuffle_pooled":
            self.pool_in = nn.Linear(width, lm_size)
            self.pool_out = nn.Linear(lm_size, lm_size)

    def tokens_out(self, tokens_in: int) -> int:
        return image_tokens(self.kind, tokens_in, self.factor)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if not shuffles(self.kind):
            return self.proj(tokens)
        blocks = pixel_shuffle(tokens, self.grid, self.factor)
        out = self.proj(blocks)
        if self.kind == "pixel_shuffle_pooled":
            pooled = self.pool_out(nn.functional.gelu(self.pool_in(blocks)).sum(1, keepdim=True))
            out = torch.cat([out, pooled], dim=1)
        return out
