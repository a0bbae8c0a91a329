"""Dequantise a GGUF checkpoint into a plain safetensors folder (done once per file, then cached)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..surgery import architecture


def convert_gguf(gguf: Path, out: Path) -> None:
    """Write config, fp32 safetensors weights, tokenizer and chat template of `gguf` into `out`.

    transformers refuses to save a model loaded from GGUF (its config carries a gguf
    quantization_config), so the dequantised tensors are moved into a fresh model built from the
    clean config; they are exact fp32 images of the quantised values.
    """
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = architecture.clean_config(loaded.config)
    config.architectures = [type(loaded).__name__]
    model = architecture.assemble(config, loaded.state_dict(), loaded.generation_config)
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)
    (out / "surgeon_source.json").write_text(json.dumps({"converted_from": gguf.name}, indent=2))
