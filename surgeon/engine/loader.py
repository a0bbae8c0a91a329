"""A checkpoint -> the engine's model, tokenizer, stop tokens and (for a VLM) vision encoder.

Accepts what `surgeon run` exports (dense, fewer KV heads, sparse attention, VLMs in surgeon's
class or the LLaVA layout), Hugging Face
folders of the supported families, and surgeon's aliases (e.g. smollm2-135m-instruct). transformers
reads the weights (safetensors only); the engine then builds its own modules around them.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from .. import families
from ..errors import SourceError
from .models.llama import LlamaEngineModel
from .vision import LlavaFront, SurgeonVLMFront, VisionEncoder


@dataclass
class Loaded:
    model: LlamaEngineModel
    tokenizer: object
    vision: VisionEncoder | None
    eos_ids: set[int]
    name: str
    exported_quantization: dict | None = None  # a compressed-tensors export: {"bits", "scales"}


def _model_type(path: Path) -> str | None:
    config = path / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("model_type")


def _eos_ids(tokenizer, generation_config, config) -> set[int]:
    found = set()
    for holder in (generation_config, config):
        value = getattr(holder, "eos_token_id", None) if holder is not None else None
        if value is not None:
            found.update(value if isinstance(value, list) else [value])
    if tokenizer.eos_token_id is not None:
        found.add(tokenizer.eos_token_id)
    return found


def _check_family(config, where: str) -> None:
    if config.model_type not in families.engine_types():
        raise SourceError(
            f"{where}: the engine runs {', '.join(families.engine_types())} models (and surgeon VLMs built "
            f"on them); this one is '{config.model_type}'"
        )


def load(spec: str, device: torch.device, dtype: torch.dtype, trust_remote_code: bool = False) -> Loaded:
    from .. import modeling  # noqa: F401  registers surgeon's model classes with the Auto classes
    from ..checkpoints.sources import resolve_source

    path = Path(spec).expanduser()
    if path.is_dir() and _model_type(path) == families.SURGEON_VLM:
        return _load_vlm(path, device, dtype)
    if path.is_dir() and _model_type(path) == families.LLAVA:
        return _load_llava(path, device, dtype)
    source = resolve_source(spec, Path.cwd(), trust_remote_code=trust_remote_code)
    config = source.config if source.kind != "folder" else None
    if config is not None:
        _check_family(config, f"'{spec}'")
    causal_lm = source.load_model().to(device=device, dtype=dtype)
    _check_family(causal_lm.config, f"'{spec}'")
    tokenizer = source.load_tokenizer()
    eos = _eos_ids(tokenizer, source.generation_config(), causal_lm.config)
    name = path.name if path.is_dir() else spec
    exported = exported_quantization(path) if path.is_dir() else None
    return Loaded(LlamaEngineModel(causal_lm).eval(), tokenizer, None, eos, name, exported)


def exported_quantization(folder: Path) -> dict | None:
    """A compressed-tensors export's bit width and per-Linear scales (transformers has already
    turned its integers into float weights, exactly q * scale; the scales recover the integers)."""
    from safetensors import safe_open

    from ..checkpoints.compressed import compressed_tensors_config

    config = compressed_tensors_config(folder)
    if config is None:
        return None
    groups = list(config.get("config_groups", {}).values())
    weights = groups[0].get("weights") if len(groups) == 1 else None
    if not weights or weights.get("type") != "int" or not weights.get("symmetric", True):
        return None  # another scheme: the engine runs the dequantized float weights
    scales = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                if key.endswith(".weight_scale"):
                    scales[key.removesuffix(".weight_scale")] = handle.get_tensor(key).float()
    return {"bits": int(weights["num_bits"]), "scales": scales}


def from_memory(causal_lm, tokenizer, device: torch.device, dtype: torch.dtype) -> Loaded:
    """A causal LM already loaded (a recipe's patient or parent): the engine wraps its tensors, or a
    converted copy when the device or dtype differs (the caller's model is never changed)."""
    _check_family(causal_lm.config, "the model in memory")
    first = next(causal_lm.parameters())
    if first.dtype != dtype or first.device != device:
        causal_lm = copy.deepcopy(causal_lm).to(device=device, dtype=dtype)
    eos = _eos_ids(tokenizer, getattr(causal_lm, "generation_config", None), causal_lm.config)
    name = getattr(causal_lm.config, "_name_or_path", "") or causal_lm.config.model_type
    return Loaded(LlamaEngineModel(causal_lm).eval(), tokenizer, None, eos, name)


def _load_vlm(path: Path, device: torch.device, dtype: torch.dtype) -> Loaded:
    from transformers import AutoModelForImageTextToText, AutoTokenizer, GenerationConfig

    try:
        vlm = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, use_safetensors=True)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise SourceError(f"'{path}': cannot load the VLM: {exc}") from None
    vlm = vlm.to(device).eval()
    _check_family(vlm.config.text_config, f"'{path}' (its language model)")
    try:
        generation = GenerationConfig.from_pretrained(path)
    except OSError:
        generation = None
    vision = VisionEncoder(SurgeonVLMFront(vlm, tokenizer), device)
    eos = _eos_ids(tokenizer, generation, vlm.config.text_config)
    return Loaded(LlamaEngineModel(vlm.language_model).eval(), tokenizer, vision, eos, path.name)


def _load_llava(path: Path, device: torch.device, dtype: torch.dtype) -> Loaded:
    """A LLaVA-layout export (or any LLaVA checkpoint whose LM is of a supported family)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    try:
        llava = LlavaForConditionalGeneration.from_pretrained(path, dtype=dtype, use_safetensors=True)
        processor = AutoProcessor.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise SourceError(f"'{path}': cannot load the LLaVA model: {exc}") from None
    llava = llava.to(device).eval()
    text_config = llava.config.text_config
    _check_family(text_config, f"'{path}' (its language model)")
    # The engine's Llama reads `.config`, `.model` (embeddings, layers, norm, rotary) and `.lm_head`.
    causal_lm = SimpleNamespace(config=text_config, model=llava.model.language_model, lm_head=llava.lm_head)
    vision = VisionEncoder(LlavaFront(llava, processor), device)
    eos = _eos_ids(processor.tokenizer, llava.generation_config, text_config)
    return Loaded(LlamaEngineModel(causal_lm).eval(), processor.tokenizer, vision, eos, path.name)
