"""Vision towers from donors: a timm architecture with a local checkpoint, or the vision model of a
transformers checkpoint (CLIP, SigLIP, or a LLaVA-style VLM's `vision_tower`). The tower modules
themselves (pixels -> tokens) are in surgeon/modeling/towers.py; this file builds them, loads
donor weights without pickle, and turns what cannot work into a SourceError.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from ..errors import SourceError
from ..modeling.towers import TimmTower, TransformersTower


def load_donor_state(
    model: nn.Module, state: dict[str, torch.Tensor], key_map: dict[str, str] | None, where: str, ordered: bool
) -> None:
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
            raise SourceError(
                f"{where}: {len(missing)} of the model's tensors are missing (e.g. {missing[:3]}) and "
                f"{len(unexpected)} are unexpected (e.g. {unexpected[:3]})"
                + ("" if key_map else "; give a key_map (regex: replacement) to rename them")
            )
        if len(state) != len(target):
            raise SourceError(
                f"{where}: {len(state)} tensors, but the timm model has {len(target)}; "
                f"give a key_map (regex: replacement) to pair them"
            )
        paired = {}
        for (theirs, tensor), (ours, expected) in zip(state.items(), target.items()):
            if tensor.shape != expected.shape:
                raise SourceError(
                    f"{where}: tensor {theirs} {tuple(tensor.shape)} does not fit {ours} "
                    f"{tuple(expected.shape)} (pairing by order); give a key_map"
                )
            paired[ours] = tensor
        state = paired
    for name, tensor in state.items():
        if target[name].shape != tensor.shape:
            raise SourceError(
                f"{where}: {name} is {tuple(tensor.shape)}, the model expects {tuple(target[name].shape)}"
            )
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
    except Exception as exc:
        raise SourceError(f"{path}: not a plain tensor checkpoint ({exc.__class__.__name__}: {exc})") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise SourceError(f"{path}: expected a mapping of tensor names to tensors")
    return state


def timm_tower(
    architecture: str,
    checkpoint: Path | None,
    key_map: dict[str, str] | None = None,
    image_size: int | None = None,
    drop_prefix_tokens: bool = True,
) -> TimmTower:
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
    model.eval()
    with torch.no_grad():  # one probe at the working size gives the token layout
        probe = model.forward_features(torch.zeros(1, 3, size, size))
    if probe.dim() == 4:  # CNN: (B, C, H, W)
        grid, tokens = (probe.shape[2], probe.shape[3]), probe.shape[2] * probe.shape[3]
    else:  # ViT: (B, prefix + N, C)
        tokens = probe.shape[1] - (int(getattr(model, "num_prefix_tokens", 0)) if drop_prefix_tokens else 0)
        side = int(round(tokens**0.5))
        grid = (side, side) if side * side == tokens else None
    return TimmTower(model, grid, tokens, drop_prefix_tokens)


def transformers_tower(model: nn.Module, layer: int = -1, drop_cls: bool = True) -> TransformersTower:
    try:
        return TransformersTower(model, layer, drop_cls)
    except ValueError as exc:
        raise SourceError(str(exc)) from None


def _is_classifier(name: str, tensor: torch.Tensor, classifier: str | None) -> bool:
    """A 1000-way ImageNet head, whatever the donor calls it (`classifier`, `_fc`, `head`, `fc`)."""
    leaf = name.rsplit(".", 1)[0]
    return leaf in {classifier, "_fc", "fc", "head", "head.fc", "classifier"} and tensor.shape[0] in (1000, 1001)
