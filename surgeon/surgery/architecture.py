"""Decoder-only LM architectures described as data, and rebuilding a model from config + tensors.

Surgery happens at the level of (config, state dict): an operation writes a new config and says
which tensor each new name comes from; `assemble` turns that into a live model without copying
tensors. The same config transform, built on the meta device, is what `plan` shows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from .. import families
from ..errors import SourceError

LAYERS_PREFIX = "model.layers"
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# Config fields holding one entry per decoder layer; they are re-indexed with the layers.
PER_LAYER_FIELDS = ("layer_types", "no_rope_layers")

# Fields that must agree for layers of two checkpoints to be stacked into one model.
LAYER_SHAPE_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "hidden_activation",
    "attention_bias",
    "mlp_bias",
)


def check_supported(config: PretrainedConfig, where: str) -> None:
    if config.model_type not in families.surgery_types():
        raise SourceError(
            f"{where}: model type '{config.model_type}' is not supported yet "
            f"(supported: {', '.join(families.surgery_types())})"
        )


@dataclass(frozen=True)
class Shape:
    """What `plan` shows of a model: layers, heads and size."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    params: int
    bytes: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def language_config(config: PretrainedConfig) -> PretrainedConfig:
    """The LM's config: a grafted VLM's text_config, else the config itself."""
    return config.text_config if families.is_surgeon_vlm(config) else config


def shape_of(config: PretrainedConfig, dtype: torch.dtype) -> Shape:
    """The LM's shape (a grafted VLM's language model), with every parameter counted."""
    params = count_parameters(config)
    config = language_config(config)
    return Shape(
        layers=config.num_hidden_layers,
        heads=config.num_attention_heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim(config),
        hidden=config.hidden_size,
        vocab=config.vocab_size,
        params=params,
        bytes=params * dtype.itemsize,
    )


def count_parameters(config: PretrainedConfig) -> int:
    """Parameters of the model `config` describes, counted on the meta device (no memory, no weights)."""
    with torch.device("meta"):
        if families.is_surgeon_vlm(config):
            from ..modeling import SurgeonVLMForConditionalGeneration

            model = SurgeonVLMForConditionalGeneration(config)
        else:
            model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # tied weights are one Parameter, counted once


def layer_tensor_name(index: int, suffix: str) -> str:
    return f"{LAYERS_PREFIX}.{index}.{suffix}"


def split_layer_name(name: str) -> tuple[int, str] | None:
    """ "model.layers.12.mlp.up_proj.weight" -> (12, "mlp.up_proj.weight"); None for non-layer tensors."""
    match = _LAYER_NAME.match(name)
    return (int(match.group(1)), match.group(2)) if match else None


def config_with_layers(base: PretrainedConfig, picks: list[tuple[PretrainedConfig, int]]) -> PretrainedConfig:
    """A copy of `base` whose decoder layers are `picks`: (config the layer comes from, its index there).

    Per-layer fields (layer_types, ...) follow their layers, so a sliding-window layer stays sliding.
    """
    values = base.to_dict()
    values["num_hidden_layers"] = len(picks)
    for field in PER_LAYER_FIELDS:
        if values.get(field) is None:
            continue
        entries = []
        for source_config, index in picks:
            source_values = getattr(source_config, field, None)
            if source_values is None or len(source_values) <= index:
                raise SourceError(f"layer {index} of a {source_config.model_type} model has no '{field}' entry")
            entries.append(source_values[index])
        values[field] = entries
    if "max_window_layers" in values and values.get("layer_types") is not None:
        # Only consulted when layer_types is absent; keep it in range so the config validates.
        values["max_window_layers"] = min(values["max_window_layers"], len(picks))
    values.pop("quantization_config", None)
    return type(base).from_dict(values)


def clean_config(config: PretrainedConfig) -> PretrainedConfig:
    """A copy without loading artefacts (a GGUF quantization_config) so the model saves normally."""
    values = config.to_dict()
    values.pop("quantization_config", None)
    values.pop("_name_or_path", None)
    return type(config).from_dict(values)


def strip_loading_artefacts(config: PretrainedConfig) -> None:
    """clean_config in place, for a loaded model: its modules hold this very object (attention reads
    _attn_implementation from it, which indexer_mode switches), so it must not be swapped for a copy."""
    if "quantization_config" in config.__dict__:
        del config.quantization_config
    config._name_or_path = ""


def meta_model(config: PretrainedConfig) -> PreTrainedModel:
    """The model `config` describes on the meta device: names and shapes, no memory, no weights read."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def assemble(
    config: PretrainedConfig,
    tensors: dict[str, torch.Tensor],
    generation_config=None,
) -> PreTrainedModel:
    """Build the model `config` describes around existing tensors (no copies; tied weights re-tied).

    Parameters are created on the meta device and replaced by `tensors`; buffers such as rotary
    frequencies are computed for the new config, so they always match it.
    """
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config)
    expected = set(model.state_dict().keys())
    missing = sorted(expected - set(tensors))
    unexpected = sorted(set(tensors) - expected)
    if missing or unexpected:
        raise SourceError(
            "assembled model does not match its config: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    model.load_state_dict(tensors, strict=True, assign=True)
    model.tie_weights()
    for param in model.parameters():
        param.requires_grad_(False)  # surgery results are frozen; a heal step opts parameters in
    if generation_config is not None:
        model.generation_config = generation_config
    return model.eval()


def output_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits from final hidden states, exactly as the model's forward forms them.

    Lets callers form logits a slice of positions at a time (the full [T, vocab] tensor is large).
    Gemma 2/3 soft-cap their logits; the other supported families apply the head alone.
    """
    logits = model.get_output_embeddings()(hidden).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def keep_layers(model: PreTrainedModel, kept: list[int]) -> PreTrainedModel:
    """The model with only `kept` layers, renumbered in order; tensors are shared, not copied."""
    config = config_with_layers(model.config, [(model.config, i) for i in kept])
    new_index = {old: new for new, old in enumerate(kept)}
    tensors = {}
    for name, tensor in model.state_dict().items():
        split = split_layer_name(name)
        if split is None:
            tensors[name] = tensor
        elif split[0] in new_index:
            tensors[layer_tensor_name(new_index[split[0]], split[1])] = tensor
    return assemble(config, tensors, model.generation_config)
