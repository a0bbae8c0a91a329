"""Vision towers: a donor's image encoder seen as one thing, pixels (B, 3, H, W) -> tokens (B, N, C).

Two kinds of donor:
- a timm architecture with a local checkpoint (CNN feature maps are flattened row-major into H*W
  tokens; a ViT's prefix tokens can be dropped);
- the vision model of a transformers checkpoint (CLIP, SigLIP, or a LLaVA-style VLM's
  `vision_tower`), read at a chosen hidden layer, CLS token dropped or kept.

The projector that follows sees only (B, N, C); which layer and which tokens is decided here.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from ..errors import SourceError


class VisionTower(nn.Module):
    """pixels -> tokens. `hidden_size` is C; `grid` is (rows, cols) of the token layout, or None
    when the tokens are not a grid (pixel shuffle needs one)."""

    hidden_size: int

    def tokens_per_image(self) -> int:
        rows, cols = self.grid
        return rows * cols


class TimmTower(VisionTower):
    """A timm model's `forward_features`, as tokens. Frozen BatchNorm statistics stay frozen
    because the tower runs in eval mode unless it is being trained."""

    def __init__(self, model: nn.Module, image_size: int, drop_prefix_tokens: bool = True):
        super().__init__()
        self.model = model
        self.image_size = image_size
        self.drop_prefix = int(getattr(model, "num_prefix_tokens", 0)) if drop_prefix_tokens else 0
        self.hidden_size = model.num_features
        training = model.training
        with torch.no_grad():  # eval for the probe, so BatchNorm statistics are left alone
            probe = model.eval().forward_features(torch.zeros(1, 3, image_size, image_size))
        model.train(training)
        if probe.dim() == 4:  # CNN: (B, C, H, W)
            self.grid = (probe.shape[2], probe.shape[3])
            self._count = probe.shape[2] * probe.shape[3]
        else:  # ViT: (B, prefix + N, C)
            n = probe.shape[1] - self.drop_prefix
            side = int(round(n ** 0.5))
            self.grid = (side, side) if side * side == n else None
            self._count = n

    def tokens_per_image(self) -> int:
        return self._count

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        features = self.model.forward_features(pixel_values)
        if features.dim() == 4:
            return features.flatten(2).transpose(1, 2)
        return features[:, self.drop_prefix:]


class TransformersTower(VisionTower):
    """A CLIP / SigLIP vision model (or a VLM's vision tower) read at `layer` (negative counts from
    the end, as LLaVA's -2), with the CLS token dropped when `drop_cls` and the model has one."""

    def __init__(self, model: nn.Module, layer: int = -1, drop_cls: bool = True):
        super().__init__()
        self.model = model
        config = model.config
        self.hidden_size = config.hidden_size
        self.image_size = config.image_size
        layers = config.num_hidden_layers
        if not -layers <= layer <= layers:
            raise SourceError(f"vision layer {layer} out of range (the tower has {layers} layers; "
                              f"0 is the embeddings, -1 the last layer)")
        # hidden_states holds the embeddings and then each layer: layer k is index k, or k - (layers + 1).
        self.layer = layer - (layers + 1) if layer >= 0 else layer
        patches = (config.image_size // config.patch_size) ** 2
        # CLIP prepends a class embedding; SigLIP has none.
        self.has_cls = hasattr(getattr(model, "vision_model", model).embeddings, "class_embedding")
        self.drop_cls = drop_cls and self.has_cls
        side = config.image_size // config.patch_size
        self.grid = (side, side) if not (self.has_cls and not self.drop_cls) else None
        self._count = patches + (1 if self.has_cls and not self.drop_cls else 0)

    def tokens_per_image(self) -> int:
        return self._count

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.model(pixel_values=pixel_values, output_hidden_states=True)
        hidden = out.hidden_states[self.layer]
        if self.layer == -1 and getattr(out, "last_hidden_state", None) is not None:
            hidden = out.last_hidden_state  # the final layer norm applies to the last layer only
        return hidden[:, 1:] if self.drop_cls else hidden


def load_donor_state(model: nn.Module, state: dict[str, torch.Tensor], key_map: dict[str, str] | None,
                     where: str, ordered: bool) -> None:
    """Load a donor checkpoint whose names may differ from timm's.

    With `key_map` (regex -> replacement, applied in order) names are rewritten. Names that then
    match the model's load by name; otherwise, where the file keeps its tensors' order (a .pth
    state dict does, safetensors sorts them), tensors are paired by position, which is right when
    both sides list the same tensors in the same order (checked: every pair must agree in shape)."""
    target = model.state_dict()
    if key_map:
        renamed = {}
        for name, tensor in state.items():
            for pattern, replacement in key_map.items():
                name = re.sub(pattern, replacement, name)
            renamed[name] = tensor
        state = renamed
    if set(state) != set(target):
        missing, unexpected = sorted(set(target) - set(state)), sorted(set(state) - set(target))
        if key_map or not ordered:
            raise SourceError(f"{where}: {len(missing)} of the model's tensors are missing (e.g. {missing[:3]}) and "
                              f"{len(unexpected)} are unexpected (e.g. {unexpected[:3]})"
                              + ("" if key_map else "; give a key_map (regex: replacement) to rename them"))
        if len(state) != len(target):
            raise SourceError(f"{where}: {len(state)} tensors, but the timm model has {len(target)}; "
                              f"give a key_map (regex: replacement) to pair them")
        paired = {}
        for (theirs, tensor), (ours, expected) in zip(state.items(), target.items()):
            if tensor.shape != expected.shape:
                raise SourceError(f"{where}: tensor {theirs} {tuple(tensor.shape)} does not fit {ours} "
                                  f"{tuple(expected.shape)} (pairing by order); give a key_map")
            paired[ours] = tensor
        state = paired
    for name, tensor in state.items():
        if target[name].shape != tensor.shape:
            raise SourceError(f"{where}: {name} is {tuple(tensor.shape)}, the model expects {tuple(target[name].shape)}")
    model.load_state_dict(state, strict=True)


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """safetensors, or a legacy .pth/.bin read with weights_only=True (no pickle code runs)."""
    if not path.is_file():
        raise SourceError(f"checkpoint {path} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling refusal becomes a user error
        raise SourceError(f"{path}: not a plain tensor checkpoint ({exc.__class__.__name__}: {exc})") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise SourceError(f"{path}: expected a mapping of tensor names to tensors")
    return state


def timm_tower(architecture: str, checkpoint: Path | None, key_map: dict[str, str] | None = None,
               image_size: int | None = None, drop_prefix_tokens: bool = True) -> TimmTower:
    """Build `architecture` in timm (no download: pretrained=False) and load `checkpoint` into it."""
    import timm

    try:
        model = timm.create_model(architecture, pretrained=False, num_classes=0, global_pool="")
    except RuntimeError as exc:
        raise SourceError(f"timm has no architecture {architecture!r} ({exc})") from None
    if checkpoint is not None:
        state = read_checkpoint(Path(checkpoint))
        # The classifier is not part of a tower: drop it on both sides before pairing.
        classifier = model.pretrained_cfg.get("classifier")
        state = {k: v for k, v in state.items() if not _is_classifier(k, v, classifier)}
        load_donor_state(model, state, key_map, str(checkpoint), ordered=Path(checkpoint).suffix != ".safetensors")
    size = image_size or model.pretrained_cfg.get("input_size", (3, 224, 224))[-1]
    return TimmTower(model.eval(), size, drop_prefix_tokens)


def _is_classifier(name: str, tensor: torch.Tensor, classifier: str | None) -> bool:
    """A 1000-way ImageNet head, whatever the donor calls it (`classifier`, `_fc`, `head`, `fc`)."""
    leaf = name.rsplit(".", 1)[0]
    return leaf in {classifier, "_fc", "fc", "head", "head.fc", "classifier"} and tensor.shape[0] in (1000, 1001)
