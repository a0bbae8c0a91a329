"""A quantize step's integers written as compressed-tensors: the safetensors layout llm-compressor
writes and transformers (with the `compressed-tensors` package) and vLLM load.

Every quantized Linear's `weight` becomes `weight_packed` (its b-bit values packed into int32 by
compressed-tensors' own packer), `weight_scale` [out, groups] and `weight_shape`; symmetric formats only (the quantize
step refuses asymmetric ones, whose packed zero points transformers 5 cannot load). The config gains a
`quantization_config` naming the scheme and listing the Linears left in float.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FORMAT = "pack-quantized"


def compressed_state(state: dict[str, torch.Tensor], quantization) -> dict[str, torch.Tensor]:
    """`state` (the model's state dict) with each quantized Linear's weight replaced by its
    compressed tensors."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    fmt = quantization.format
    if not fmt.symmetric:
        raise ValueError("compressed-tensors export: symmetric formats only")
    out = dict(state)
    for name, weight in quantization.weights.items():
        del out[f"{name}.weight"]
        out[f"{name}.weight_packed"] = pack_to_int32(weight.q.contiguous(), fmt.bits)
        out[f"{name}.weight_scale"] = weight.scale.float().contiguous()
        out[f"{name}.weight_shape"] = torch.tensor(list(weight.q.shape), dtype=torch.int64)
    return out


def compressed_tensors_config(folder: Path) -> dict | None:
    """The `quantization_config` of a compressed-tensors checkpoint in `folder` (a quantize step's
    export), or None for any other folder."""
    config = folder / "config.json"
    if not config.is_file():
        return None
    quantization = json.loads(config.read_text()).get("quantization_config") or {}
    return quantization if quantization.get("quant_method") == "compressed-tensors" else None


def quantization_config(quantization, linear_names: list[str]) -> dict:
    """The config.json entry: one scheme for the quantized Linears; the others are `ignore`d."""
    from compressed_tensors import QuantizationConfig
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    fmt = quantization.format
    weights = QuantizationArgs(
        num_bits=fmt.bits,
        type="int",
        symmetric=fmt.symmetric,
        strategy="channel" if fmt.group_size is None else "group",
        group_size=fmt.group_size,
        observer="minmax",
    )
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        format=FORMAT,
        quantization_status="compressed",
        ignore=[name for name in linear_names if name not in quantization.weights],
    )
    values = config.model_dump(mode="json", exclude_none=True)
    values["quant_method"] = "compressed-tensors"
    values["surgeon_method"] = quantization.method  # rtn or gptq: how the integers were chosen
    return values
