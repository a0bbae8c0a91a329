"""A vision-language model assembled from parts: a donor's vision tower, a projector, and a causal LM.

The prompt holds one placeholder token per image token; the projected image tokens replace their
embeddings, and everything after that is the LM's own forward (and its KV cache in generate()).
The placeholder id lies past the LM's vocabulary, so the LM's embedding and head keep their
shapes: a text-only prompt gives exactly the LM's logits.

Like towers.py and projector.py, this file imports nothing from surgeon outside modeling/.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel

from .projector import Projector, image_tokens
from .towers import TimmTower, TransformersTower


class SurgeonVLMConfig(PretrainedConfig):
    """`text_config`: the LM's config. The tower is either a timm architecture
    (`timm_architecture`, built without weights; the checkpoint carries them) or a transformers
    vision model (`vision_config`). `vision_grid` and `vision_tokens` record the tower's token
    layout at `image_size`, measured when the graft was made."""

    model_type = "surgeon_vlm"

    def __init__(
        self,
        text_config=None,
        vision_config=None,
        timm_architecture: str | None = None,
        image_size: int = 224,
        vision_hidden_size: int | None = None,
        vision_grid: list[int] | None = None,
        vision_tokens: int | None = None,
        vision_layer: int = -1,
        drop_cls: bool = True,
        drop_prefix_tokens: bool = True,
        projector: str = "mlp2x_gelu",
        pixel_shuffle_factor: int = 2,
        image_token_id: int | None = None,
        image_token: str = "<image>",
        image_mean: list[float] | None = None,
        image_std: list[float] | None = None,
        **kwargs,
    ):
        if isinstance(text_config, dict):
            text_config = AutoConfig.for_model(**text_config)
        if isinstance(vision_config, dict):
            vision_config = AutoConfig.for_model(**vision_config)
        self.text_config = text_config
        self.vision_config = vision_config
        self.timm_architecture = timm_architecture
        self.image_size = image_size
        self.vision_hidden_size = vision_hidden_size
        self.vision_grid = list(vision_grid) if vision_grid else None
        self.vision_tokens = vision_tokens
        self.vision_layer = vision_layer
        self.drop_cls = drop_cls
        self.drop_prefix_tokens = drop_prefix_tokens
        self.projector = projector
        self.pixel_shuffle_factor = pixel_shuffle_factor
        self.image_token_id = image_token_id
        self.image_token = image_token
        # The donor's preprocessing: square resize to image_size, then (x - mean) / std per channel.
        self.image_mean = list(image_mean) if image_mean else [0.5, 0.5, 0.5]
        self.image_std = list(image_std) if image_std else [0.5, 0.5, 0.5]
        super().__init__(**kwargs)

    @property
    def image_seq_length(self) -> int:
        """LM positions one image takes."""
        return image_tokens(self.projector, self.vision_tokens, self.pixel_shuffle_factor)

    def to_dict(self):
        out = super().to_dict()
        for key in ("text_config", "vision_config"):
            value = getattr(self, key)
            out[key] = value.to_dict() if value is not None else None
        return out

    def get_text_config(self, *args, **kwargs):
        return self.text_config


def build_tower(config: SurgeonVLMConfig) -> nn.Module:
    if config.timm_architecture:
        import timm

        model = timm.create_model(config.timm_architecture, pretrained=False, num_classes=0, global_pool="")
        return TimmTower(model, config.vision_grid, config.vision_tokens, config.drop_prefix_tokens)
    return TransformersTower(AutoModel.from_config(config.vision_config), config.vision_layer, config.drop_cls)


class SurgeonVLMForConditionalGeneration(PreTrainedModel, GenerationMixin):
    config_class = SurgeonVLMConfig
    base_model_prefix = ""
    main_input_name = "input_ids"
    _supports_sdpa = True
    _supports_attention_backend = True

    def __init__(self, config: SurgeonVLMConfig):
        super().__init__(config)
        self.vision_tower = build_tower(config)
        self.projector = Projector(
            config.projector,
            config.vision_hidden_size,
            config.text_config.hidden_size,
            grid=tuple(config.vision_grid) if config.vision_grid else None,
            factor=config.pixel_shuffle_factor,
        )
        self.language_model = AutoModelForCausalLM.from_config(config.text_config)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # The tower and the LM were initialised by their own libraries (timm's init keeps a CNN's
        # activations alive; transformers' small normal init would not), the projector by nn.Linear.
        return

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Module:
        return self.language_model.get_output_embeddings()

    def image_features(
        self, pixel_values: torch.Tensor | None = None, tower_tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(images, 3, H, W) -> (images, image_seq_length, LM hidden size). `tower_tokens`, the
        tower's output computed earlier, skips the tower (training with a frozen tower caches it)."""
        if tower_tokens is None:
            tower_tokens = self.vision_tower(pixel_values.to(self.projector_dtype))
        return self.projector(tower_tokens.to(self.projector_dtype))

    @property
    def projector_dtype(self) -> torch.dtype:
        return next(self.projector.parameters()).dtype

    def embed(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        tower_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The LM's input embeddings with each image's projected tokens in its placeholder span."""
        placeholders = input_ids == self.config.image_token_id
        # The placeholder id is past the LM's vocabulary: look up a real id, then overwrite.
        embeds = self.get_input_embeddings()(input_ids.masked_fill(placeholders, 0))
        if pixel_values is None and tower_tokens is None:
            if placeholders.any():
                raise ValueError("the prompt has image placeholders but no pixel_values were given")
            return embeds
        features = self.image_features(pixel_values, tower_tokens).to(embeds.dtype)
        if int(placeholders.sum()) != features.shape[0] * features.shape[1]:
            raise ValueError(
                f"{int(placeholders.sum())} image placeholder tokens in the prompt, but "
                f"{features.shape[0]} images x {features.shape[1]} tokens each"
            )
        return embeds.masked_scatter(placeholders.unsqueeze(-1), features.reshape(-1, embeds.shape[-1]))

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ):
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids, pixel_values)
        # Everything else (cache, positions, labels, logits_to_keep) is the LM's business.
        return self.language_model(inputs_embeds=inputs_embeds, attention_mask=attention_mask, **kwargs)

    def prepare_inputs_for_generation(self, *args, pixel_values=None, is_first_iteration=False, **kwargs):
        inputs = super().prepare_inputs_for_generation(*args, is_first_iteration=is_first_iteration, **kwargs)
        if is_first_iteration or not kwargs.get("use_cache", True):
            inputs["pixel_values"] = pixel_values  # images enter once; later steps read the KV cache
        return inputs
