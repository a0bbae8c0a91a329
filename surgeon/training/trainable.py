"""What a heal step trains: glob-selected parameters, LoRA adapters (peft), or both.

Everything else is frozen: no gradients, no optimizer state. Trained tensors are copied first,
because a child shares its tensors with the parent (the teacher) until something writes to them.
"""

from __future__ import annotations

import re

import torch
from pydantic import BaseModel, ConfigDict, Field

from .. import families
from ..errors import ParamError
from ..recipe.layer_spec import LayerList, expand_layers
from ..surgery.selection import select, unmatched_patterns

DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    r: int = Field(16, gt=0)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_LORA_TARGETS), min_length=1)
    layers: LayerList | None = None  # decoder layers that get adapters (default: all)


class TrainSpec(BaseModel):
    """`params`: globs over parameter names to train in full; `lora`: adapters merged at export."""

    model_config = ConfigDict(extra="forbid")

    params: list[str] = []
    lora: LoraSpec | None = None


def check_trainable(spec: TrainSpec, model: torch.nn.Module, path: tuple) -> dict[str, int]:
    """Validate `spec` against a (meta) model and count what would train: {"trainable", "total"}."""
    if not spec.params and spec.lora is None:
        raise ParamError(path, "nothing to train: give `params` (globs) and/or `lora`")
    names = [n for n, _ in model.named_parameters()]
    bad = unmatched_patterns(names, spec.params)
    if bad:
        raise ParamError(path + ("params",), f"{bad} match no parameter (e.g. {names[1]})")
    shapes = dict(model.named_parameters())
    trainable = sum(shapes[n].numel() for n in _unique(model, select(names, spec.params)))
    if spec.lora is not None:
        layers = _lora_layers(spec.lora, _text_config(model).num_hidden_layers, path + ("lora", "layers"))
        targets = lora_target_modules(model, spec.lora, layers)
        if not targets:
            raise ParamError(path + ("lora", "target_modules"), f"{spec.lora.target_modules} match no Linear layer")
        trainable += sum(spec.lora.r * (m.in_features + m.out_features) for m in targets.values())
    total = sum(p.numel() for p in model.parameters()) + (trainable if spec.lora else 0)
    return {"trainable": trainable, "total": total}


def _lora_layers(lora: LoraSpec, n_layers: int, path: tuple) -> list[int] | None:
    return sorted(set(expand_layers(lora.layers, n_layers, path))) if lora.layers is not None else None


def _text_config(model):
    config = model.config
    return config.text_config if families.is_surgeon_vlm(config) else config


def lora_target_modules(model, lora: LoraSpec, layers: list[int] | None) -> dict[str, torch.nn.Linear]:
    """The Linear modules peft will adapt: name ends with a target, inside the chosen layers (of
    the language model, in a grafted VLM: a CLIP tower's q_proj is not the LM's)."""
    found = {}
    vlm = _text_config(model) is not model.config
    for name, module in model.named_modules():
        if vlm and not name.startswith("language_model."):
            continue
        if not isinstance(module, torch.nn.Linear):
            continue
        if not any(name == t or name.endswith(f".{t}") for t in lora.target_modules):
            continue
        match = re.search(r"\.layers\.(\d+)\.", name)
        if layers is not None and (match is None or int(match.group(1)) not in layers):
            continue
        found[name] = module
    return found


def _unique(model, names: list[str]) -> list[str]:
    """Drop names that alias an earlier parameter (tied embeddings)."""
    seen, out = set(), []
    params = dict(model.named_parameters(remove_duplicate=False))
    for name in names:
        key = id(params[name])
        if key not in seen:
            seen.add(key)
            out.append(name)
    return out


def prepare_student(model: torch.nn.Module, spec: TrainSpec):
    """Freeze everything, copy and unfreeze the selected parameters, add LoRA. Returns the model to
    train (a peft model when LoRA is used) and the trainable parameters by name."""
    for param in model.parameters():
        param.requires_grad_(False)
    names = [n for n, _ in model.named_parameters()]
    for name in select(names, spec.params):
        param = model.get_parameter(name)
        if not param.requires_grad:
            param.data = param.data.clone()  # stop sharing storage with the parent before writing
            param.requires_grad_(True)
    if spec.lora is not None and _text_config(model) is not model.config:
        # A VLM: adapters go on its language model, which becomes a peft model inside it.
        model.language_model = _with_lora(model.language_model, spec.lora)
    elif spec.lora is not None:
        model = _with_lora(model, spec.lora)
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    return model, trainable


def _with_lora(model: torch.nn.Module, lora: LoraSpec) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    layers = _lora_layers(lora, model.config.num_hidden_layers, ())
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        layers_to_transform=layers,
        bias="none",
    )
    selected = {n for n, p in model.named_parameters() if p.requires_grad}
    model = get_peft_model(model, config)
    for name, param in model.named_parameters():  # peft froze the base: re-open our globs
        if name.removeprefix("base_model.model.").replace(".base_layer", "") in selected:
            param.requires_grad_(True)
    return model


def finish_student(model: torch.nn.Module) -> torch.nn.Module:
    """The plain model to export: LoRA merged into copies of the adapted weights, all frozen."""
    from peft import PeftModel

    if isinstance(getattr(model, "language_model", None), PeftModel):  # a VLM with LoRA on its LM
        model.language_model = finish_student(model.language_model)
    if isinstance(model, PeftModel):
        for module in model.modules():
            base = getattr(module, "base_layer", None)
            if isinstance(base, torch.nn.Linear):
                base.weight.data = base.weight.data.clone()  # the merge writes into it; it may be the parent's
        model = model.merge_and_unload()
    for param in model.parameters():
        param.requires_grad_(False)
    return model.eval()


def first_trainable_layer(model: torch.nn.Module) -> int | None:
    """Index of the lowest decoder layer with a trainable parameter (the number of frozen layers
    below it), or None when the input embeddings train (then nothing below is frozen)."""
    embeddings = model.get_input_embeddings().weight
    first = model.config.num_hidden_layers
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param is embeddings:
            return None
        match = re.search(r"\.layers\.(\d+)\.", name)
        if match is not None:
            first = min(first, int(match.group(1)))
    return first
