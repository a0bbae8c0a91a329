"""Vision towers as modules: pixels (B, 3, H, W) -> tokens (B, N, C).

This file imports nothing from surgeon outside modeling/, so an exported VLM can carry it as
remote code. Building a tower from a donor checkpoint (and the checks a user needs) lives in
surgeon/vision/towers.py.
"""

from __future__ import annotations

import torch
from torch import nn


class TimmTower(nn.Module):
    """A timm model's `forward_features` as tokens: a CNN's (B, C, H, W) maps flattened row-major
    into H*W tokens, or a ViT's tokens with its prefix (CLS, registers) dropped when asked.
    `grid` is the (rows, cols) of the token layout, or None when the tokens are not a grid."""

    def __init__(self, model: nn.Module, grid: tuple[int, int] | None, tokens: int, drop_prefix_tokens: bool = True):
        super().__init__()
        self.model = model
        self.hidden_size = model.num_features
        self.grid = tuple(grid) if grid else None
        self.tokens = tokens
        self.drop_prefix = int(getattr(model, "num_prefix_tokens", 0)) if drop_prefix_tokens else 0

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        features = self.model.forward_features(pixel_values)
        if features.dim() == 4:
            return features.flatten(2).transpose(1, 2)
        return features[:, self.drop_prefix :]


class TransformersTower(nn.Module):
    """A CLIP / SigLIP vision model (or a VLM's vision tower) read at hidden layer `layer`
    (negative counts from the end, as LLaVA's -2), its CLS token dropped when `drop_cls`."""

    def __init__(self, model: nn.Module, layer: int = -1, drop_cls: bool = True):
        super().__init__()
        self.model = model
        config = model.config
        layers = config.num_hidden_layers
        if not -layers <= layer <= layers:
            raise ValueError(
                f"vision layer {layer} out of range (the tower has {layers} layers; "
                f"0 is the embeddings, -1 the last layer)"
            )
        # hidden_states holds the embeddings and then each layer: layer k is index k, or k - (layers + 1).
        self.layer = layer - (layers + 1) if layer >= 0 else layer
        self.hidden_size = config.hidden_size
        self.has_cls = has_class_token(model)
        self.drop_cls = drop_cls and self.has_cls
        side = config.image_size // config.patch_size
        keeps_cls = self.has_cls and not self.drop_cls
        self.grid = None if keeps_cls else (side, side)
        self.tokens = side * side + int(keeps_cls)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.model(pixel_values=pixel_values, output_hidden_states=True)
        # SigLIP's final layer norm is applied to last_hidden_state only: the last layer means that.
        hidden = out.last_hidden_state if self.layer == -1 else out.hidden_states[self.layer]
        return hidden[:, 1:] if self.drop_cls else hidden


def has_class_token(model: nn.Module) -> bool:
    """CLIP prepends a class embedding; SigLIP has none."""
    return hasattr(getattr(model, "vision_model", model).embeddings, "class_embedding")
